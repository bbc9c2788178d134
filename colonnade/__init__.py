"""Colonnade: tensor, sequence, pipeline and data parallel transformer training in pure PyTorch."""

__version__ = "0.1.0"
