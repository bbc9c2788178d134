"""Memory snapshots and the recovery ladder on the rank pool (issue 40), float64.

One run per layout (tp2 x dp2 with ZeRO-1, and with ZeRO-3): a trainer takes 2 steps with a
snapshot after each, a disk checkpoint after the first; then 2 more steps without snapshots
are the uninterrupted reference. A fresh trainer of the same layout recovers by the ladder in
three situations, each a real collective :func:`recover` over the 4 ranks:

1. rank 1's own file lost (its node gone): rank 1 receives its partner's copy, the others read
   their own; every restored tensor is bit-equal to the state at step 2 and the next 2 losses
   equal the reference's exactly;
2. both holders of rank 1's state gone (its own file and rank 2's copy): all fall back to the
   disk checkpoint at step 1 and the reason names both;
3. snapshots of another layout (fingerprint differs) are refused: nothing is restored from
   memory.

And the memory each rank holds (own file + peer copy, tensor bytes) equals the formula
``own_bytes(r) + own_bytes(source(r))`` with ``own_bytes = P_owned * 8 + optimizer state bytes
+ RNG state``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from colonnade.checkpoint.memory import (
    MemorySnapshots,
    memory_cost,
    own_bytes_all,
    partner_of,
    payload_bytes,
    source_of,
)
from colonnade.checkpoint.recovery import newest_common_step, recover
from colonnade.checkpoint.snapshot_state import layout_fingerprint, state_tensors
from colonnade.checkpoint.training_state import save_training
from tests.checkpoint.harness import Layout, batches_for, make_config
from tests.checkpoint.test_zero_reshard import Zero

LAYOUTS = [Zero(Layout(tp=2, dp=2), 1), Zero(Layout(tp=2, dp=2), 3)]


def _trainer(z: Zero, mem: str) -> Any:
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime
    from tests.parity import rank_groups

    cfg = make_config(z.layout)
    cfg = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, zero_stage=z.stage),
        checkpoint=dataclasses.replace(cfg.checkpoint, memory_interval=1, memory_dir=mem))
    lay = z.layout
    from colonnade.parallel.dims import ParallelDims

    groups = rank_groups(ParallelDims(tp=lay.tp, dp=lay.dp))
    return Trainer(Runtime(cfg, torch.device("cpu"), groups), None)


def _steps(trainer: Any, count: int) -> list[float]:
    g = trainer.groups
    return [trainer.train_step(batches_for(trainer.step, g.dp.rank, g.dp.size))["loss"]
            for _ in range(count)]


def _own_formula(trainer: Any) -> int:
    """P_owned * b_param + optimizer state + RNG state (bytes; the tiny llama has no
    parameter outside the flat buffers and no persistent buffer)."""
    opt = trainer.optimizer
    params = sum(t.numel() * t.element_size() for t in opt.ddp.owned_params())
    return params + opt.state_bytes() + torch.get_rng_state().numel()


def ladder_run(z: Zero, root: str) -> dict[str, Any]:
    """The whole scenario of the module docstring on one pool rank; returns what it saw."""
    mem, disk = Path(root) / "mem", Path(root) / "ckpt"
    a = _trainer(z, str(mem))
    snaps = MemorySnapshots.create(a, run_id="test", per_node=a.groups.world.size)
    snaps.clear()
    out: dict[str, Any] = {"rank": a.groups.rank}
    _steps(a, 1)
    save_training(a, disk, keep_last=1)
    snaps.snapshot(a)
    _steps(a, 1)
    snaps.snapshot(a)
    snaps.wait()
    at_two = {k: v.clone() for k, v in state_tensors(a).items()}
    reference = _steps(a, 2)
    # the memory formula, from the files this rank holds
    own = own_bytes_all(snaps, a)
    held = snaps.holdings()
    out["held_bytes"] = sum(payload_bytes(h.path) for h in held)
    out["formula"] = memory_cost([int(x) for x in snaps.group.all_gather_object(
        _own_formula(a))], snaps.per_node)[snaps.rank]
    out["own"] = own
    out["held"] = sorted((h.owner, h.step, h.peer) for h in held)

    # 1. rank 1's node is lost: its own file gone, its partner's copy restores it
    b = _trainer(z, str(mem))
    lost = [h for h in held if snaps.rank == 1 and not h.peer]
    saved = {h.path: h.path.read_bytes() for h in lost}
    for h in lost:
        h.path.unlink()
    rec = recover(b, snaps, disk)
    got = state_tensors(b)
    out["first"] = {"step": rec.step, "sources": rec.sources, "moved": rec.bytes_moved,
                    "line": rec.describe(),
                    "unequal": sorted(k for k in at_two if not torch.equal(at_two[k], got[k])),
                    "losses": _steps(b, 2), "reference": reference}
    for path, data in saved.items():
        path.write_bytes(data)

    # 2. both holders of rank 1's state are gone: the disk at step 1
    for h in held:
        if h.owner == 1 and h.step == 2:
            h.path.unlink()
    c = _trainer(z, str(mem))
    rec = recover(c, snaps, disk)
    out["second"] = {"step": rec.step, "sources": rec.sources, "line": rec.describe(),
                     "trainer_step": c.step}

    # 3. another layout's fingerprint: the (remaining) snapshots are refused
    other = dataclasses.replace(a.config, parallel=dataclasses.replace(a.config.parallel,
                                                                       zero_stage=2))
    snaps.fingerprint = layout_fingerprint(other, a.groups.world.size)
    d = _trainer(z, str(mem))
    rec = recover(d, snaps, None)
    out["third"] = {"sources": rec.sources, "line": rec.describe(), "step": d.step}
    snaps.clear()
    return out


@pytest.mark.parametrize("z", LAYOUTS, ids=str)
def test_memory_ladder(z: Zero, run_ranks: Callable[..., list[Any]], tmp_path: Path) -> None:
    """See the module docstring."""
    results = run_ranks(z.world, ladder_run, z, str(tmp_path))
    first = [r["first"] for r in results]
    assert first[0]["sources"] == ["memory", "peer", "memory", "memory"], first[0]
    assert all(f["step"] == 2 for f in first)
    assert first[0]["moved"] > results[0]["own"][1]  # rank 1's file: its tensors + header
    assert "rank(s) 1 from their partner's copy" in first[0]["line"], first[0]["line"]
    for r, f in enumerate(first):
        assert f["unequal"] == [], (r, f["unequal"])  # bit-equal
        assert f["losses"] == f["reference"], (r, f["losses"], f["reference"])  # exact
    second = results[0]["second"]
    assert second["sources"] == ["disk"] * 4 and second["step"] == 1, second
    assert all(r["second"]["trainer_step"] == 1 for r in results)
    assert ("rank 1's snapshot of step 2 and its copy on rank 2 are both gone: falling back "
            "to disk step 1") in second["line"], second["line"]
    third = results[0]["third"]
    assert third["sources"] == ["none"] * 4 and third["step"] == 0, third
    assert "layout" in third["line"], third["line"]
    for r, res in enumerate(results):  # own copy + the source's copy, nothing else
        src = source_of(r, 4, 4)
        assert res["held"] == sorted([(r, 2, False), (src, 2, True)]), (r, res["held"])
        assert res["held_bytes"] == res["formula"] == res["own"][r] + res["own"][src], res


def test_newest_common_step_prefers_the_newest_covered() -> None:
    """The decision alone: step 5 misses rank 2 (own and partner's copy), step 4 is whole."""
    listings = [{"own": {4: 1, 5: 1}, "peer": {4: 1, 5: 1}},
                {"own": {4: 1, 5: 1}, "peer": {4: 1}},
                {"own": {}, "peer": {4: 1, 5: 1}},
                {"own": {4: 1, 5: 1}, "peer": {4: 1}}]
    step, sources, why = newest_common_step(listings, [1, 2, 3, 0])
    assert step == 4 and sources == ["memory", "memory", "peer", "memory"], (step, sources)
    assert why == "rank 2's snapshot of step 5 and its copy on rank 3 are both gone", why


def test_partners_are_on_the_next_node() -> None:
    """partner(r): the same local rank on the next node (2 nodes x 4), else the next rank (one
    node); source is its inverse, and the memory formula adds the source's bytes."""
    assert [partner_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [partner_of(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]
    for world, per_node in ((8, 4), (4, 4), (6, 2), (1, 1)):
        assert all(source_of(partner_of(r, world, per_node), world, per_node) == r
                   for r in range(world))
    assert memory_cost([10, 20, 30, 40], 4) == [50, 30, 50, 70]
    assert memory_cost([10], 1) == [10]
