"""Data parallelism: flat buffers, gradient buckets, overlapped reductions (see ddp.py)."""

from colonnade.data_parallel.buffer import ALIGN, Bucket, FlatBuffers
from colonnade.data_parallel.ddp import DataParallel, build_data_parallel

__all__ = ["ALIGN", "Bucket", "DataParallel", "FlatBuffers", "build_data_parallel"]
