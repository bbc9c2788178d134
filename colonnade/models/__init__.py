"""Decoder models built from tensor-parallel layers."""
