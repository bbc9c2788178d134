"""Checkpoints of ZB-V runs (``parallel.schedule = "zbv"``, vp 2, the "v" placement).

Stage s of a ZB-V run holds virtual stages s and 2 pp - 1 - s, so stage 0 holds both the
embedding and the head, and a tied gpt2 head is the embedding's own Parameter there (no copy on
another stage, no embedding-group reduction). A checkpoint is keyed by global parameter names,
so none of this may show: train 2 steps under layout A, save, resume under layout B for 2 more
(float64). B's losses of steps 3-4 and its final parameters equal both the run that stayed in
A and the uninterrupted single-process run (relative error <= 1e-10), for zbv -> 1f1b (pp 2),
zbv -> pp 1, interleaved 1f1b (vp 2) -> zbv and a ZeRO-1 dp 2 zbv run -> tp 2 x pp 2, llama
and tied gpt2. The tied zbv checkpoint holds the embedding once and no head tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint.harness import Layout, merge, run_load, run_save
from tests.parity import rel_err

TOL = 1e-10
FLOOR = 1e-3
"""Norm floor of the parameter comparison: gpt2's key bias has an exactly-zero gradient
(softmax is shift invariant), so it holds only round-off that Adam turns into ~1e-11 values;
no relative error of it means anything (every other parameter is far above 1e-3)."""
ZBV = Layout(pp=2, vp=2, schedule="zbv")

CASES = [  # (saved under, resumed under, arch, tied)
    (ZBV, Layout(pp=2), "llama", False),
    (ZBV, Layout(), "gpt2", True),
    (ZBV, Layout(pp=2), "gpt2", True),  # the head moves to a copy on the last stage
    (Layout(pp=2, vp=2), ZBV, "gpt2", True),  # the copy on stage 1 becomes the embedding
    (Layout(pp=2, vp=2, dp=2, zero=True, schedule="zbv"), Layout(tp=2, pp=2), "gpt2", True),
    (Layout(pp=2), Layout(pp=2, vp=2, dp=2, zero=True, schedule="zbv"), "llama", False),
]


@pytest.mark.parametrize(("a", "b", "arch", "tie"), CASES,
                         ids=[f"{a}->{b}-{arch}" for a, b, arch, _ in CASES])
def test_zbv_resume_in_other_layout(run_ranks: Callable[..., list[Any]], tmp_path: Path,
                                    a: Layout, b: Layout, arch: str, tie: bool) -> None:
    root = str(tmp_path / "ckpt")
    stayed = run_ranks(a.world, run_save, a, root, 2, 2, "fp64", arch, tie)
    moved = run_ranks(b.world, run_load, b, root, 2, "fp64", arch, tie)
    assert moved[0]["step"] == 4
    single = run_ranks(1, run_save, Layout(), str(tmp_path / "single"), 2, 2, "fp64", arch,
                       tie)
    _same_run(stayed, moved, "stayed vs resumed")
    _same_run(single, moved, "single-process vs resumed")
    _same_run(single, stayed, "single-process vs stayed")


def _same_run(a: list[dict[str, Any]], b: list[dict[str, Any]], what: str) -> None:
    """The last 2 losses and the merged final parameters of two runs agree within TOL."""
    la, lb = a[0]["losses"][-2:], b[0]["losses"][-2:]
    for x, y in zip(la, lb, strict=True):
        assert abs(x - y) <= TOL * abs(y), f"{what}: losses differ: {la} vs {lb}"
    pa, pb = merge(a), merge(b)
    assert pa.keys() == pb.keys(), sorted(set(pa) ^ set(pb))
    for k in pa:
        err = rel_err(pa[k], pb[k], FLOOR)
        assert err <= TOL, f"{what}: {k}: rel err {err:.3e}"


def test_tied_zbv_checkpoint_holds_the_embedding_once(run_ranks: Callable[..., list[Any]],
                                                      tmp_path: Path) -> None:
    """Stage 0 of a tied zbv run writes the shared embedding / head once, with its optimizer
    states; no stage writes a head tensor of its own."""
    root = tmp_path / "ckpt"
    run_ranks(ZBV.world, run_save, ZBV, str(root), 1, 0, "fp64", "gpt2", True)
    step = root / (root / "latest").read_text().strip()
    index = json.loads((step / "index.json").read_text())
    names = _entry_names(index)
    embed = [n for n in names if "embedding.word.weight" in n]
    assert sorted(embed) == ["model/embedding.word.weight",
                             "optim/embedding.word.weight/exp_avg",
                             "optim/embedding.word.weight/exp_avg_sq"], embed
    assert not [n for n in names if "head" in n], names


def _entry_names(index: Any) -> list[str]:
    """Logical tensor names listed by a checkpoint's index.json."""
    tensors = index.get("tensors", index)
    return sorted(tensors)
