"""The MoE layer under sequence and context parallelism, and under activation recomputation.

Ranks hold rows of the SAME sequences: under sp a tp rank holds s/tp rows, under cp a cp rank
holds its two zigzag chunks; ep spans every such rank (expert_tp = 1, ep = tp x cp). Against
the single-process layer on the whole sequence (float64, capacity decided per whole sequence):
each rank's output rows and input gradient are the reference's rows; an expert weight's
gradient (every token of its experts reaches its rank) is the reference's local slice; a
tp-split shared-expert weight's gradient, summed over cp, is the reference's tp shard; a
replicated weight's (router, shared gate) gradient, summed over all ranks, is the reference's.

Recomputation: torch.utils.checkpoint around the layer (what full recompute does) gives the
same output and gradients, and records each micro-batch's statistics once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc

from colonnade.context_parallel.layout import zigzag_index
from colonnade.moe.state import MoEState
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.sharding import Sharding
from tests.moe.test_layer import KEY, B, S, _cfg, _ctx, _grads, _input, _layer, seq_first

CAPACITY = 0.75


def _rows(tp: int, tp_rank: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Sequence positions [s/(cp tp)] of a rank's rows, in its local order."""
    positions = zigzag_index(S, cp, cp_rank)  # [s/cp]
    part = S // (cp * tp)
    return positions[tp_rank * part:(tp_rank + 1) * part]


def _sp_cp_rank(tp: int, cp: int, dispatcher: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(tp=tp, cp=cp, ep=tp * cp, etp=1), experts=True)
    assert groups.ep is not None and groups.ep.size == tp * cp
    ctx = ParallelContext(group=groups.tp, sp=tp > 1, seed=7, rng=RNGTracker(7),
                          dtype=torch.float64, cp=groups.cp, ep=groups.ep,
                          moe_dispatcher=dispatcher)
    cfg = _cfg("llama", shared=True, capacity=CAPACITY)
    layer = _layer(cfg, ctx)
    rows = _rows(tp, groups.tp.rank, cp, groups.cp.rank)
    x = _input(1, cfg.hidden_size)[rows]
    g = _input(2, cfg.hidden_size)[rows]
    named = dict(layer.named_parameters())
    names = sorted(named)
    got = _grads(layer, x, [named[n] for n in names], g)
    shardings = {n: named[n].sharding for n in names}  # type: ignore[attr-defined]
    return {"names": names, "got": got, "rows": rows, "tp_rank": groups.tp.rank,
            "ep_rank": groups.ep.rank, "shardings": shardings}


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = float((a - b).norm() / max(float(b.norm()), 1e-30))
    assert err <= 1e-12, f"{what}: rel err {err}"


@pytest.mark.parametrize(("tp", "cp", "dispatcher"), [
    (2, 1, "all_to_all"), (1, 2, "all_gather"), (2, 2, "all_to_all")])
def test_layer_under_sp_and_cp_equals_single(run_ranks: Callable[..., list[Any]], tp: int,
                                             cp: int, dispatcher: str) -> None:
    results = run_ranks(tp * cp, _sp_cp_rank, tp, cp, dispatcher)
    cfg = _cfg("llama", shared=True, capacity=CAPACITY)
    single = _layer(cfg, _ctx())
    named = dict(single.named_parameters())
    names = sorted(named)
    x, g = _input(1, cfg.hidden_size), _input(2, cfg.hidden_size)
    ref = _grads(single, x, [named[n] for n in names], g)
    local = cfg.num_experts // (tp * cp)
    for res in results:
        assert res["names"] == names
        _close(res["got"][0], ref[0][res["rows"]], "out rows")
        _close(res["got"][1], ref[1][res["rows"]], "dx rows")
    for i, name in enumerate(names):
        want = ref[2 + i]
        sharding: Sharding = results[0]["shardings"][name]
        if name.startswith("experts."):
            for res in results:
                e0 = res["ep_rank"] * local
                _close(res["got"][2 + i], want[e0:e0 + local], f"{name} ep{res['ep_rank']}")
        elif sharding.dim is not None:
            for t in range(tp):
                total = sum(r["got"][2 + i] for r in results if r["tp_rank"] == t)
                assert isinstance(total, torch.Tensor)
                _close(total, sharding.shard(want, {"tp": (t, tp)}), f"{name} tp{t}")
        else:
            total = sum(r["got"][2 + i] for r in results)
            assert isinstance(total, torch.Tensor)
            _close(total, want, name)


def test_recompute_reproduces_layer_and_records_once() -> None:
    cfg = _cfg("llama", shared=True, capacity=CAPACITY)
    cfg = dataclasses.replace(cfg, moe_aux_loss_coeff=0.1)
    plain_state, ckpt_state = MoEState(), MoEState()
    plain = _layer(cfg, _ctx(state=plain_state))
    ckpt = _layer(cfg, _ctx(state=ckpt_state))
    named_p, named_c = dict(plain.named_parameters()), dict(ckpt.named_parameters())
    names = sorted(named_p)
    x, g = _input(1, cfg.hidden_size), _input(2, cfg.hidden_size)
    want = _grads(plain, x, [named_p[n] for n in names], g)
    got = _grads(lambda xs: tc.checkpoint(seq_first, ckpt, xs, use_reentrant=False), x,
                 [named_c[n] for n in names], g)
    for name, a, b in zip(["out", "dx", *names], got, want, strict=True):
        assert torch.equal(a, b), name
    a, b = ckpt_state.read()[KEY], plain_state.read()[KEY]
    assert a.microbatches == b.microbatches == 1
    assert a.loads is not None and b.loads is not None and torch.equal(a.loads, b.loads)
    assert a.dropped == b.dropped > 0 and a.routed == b.routed == S * B * 2
