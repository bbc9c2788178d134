"""Token dispatch / combine (both dispatchers) and the capacity decision, float64.

Experts are known per-expert functions f_e(z) = tanh(a_e z) + b_e (a_e, b_e [h] fixed), so
the rows must reach the right expert. With loss L = sum_r sum(out_r * g_r), each rank's

    out_r[i] = sum_{c kept} w_r[i, c] f_{e_r[i, c]}(x_r[i])                  [t_r, h]

and its gradients d x_r, d w_r must equal a one-process loop over tokens and slots. Checked:
ep 2 and 4, 'all_to_all' and 'all_gather', uneven token counts per rank (t_r = 5 + 3 r),
uneven loads (expert 0 favoured), an expert with no token (ZERO_EXPERT), with and without
dropped slots; the dispatched rows equal, bit for bit, the rows of each local expert in
(source rank, token, c) order; counts and loads; wire bytes of every collective against the
formulas of colonnade/moe/dispatch.py. Capacity: tp2 under sp, cp2 and tp2 x cp2 (ep = the
sequence group) decide the same drops as a one-process loop over each whole sequence, and
the whole path (capacity -> dispatch -> experts -> combine) matches the full-sequence loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from colonnade.config.sections import ModelConfig
from colonnade.context_parallel.layout import take_local
from colonnade.moe.dispatch import (
    DispatchHandle,
    capacity_keep,
    capacity_slots,
    make_dispatcher,
)
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel.context import ParallelContext

H, K, ZERO_EXPERT = 8, 2, 1
EXPERTS = {1: 4, 2: 4, 4: 8}
"""Experts E per ep degree."""
B, S = 2, 16


@dataclass
class _Routing:
    """The fields of a routing that dispatch reads."""

    expert: torch.Tensor
    weight: torch.Tensor


def _expert_params(e: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(77)
    return (torch.rand(e, H, generator=gen, dtype=torch.float64) + 0.5,
            torch.randn(e, H, generator=gen, dtype=torch.float64))


def _apply(tokens: torch.Tensor, counts: list[int], first: int, e: int) -> torch.Tensor:
    """f_{first + j} on the j-th row range of ``tokens`` [t_e, h]."""
    a, b = _expert_params(e)
    parts, off = [], 0
    for j, c in enumerate(counts):
        z = tokens[off:off + c]
        parts.append(torch.tanh(z * a[first + j]) + b[first + j])
        off += c
    assert off == tokens.shape[0]
    return torch.cat(parts)


def _route(t: int, e: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """expert ids [t, K] (expert 0 favoured, ZERO_EXPERT never chosen) and weights [t, K]."""
    scores = torch.randn(t, e, generator=gen, dtype=torch.float64)
    scores[:, 0] += 1.0
    scores[:, ZERO_EXPERT] = -math.inf
    return scores.topk(K, dim=1).indices, torch.rand(t, K, generator=gen, dtype=torch.float64)


def _rank_data(n: int, drops: bool, idle_rank: bool = False) -> list[dict[str, torch.Tensor]]:
    """Every rank's x [t_r, h], experts, weights [t_r, K], keep (None: dropless), g [t_r, h].
    ``idle_rank``: no token chooses an expert of the last ep rank (it receives no row)."""
    e, gen = EXPERTS[n], torch.Generator().manual_seed(1000 + n)
    out = []
    for r in range(n):
        t = 5 + 3 * r
        x = torch.randn(t, H, generator=gen, dtype=torch.float64)
        ids, w = _route(t, e, gen)
        if idle_rank:  # K distinct experts of rank 0's E / n per token
            ids = torch.stack([torch.randperm(e // n, generator=gen)[:K] for _ in range(t)])
        keep = torch.rand(t, K, generator=gen) < 0.7
        g = torch.randn(t, H, generator=gen, dtype=torch.float64)
        out.append(dict(x=x, ids=ids, w=w, g=g, keep=keep if drops else None))
    return out


def _reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, keep: torch.Tensor | None,
               g: torch.Tensor, e: int) -> tuple[torch.Tensor, ...]:
    """One-process loop: out [t, h], dx, dw."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    a, b = _expert_params(e)
    rows = []
    for i in range(x.shape[0]):
        acc = torch.zeros(H, dtype=torch.float64)
        for c in range(K):
            if keep is None or bool(keep[i, c]):
                ex = int(ids[i, c])
                acc = acc + w[i, c] * (torch.tanh(x[i] * a[ex]) + b[ex])
        rows.append(acc)
    out = torch.stack(rows)
    (out * g).sum().backward()
    assert x.grad is not None and w.grad is not None
    return out.detach(), x.grad, w.grad


