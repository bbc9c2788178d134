"""Encoding documents to token ids, in this process or in a pool of worker processes.

The main process reads and parses documents and cuts them into batches (`ENCODE_BATCH`
documents, at most `BATCH_CHARS` characters); each batch becomes `ids + [EOD]` per document.
With `num_workers == 1` batches are encoded here (the tokenizers library already spreads one
`encode_batch` over its own threads). With more, each batch goes to one of `num_workers`
processes and results are taken back strictly in submission order, with at most
`2 * num_workers` batches in flight, so memory stays bounded and the output is identical to the
single-process path, token for token. Workers are forked where the platform allows (no import
cost) and encode single-threaded (the process count is the parallelism).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from multiprocessing.pool import AsyncResult, Pool

import numpy as np
from tokenizers import Tokenizer

from colonnade.reliability.interrupt import STOP_SIGNALS, stop_signals_deferred

ENCODE_BATCH = 256
"""Documents per batch (one `encode_batch` call, one task of the pool)."""

BATCH_CHARS = 500_000
"""A batch is cut early once it holds this many characters (about 0.1-0.2 s of encoding), so
a pool has several tasks even when documents are long."""

Encoded = tuple[np.ndarray, np.ndarray]
"""A batch's token ids, concatenated (int64), and each document's length (EOD included)."""

_worker_state: dict[str, object] = {}  # per worker process: its tokenizer and EOD id


def batches(docs: Iterable[str]) -> Iterator[list[str]]:
    """Consecutive batches of `docs` (see ENCODE_BATCH and BATCH_CHARS)."""
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) == ENCODE_BATCH or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_batch(tok: Tokenizer, eod: int, batch: list[str]) -> Encoded:
    """`ids + [eod]` of each document of `batch`, flattened, and the per-document lengths."""
    id_lists = [enc.ids for enc in tok.encode_batch(batch, add_special_tokens=False)]
    lengths = np.fromiter((len(ids) + 1 for ids in id_lists), dtype=np.int64,
                          count=len(id_lists))
    flat = np.empty(int(lengths.sum()), dtype=np.int64)
    pos = 0
    for ids, n in zip(id_lists, lengths.tolist(), strict=True):
        flat[pos:pos + n - 1] = ids
        flat[pos + n - 1] = eod
        pos += n
    return flat, lengths


def encode_stream(
    tok: Tokenizer, eod: int, docs: Iterable[str], num_workers: int = 1
) -> Iterator[Encoded]:
    """Encoded batches of `docs`, in order; `num_workers` > 1 encodes in worker processes."""
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers} must be >= 1")
    if num_workers == 1:
        for batch in batches(docs):
            yield encode_batch(tok, eod, batch)
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool: Pool | None = None
    try:
        with stop_signals_deferred():  # one raised in a fork hook would be lost: raised after
            pool = _start_pool(mp.get_context(method), num_workers, tok.to_str(), eod)
        pending: deque[AsyncResult[Encoded]] = deque()
        for batch in batches(docs):
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


def _start_pool(ctx: mp.context.BaseContext, workers: int, tok_json: str, eod: int) -> Pool:
    """Start the pool; the workers inherit TOKENIZERS_PARALLELISM=false (one thread each, and
    no fork warning from tokenizers) and Ctrl-C / SIGTERM blocked until their initializer;
    this process's own setting and signal mask are restored at once."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return ctx.Pool(workers, initializer=_init_worker, initargs=(tok_json, eod))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _init_worker(tok_json: str, eod: int) -> None:
    """A worker leaves Ctrl-C to the parent (which stops the pool) and dies on the pool's
    SIGTERM, whatever handlers and signal mask it inherited from the parent by fork (the
    CLI's ``sigterm_interrupts`` would make it print a traceback on its way out)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held by the parent's fork
    _worker_state["tok"] = Tokenizer.from_str(tok_json)
    _worker_state["eod"] = eod


def _encode_in_worker(batch: list[str]) -> Encoded:
    tok = _worker_state["tok"]
    eod = _worker_state["eod"]
    assert isinstance(tok, Tokenizer) and isinstance(eod, int)
    return encode_batch(tok, eod, batch)
