"""Tokenization throughput of `colonnade prepare`: docs/s and tokens/s, workers=1 vs 2 (vs 4).

    .venv/bin/python benchmarks/prepare.py [--rounds 3] [--mb 1] [--workers 1,2] [--quick]

The input is the built-in stdlib corpus (`--mb` megabytes of Python source, cut into ~2 KB
documents), written once as a `.jsonl` file and as a `.parquet` file; a byte-level BPE
tokenizer (vocab 2048) is trained once on it. Each round then runs `prepare()` with that
tokenizer for every (format, workers) pair, in an order rotated every round, into a fresh
directory, and times the whole call (reading, parsing, encoding, writing). A `read only` row
times `iter_documents` over the same input, the part that stays in the main process.
Reported: medians over rounds, docs/s, tokens/s and the speed-up against workers=1 of the
same format; every run's data.bin must be byte-identical to the workers=1 run (the benchmark
fails otherwise). Writes benchmarks/results/prepare.json.

workers=1 already encodes on every core (the tokenizers library spreads one `encode_batch`
over its threads); workers=N moves encoding to N single-threaded processes while the main
process reads and writes, so its gain is bounded by the cores left over.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa
import pyarrow.parquet as pq

from colonnade.data.corpus import iter_documents, iter_stdlib_documents
from colonnade.data.prepare import prepare
from colonnade.data.tokenizer import train_bpe_from_texts

RESULTS = Path(__file__).resolve().parent / "results" / "prepare.json"
DOC_CHARS = 2_000
"""Documents are stdlib sources cut at blank lines into ~2 KB pieces (web-document sized)."""


def split_docs(sources: list[str], size: int = DOC_CHARS) -> list[str]:
    """Cut each source file at blank lines into documents of about `size` characters."""
    docs = []
    for text in sources:
        piece = ""
        for para in text.split("\n\n"):
            piece += para + "\n\n"
            if len(piece) >= size:
                docs.append(piece)
                piece = ""
        if piece.strip():
            docs.append(piece)
    return docs


def make_inputs(work: Path, megabytes: float) -> tuple[dict[str, Path], Path]:
    """The corpus as jsonl and parquet, and a BPE tokenizer trained on it."""
    docs = split_docs(list(iter_stdlib_documents(int(megabytes * 1_000_000))))
    inputs = {"jsonl": work / "corpus.jsonl", "parquet": work / "corpus.parquet"}
    with inputs["jsonl"].open("w") as fh:
        for doc in docs:
            fh.write(json.dumps({"text": doc}) + "\n")
    pq.write_table(pa.table({"text": docs}), inputs["parquet"], row_group_size=256)
    tok = work / "tokenizer.json"
    train_bpe_from_texts(docs, 2048, tok)
    return inputs, tok


def run_once(path: Path, tok: Path, workers: int, out: Path) -> dict[str, float]:
    """Time one prepare() call into a fresh `out`."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    res = prepare(path, out, None, tok, num_workers=workers, progress=False, log=lambda _: None)
    seconds = time.perf_counter() - start
    return {"s": seconds, "docs": res.num_docs, "tokens": res.num_tokens}


def time_read(path: Path) -> dict[str, float]:
    start = time.perf_counter()
    docs = sum(1 for _ in iter_documents(path))
    return {"s": time.perf_counter() - start, "docs": docs, "tokens": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=float, default=1.0, help="corpus size in MB of source")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--quick", action="store_true", help="1 round, 0.3 MB")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.mb = 1, 0.3
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="prepare-bench-") as tmp:
        work = Path(tmp)
        inputs, tok = make_inputs(work, args.mb)
        variants = [(fmt, w) for fmt in inputs for w in [0, *workers]]  # 0 = read only
        runs: dict[tuple[str, int], list[dict[str, float]]] = {v: [] for v in variants}
        reference: dict[str, bytes] = {}
        for r in range(args.rounds):
            shift = r % len(variants)
            for fmt, w in variants[shift:] + variants[:shift]:
                if w == 0:
                    runs[fmt, w].append(time_read(inputs[fmt]))
                    continue
                out = work / f"out-{fmt}-{w}"
                runs[fmt, w].append(run_once(inputs[fmt], tok, w, out))
                data = (out / "data.bin").read_bytes()
                if reference.setdefault(fmt, data) != data:
                    raise SystemExit(f"{fmt}: workers={w} wrote different tokens")
    report = summarise(runs, args, workers)
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")


def summarise(runs: dict[tuple[str, int], list[dict[str, float]]], args: argparse.Namespace,
              workers: list[int]) -> dict[str, Any]:
    rows = []
    for (fmt, w), samples in runs.items():
        med = statistics.median(s["s"] for s in samples)
        base = statistics.median(s["s"] for s in runs[fmt, workers[0]])
        rows.append({
            "format": fmt, "workers": w or None, "what": "read only" if w == 0 else "prepare",
            "median_s": med, "docs": samples[0]["docs"], "tokens": samples[0]["tokens"],
            "docs_per_s": samples[0]["docs"] / med, "tokens_per_s": samples[0]["tokens"] / med,
            "speedup_vs_first": None if w == 0 else base / med,
            "all_s": [s["s"] for s in samples],
        })
    return {"benchmark": "prepare", "rounds": args.rounds, "corpus_mb": args.mb,
            "cpu_count": os.cpu_count(), "identical_outputs": True, "rows": rows}


def print_table(report: dict[str, Any]) -> None:
    print(f"prepare throughput: {report['corpus_mb']} MB stdlib corpus, {report['rounds']} "
          f"rounds, {report['cpu_count']} CPUs (medians)")
    head = (f"{'format':8} {'what':10} {'workers':>7} {'s':>7} {'docs/s':>9} {'tokens/s':>11} "
            f"{'x':>6}")
    print(head)
    print("-" * len(head))
    for row in report["rows"]:
        speed = "" if row["speedup_vs_first"] is None else f"{row['speedup_vs_first']:.2f}"
        tokens = "" if not row["tokens"] else f"{row['tokens_per_s']:,.0f}"
        print(f"{row['format']:8} {row['what']:10} {row['workers'] or '-':>7} "
              f"{row['median_s']:7.2f} {row['docs_per_s']:9,.0f} {tokens:>11} {speed:>6}")
    print("outputs identical across worker counts: yes")


if __name__ == "__main__":
    main()
