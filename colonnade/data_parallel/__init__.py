"""Data parallelism: gradient buffers, buckets, overlapped reductions."""