def _expected_tokens(data: list[dict[str, Any]], rank: int, e: int) -> torch.Tensor:
    """Rows of this rank's experts, expert-major, then source rank, token, c."""
    n = len(data)
    e_l = e // n
    rows = []
    for ex in range(rank * e_l, (rank + 1) * e_l):
        for d in data:
            for i in range(d["x"].shape[0]):
                for c in range(K):
                    if int(d["ids"][i, c]) == ex and (d["keep"] is None or d["keep"][i, c]):
                        rows.append(d["x"][i])
    return torch.stack(rows) if rows else torch.zeros(0, H, dtype=torch.float64)


def _stats(groups: ProcessGroups) -> dict[str, tuple[int, int, float]]:
    return {key: (int(s["calls"]), int(s["payload_bytes"]), s["wire_bytes"])
            for key, s in groups.stats.snapshot().items() if key.startswith("ep/")}


def _dispatch_rank(n: int, kind: str, drops: bool, idle_rank: bool = False) -> dict[str, Any]:
    groups = ProcessGroups.build(ParallelDims(dp=n, ep=n), timeout_s=60.0, experts=True)
    assert groups.ep is not None and groups.ep.size == n
    r, e = groups.ep.rank, EXPERTS[n]
    data = _rank_data(n, drops, idle_rank)
    mine = data[r]
    x, w = mine["x"].clone().requires_grad_(), mine["w"].clone().requires_grad_()
    disp = make_dispatcher(kind, groups.ep, e)
    groups.stats.reset()
    tokens, counts, handle = disp.dispatch(x, _Routing(mine["ids"], w), mine["keep"])
    assert isinstance(handle, DispatchHandle)
    same_rows = torch.equal(tokens.detach(), _expected_tokens(data, r, e))
    y = _apply(tokens, handle.counts_host, r * (e // n), e)
    out = disp.combine(y, handle)
    (out * mine["g"]).sum().backward()
    return dict(out=out.detach(), dx=x.grad, dw=w.grad, same_rows=same_rows,
                counts=counts.tolist(), counts_host=handle.counts_host,
                loads=handle.loads.tolist(), dropped=handle.dropped, routed=handle.routed,
                stats=_stats(groups))


def _a2a_bytes(data: list[dict[str, Any]], r: int, e: int) -> dict[str, tuple[int, int, float]]:
    """(calls, payload, wire) per collective of rank r under 'all_to_all' (float64 rows)."""
    n, row = len(data), H * 8
    e_l = e // n

    def sent(src: int, dst: int) -> int:
        d = data[src]
        kept = d["ids"] if d["keep"] is None else d["ids"][d["keep"]]
        return int(((kept >= dst * e_l) & (kept < (dst + 1) * e_l)).sum())

    m = sum(sent(r, j) for j in range(n))
    got = sum(sent(j, r) for j in range(n))
    own = sent(r, r)
    return {"ep/all_to_all/moe_counts": (1, n * e_l * 8, (n - 1) * e_l * 8.0),
            "ep/all_to_all/moe_dispatch": (1, m * row, float((m - own) * row)),
            "ep/all_to_all/moe_dispatch_grad": (1, got * row, float((got - own) * row)),
            "ep/all_to_all/moe_combine": (1, got * row, float((got - own) * row)),
            "ep/all_to_all/moe_combine_grad": (1, m * row, float((m - own) * row))}


def _gather_bytes(data: list[dict[str, Any]]) -> dict[str, tuple[int, int, float]]:
    """(calls, payload, wire) per collective of any rank under 'all_gather'."""
    n = len(data)
    t = max(d["x"].shape[0] for d in data)
    f = float(n - 1)
    x_b, k_b = t * H * 8, t * K * 8
    return {"ep/all_gather/moe_sizes": (1, 8, f * 8),
            "ep/all_gather/moe_gather_x": (1, x_b, f * x_b),
            "ep/all_gather/moe_gather_w": (1, k_b, f * k_b),
            "ep/all_gather/moe_gather_ids": (1, k_b, f * k_b),
            "ep/reduce_scatter/moe_combine": (1, n * x_b, f * x_b),
            "ep/all_gather/moe_combine_grad": (1, x_b, f * x_b),
            "ep/reduce_scatter/moe_gather_x_grad": (1, n * x_b, f * x_b),
            "ep/reduce_scatter/moe_gather_w_grad": (1, n * k_b, f * k_b)}


@pytest.mark.parametrize("drops", [False, True], ids=["dropless", "drops"])
@pytest.mark.parametrize("kind", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("n", [2, 4])
def test_dispatch_combine_matches_loop(run_ranks: Callable[..., list[Any]], n: int, kind: str,
                                       drops: bool) -> None:
    e = EXPERTS[n]
    data = _rank_data(n, drops)
    results = run_ranks(n, _dispatch_rank, n, kind, drops)
    total_loads = torch.zeros(e, dtype=torch.int64)
    for r, (res, d) in enumerate(zip(results, data, strict=True)):
        out, dx, dw = _reference(d["x"], d["ids"], d["w"], d["keep"], d["g"], e)
        torch.testing.assert_close(res["out"], out, rtol=0, atol=1e-12)
        torch.testing.assert_close(res["dx"], dx, rtol=0, atol=1e-12)
        torch.testing.assert_close(res["dw"], dw, rtol=0, atol=1e-12)
        assert res["same_rows"]
        assert res["counts"] == res["counts_host"]
        e_l = e // n
        kept = d["ids"] if d["keep"] is None else d["ids"][d["keep"]]
        assert res["loads"] == torch.bincount(kept.reshape(-1), minlength=e).tolist()
        assert res["routed"] == d["ids"].numel()
        assert res["dropped"] == d["ids"].numel() - kept.numel()
        total_loads += torch.tensor(res["loads"])
        assert res["stats"] == (_a2a_bytes(data, r, e) if kind == "all_to_all"
                                else _gather_bytes(data))
        if r == ZERO_EXPERT // e_l:  # the expert that gets no token lives here
            assert res["counts"][ZERO_EXPERT % e_l] == 0
    assert [sum(res["counts"]) for res in results] == [
        int(total_loads[r * (e // n):(r + 1) * (e // n)].sum()) for r in range(n)]
    assert int(total_loads[ZERO_EXPERT]) == 0 and int(total_loads[0]) > int(total_loads.min())


@pytest.mark.parametrize("kind", ["all_to_all", "all_gather"])
def test_rank_receiving_no_token(run_ranks: Callable[..., list[Any]], kind: str) -> None:
    """ep 2, every slot routed to rank 0's experts: rank 1 computes nothing (empty rows in both
    directions), forward and backward still match the loop."""
    n, e = 2, EXPERTS[2]
    data = _rank_data(n, drops=False, idle_rank=True)
    assert all(int(d["ids"].max()) < e // n for d in data)
    results = run_ranks(n, _dispatch_rank, n, kind, False, True)
    assert results[1]["counts"] == [0] * (e // n)
    for res, d in zip(results, data, strict=True):
        assert res["same_rows"]
        out, dx, dw = _reference(d["x"], d["ids"], d["w"], None, d["g"], e)
        for got, want in zip((res["out"], res["dx"], res["dw"]), (out, dx, dw), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_one_rank_dispatch_is_a_local_permutation() -> None:
    ep = ProcessGroups.single().ep
    assert ep is not None
    data = _rank_data(1, drops=True)[0]
    for kind in ("all_to_all", "all_gather"):
        x, w = data["x"].clone().requires_grad_(), data["w"].clone().requires_grad_()
        disp = make_dispatcher(kind, ep, EXPERTS[1])
        tokens, counts, handle = disp.dispatch(x, _Routing(data["ids"], w), data["keep"])
        assert torch.equal(tokens.detach(), _expected_tokens([data], 0, EXPERTS[1]))
        assert counts.tolist() == handle.counts_host and counts[ZERO_EXPERT] == 0
        out = disp.combine(_apply(tokens, handle.counts_host, 0, EXPERTS[1]), handle)
        (out * data["g"]).sum().backward()
        ref = _reference(data["x"], data["ids"], data["w"], data["keep"], data["g"], EXPERTS[1])
        for got, want in zip((out.detach(), x.grad, w.grad), ref, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_dispatcher_errors_name_the_fields() -> None:
    ep = ProcessGroups.single().ep
    assert ep is not None
    with pytest.raises(ValueError, match=r"parallel\.moe_dispatcher"):
        make_dispatcher("broadcast", ep, 4)
    group = CommGroup("ep", [0, 1, 2], None, CommStats(), 0)  # never communicates here
    with pytest.raises(ValueError, match=r"model\.num_experts=4 .* parallel\.ep=3"):
        make_dispatcher("all_to_all", group, 4)


# ---- capacity -------------------------------------------------------------------------------

CAP_CFG = ModelConfig(num_experts=4, moe_top_k=K, moe_capacity_factor=1.0)
CAP_LAYOUTS = [dict(tp=2), dict(cp=2), dict(tp=2, cp=2)]
"""tp > 1 runs under sp; ep = tp x cp (the sequence group is the ep group)."""


def _sequence_data() -> dict[str, torch.Tensor]:
    """Whole sequences: x [S, B, h], expert ids [S, B, K], weights [S, B, K], g [S, B, h]."""
    gen = torch.Generator().manual_seed(5)
    ids, w = _route(S * B, CAP_CFG.num_experts, gen)
    return dict(x=torch.randn(S, B, H, generator=gen, dtype=torch.float64),
                ids=ids.view(S, B, K), w=w.view(S, B, K),
                g=torch.randn(S, B, H, generator=gen, dtype=torch.float64))


def _loop_keep(ids: torch.Tensor, capacity: int) -> torch.Tensor:
    """One-process decision: per sequence, slots in (position, c) order, C per expert."""
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    for b in range(ids.shape[1]):
        used = [0] * CAP_CFG.num_experts
        for p in range(ids.shape[0]):
            for c in range(K):
                ex = int(ids[p, b, c])
                if used[ex] < capacity:
                    keep[p, b, c] = True
                    used[ex] += 1
    return keep


def _local(x: torch.Tensor, tp: int, tp_rank: int, cp: int, cp_rank: int) -> torch.Tensor:
    """A rank's rows of a whole-sequence [S, B, ...] tensor: zigzag over cp, then sp over tp."""
    rows = take_local(x, cp, cp_rank, 0)
    return rows.chunk(tp, dim=0)[tp_rank]


def _capacity_rank(layout: dict[str, int], kind: str) -> dict[str, Any]:
    tp, cp = layout.get("tp", 1), layout.get("cp", 1)
    groups = ProcessGroups.build(ParallelDims(tp=tp, cp=cp, ep=tp * cp, etp=1), timeout_s=60.0,
                                 experts=True)
    assert groups.ep is not None
    ctx = ParallelContext(group=groups.tp, sp=tp > 1, seed=1, rng=RNGTracker(1), cp=groups.cp,
                          ep=groups.ep, dtype=torch.float64)
    full = _sequence_data()
    loc = {k: _local(v, tp, groups.tp.rank, cp, groups.cp.rank) for k, v in full.items()}
    s_l = loc["x"].shape[0]
    x = loc["x"].reshape(s_l * B, H).clone().requires_grad_()
    w = loc["w"].reshape(s_l * B, K).clone().requires_grad_()
    routing = _Routing(loc["ids"].reshape(s_l * B, K), w)
    keep = capacity_keep(routing, CAP_CFG, ctx, s_l, B)
    assert keep is not None
    e = CAP_CFG.num_experts
    disp = make_dispatcher(kind, groups.ep, e)
    tokens, _, handle = disp.dispatch(x, routing, keep)
    y = _apply(tokens, handle.counts_host, groups.ep.rank * (e // groups.ep.size), e)
    out = disp.combine(y, handle)
    (out * loc["g"].reshape(s_l * B, H)).sum().backward()
    return dict(keep=keep.view(s_l, B, K), out=out.detach().view(s_l, B, H),
                dx=x.grad, dw=w.grad, tp_rank=groups.tp.rank, cp_rank=groups.cp.rank,
                dropped=handle.dropped)


@pytest.mark.parametrize("kind", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("layout", CAP_LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in
                                                                       d.items()))
def test_capacity_drops_match_whole_sequence_loop(run_ranks: Callable[..., list[Any]],
                                                  layout: dict[str, int], kind: str) -> None:
    tp, cp = layout.get("tp", 1), layout.get("cp", 1)
    full = _sequence_data()
    capacity = capacity_slots(CAP_CFG, S)
    assert capacity == math.ceil(1.0 * S * K / CAP_CFG.num_experts) == 8
    keep = _loop_keep(full["ids"], capacity)
    assert 0 < int((~keep).sum()) < keep.numel() // 2  # 3 experts used, C = 8: drops
    out, dx, dw = _reference(full["x"].view(S * B, H), full["ids"].view(S * B, K),
                             full["w"].view(S * B, K), keep.view(S * B, K),
                             full["g"].view(S * B, H), CAP_CFG.num_experts)
    results = run_ranks(tp * cp, _capacity_rank, layout, kind)
    for res in results:
        args = (tp, res["tp_rank"], cp, res["cp_rank"])
        want_keep = _local(keep, *args)
        assert torch.equal(res["keep"], want_keep)
        assert res["dropped"] == int((~want_keep).sum())
        torch.testing.assert_close(res["out"], _local(out.view(S, B, H), *args),
                                   rtol=0, atol=1e-12)
        torch.testing.assert_close(res["dx"], _local(dx.view(S, B, H), *args).reshape(-1, H),
                                   rtol=0, atol=1e-12)
        torch.testing.assert_close(res["dw"], _local(dw.view(S, B, K), *args).reshape(-1, K),
                                   rtol=0, atol=1e-12)


def test_capacity_single_rank_and_dropless() -> None:
    ctx = ParallelContext(group=ProcessGroups.single().tp, sp=False, seed=1, rng=RNGTracker(1),
                          cp=ProcessGroups.single().cp)
    full = _sequence_data()
    routing = _Routing(full["ids"].reshape(S * B, K), full["w"].reshape(S * B, K))
    keep = capacity_keep(routing, CAP_CFG, ctx, S, B)
    assert keep is not None
    assert torch.equal(keep.view(S, B, K), _loop_keep(full["ids"], 8))
    tight = ModelConfig(num_experts=4, moe_top_k=K, moe_capacity_factor=0.25)
    keep2 = capacity_keep(routing, tight, ctx, S, B)
    assert keep2 is not None and capacity_slots(tight, S) == 2
    assert torch.equal(keep2.view(S, B, K), _loop_keep(full["ids"], 2))
    dropless = ModelConfig(num_experts=4, moe_top_k=K)
    assert capacity_keep(routing, dropless, ctx, S, B) is None


def test_bf16_rows_combine_in_fp32_weights() -> None:
    """bf16 x with fp32 weights: the output is bf16, its sum formed in fp32 (the rounding of
    the bf16 result only), and the dispatched rows are x's rows exactly."""
    ep = ProcessGroups.single().ep
    assert ep is not None
    data = _rank_data(1, drops=False)[0]
    x = data["x"].to(torch.bfloat16)
    w = data["w"].float()
    disp = make_dispatcher("all_to_all", ep, EXPERTS[1])
    tokens, _, handle = disp.dispatch(x, _Routing(data["ids"], w), None)
    assert tokens.dtype == torch.bfloat16
    assert torch.equal(tokens.double(), _expected_tokens([dict(data, x=x.double())], 0,
                                                         EXPERTS[1]))
    y = _apply(tokens.double(), handle.counts_host, 0, EXPERTS[1]).to(torch.bfloat16)
    out = disp.combine(y, handle)
    assert out.dtype == torch.bfloat16
    want = disp.combine(y.double(), handle).to(torch.bfloat16)  # fp64 sum, rounded once
    assert torch.equal(out, want)
