"""Colonnade's data pipeline: corpus reading, BPE tokenizer, indexed datasets, samplers.

Flow: `readers` resolve the input (text, jsonl(.gz/.zst), json, csv, parquet, arrow, HF datasets
dirs, globs, lists) -> `corpus` yields documents and collects unreadable ones -> `tokenizer` and
`encode` map them to ids (optionally in worker processes) -> `prepare` writes an indexed
dataset (`data.bin` + `data.idx`) -> `WindowDataset` cuts fixed-length samples from the flat token
stream -> `BatchSampler` deals global batches to data-parallel ranks as micro-batches.
"""

from __future__ import annotations

from colonnade.data.corpus import (
    DEFAULT_MAX_BYTES,
    DocumentStats,
    iter_documents,
    iter_stdlib_documents,
    stdlib_files,
)
from colonnade.data.dataset import BlendedDataset, WindowDataset
from colonnade.data.errors import CorpusError, DataError, IndexedDatasetError, TokenizerError
from colonnade.data.indexed import IndexedDataset, IndexedDatasetWriter
from colonnade.data.prepare import PreparedData, prepare
from colonnade.data.sampler import BatchSampler, collate
from colonnade.data.tokenizer import EOD_TOKEN, eod_id, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "DEFAULT_MAX_BYTES",
    "EOD_TOKEN",
    "BatchSampler",
    "BlendedDataset",
    "CorpusError",
    "DataError",
    "DocumentStats",
    "IndexedDataset",
    "IndexedDatasetError",
    "IndexedDatasetWriter",
    "PreparedData",
    "TokenizerError",
    "WindowDataset",
    "collate",
    "eod_id",
    "iter_documents",
    "iter_stdlib_documents",
    "load_tokenizer",
    "prepare",
    "stdlib_files",
    "train_bpe_tokenizer",
]
