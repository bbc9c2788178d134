"""Exceptions raised by the data pipeline.

Every error names the file (or field) at fault and says how to fix it, so that a bad corpus or a
damaged dataset is reported before any training step runs.
"""

from __future__ import annotations


class DataError(Exception):
    """Base class of every data-pipeline error (bad corpus, tokenizer or dataset files)."""


class CorpusError(DataError):
    """A corpus file cannot be read as documents (not UTF-8, malformed JSON lines, no files)."""


class TokenizerError(DataError):
    """A tokenizer file is missing, corrupt, or lacks the end-of-document token."""


class IndexedDatasetError(DataError):
    """An indexed dataset (`<prefix>.bin` / `<prefix>.idx`) is missing, corrupt or truncated."""
