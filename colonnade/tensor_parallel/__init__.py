"""Tensor and sequence parallelism: mappings, layers, cross entropy, sharding declarations."""
