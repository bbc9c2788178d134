"""Loading reads only this rank's part: HF import on tp2 x pp2 reads its slices, a ZeRO-1
resume its own optimizer range (bytes counted through a wrapper around ``safe_open``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.checkpoint.harness import (
    CountingOpen,
    Layout,
    assert_same_run,
    gathered,
    make_trainer,
    run_save,
    train_steps,
)
from tests.checkpoint.test_hf import _hf_model, _save


def _param_bytes(trainer: Any) -> int:
    """Bytes of the boxes of this rank's parameters (its pp stage, its tp shard, no padding)."""
    from colonnade.models.params import unique_params
    from colonnade.tensor_parallel.sharding import tp_coords

    coords = tp_coords(trainer.groups.tp.rank, trainer.groups.tp.size)
    return sum(math.prod(p.sharding.box(coords)[1]) * p.element_size()
               for p in unique_params(trainer.chunks))


def _hf_init(hf_dir: str) -> dict[str, Any]:
    """Rank side: init a tp2 x pp2 fp32 trainer from the HF dir, counting the bytes read."""
    from colonnade.checkpoint import hf
    from colonnade.checkpoint.finetune import init_weights
    from colonnade.models.params import unique_params
    from colonnade.tensor_parallel.sharding import tp_coords

    trainer = make_trainer(Layout(tp=2, pp=2), precision="fp32")
    counter = CountingOpen()
    hf.safe_open = counter
    try:
        init_weights(trainer, hf_dir)
    finally:
        hf.safe_open = counter._open
    _, full = hf.read_hf(hf_dir)
    g = trainer.groups
    coords = tp_coords(g.tp.rank, g.tp.size)
    err = max(float((p.detach() - p.sharding.shard(full[p.sharding.key], coords)).abs().max())
              for p in unique_params(trainer.chunks))
    copies = sum(p.numel() * 4 for p in unique_params(trainer.chunks)
                 if p.sharding.dim is None and g.tp.rank > 0)  # tp-replicated: every tp rank
    return {"bytes": counter.bytes, "expected": _param_bytes(trainer), "err": err,
            "copies": copies}


def test_hf_import_reads_only_this_ranks_slices(run_ranks: Callable[..., list[Any]],
                                                tmp_path: Path) -> None:
    hf_dir = _save(_hf_model("llama", False), tmp_path / "hf")
    total = sum(p.numel() * 4 for p in _hf_model("llama", False).parameters())
    out = run_ranks(4, _hf_init, str(hf_dir))
    for rank, r in enumerate(out):
        assert r["err"] == 0.0, rank
        assert r["bytes"] == r["expected"], (rank, r)  # its slices, nothing else
        assert r["bytes"] < 0.4 * total, (rank, r["bytes"], total)
    # together the ranks read the file once, plus the norms each further tp rank needs too
    assert sum(r["bytes"] for r in out) == total + sum(r["copies"] for r in out)


def _resume_counted(layout: Layout, root: str) -> dict[str, Any]:
    """Rank side: resume ``root`` under ``layout`` counting bytes read, then train 2 steps."""
    from colonnade.checkpoint import format as fmt
    from colonnade.checkpoint.sharded import optim_entries
    from colonnade.checkpoint.training_state import load_training

    trainer = make_trainer(layout)
    counter = CountingOpen()
    fmt.safe_open = counter
    try:
        load_training(trainer, root)
    finally:
        fmt.safe_open = counter._open
    own = sum(e.tensor.numel() * e.tensor.element_size()
              for e in optim_entries(trainer.optimizer, trainer.groups))
    losses = train_steps(trainer, 2)
    return {"bytes": counter.bytes, "model": _param_bytes(trainer), "own": own,
            "losses": losses, "params": gathered(trainer)}


def _check_resume(run_ranks: Callable[..., list[Any]], root: str, a: Layout,
                  b: Layout) -> None:
    stayed = run_ranks(a.world, run_save, a, root, 2, 2)
    moved = run_ranks(b.world, _resume_counted, b, root)
    for rank, r in enumerate(moved):
        assert r["own"] > 0
        assert r["bytes"] == r["model"] + r["own"], (rank, r["bytes"], r["model"], r["own"])
    assert_same_run(stayed, moved, 1e-10, skip_losses=2)


def test_zero1_resume_reads_only_own_range(run_ranks: Callable[..., list[Any]],
                                           tmp_path: Path) -> None:
    """dp2 ZeRO-1 -> dp2 ZeRO-1: each rank reads its model and its half of the optimizer."""
    _check_resume(run_ranks, str(tmp_path / "c"), Layout(dp=2, zero=True),
                  Layout(dp=2, zero=True))


def test_zero1_resume_other_tp_reads_only_own_range(run_ranks: Callable[..., list[Any]],
                                                    tmp_path: Path) -> None:
    """tp2 x dp2 ZeRO-1 -> dp4 ZeRO-1 (tp shards joined, ranges re-cut): still exactly the
    rank's own range, and the same run (float64)."""
    _check_resume(run_ranks, str(tmp_path / "c"), Layout(tp=2, dp=2, zero=True),
                  Layout(dp=4, zero=True))


def test_partial_reads_are_exact() -> None:
    """plan_reads on hand-made pieces: a flat range across two flat pieces and a box across two
    tp boxes read exactly their elements."""
    from colonnade.checkpoint.reads import plan_reads

    def piece(off: tuple[int, ...], shape: tuple[int, ...],
              flat: tuple[int, int] | None) -> dict[str, Any]:
        return {"offsets": list(off), "shape": list(shape),
                "flat": list(flat) if flat else None, "file": "f", "tensor": "t", "crc32": 0}

    full = torch.arange(6 * 4.0).reshape(6, 4)
    halves = [piece((0, 0), (6, 2), (0, 7)), piece((0, 0), (6, 2), (7, 12)),
              piece((0, 2), (6, 2), None)]
    stored = [full[:, :2].reshape(-1)[:7], full[:, :2].reshape(-1)[7:12], full[:, 2:]]

    def run(box: Any, flat: tuple[int, int] | None) -> torch.Tensor:
        reads, covered = plan_reads(halves, box, flat)
        out = torch.zeros(box[1] if flat is None else (flat[1] - flat[0],))
        for r in reads:
            src = stored[halves.index(r.piece)][r.src]
            if r.flat_dst:
                out.view(-1)[r.dst[0]] = src.reshape(-1)
            else:
                out[r.dst] = src
        assert covered == sum(r.numel for r in reads) == out.numel()
        return out

    box = ((1, 1), (4, 2))  # rows 1-4, cols 1-2: half in each tp box
    assert torch.equal(run(box, None), full[1:5, 1:3])
    assert torch.equal(run(box, (3, 7)), full[1:5, 1:3].reshape(-1)[3:7])
    whole = ((0, 0), (6, 4))
    assert torch.equal(run(whole, (5, 19)), full.reshape(-1)[5:19])
