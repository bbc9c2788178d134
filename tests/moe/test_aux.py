"""The MoE auxiliary losses, float64: formulas against plain-torch loops in one process, and
the same values and gradients when the tokens are spread over ranks.

One process: the Switch/GShard balancing loss c E sum_i f_i P_i per sequence ('seq', rows in
the [s, b] order: row r belongs to sequence r mod b) or over all tokens ('global'), and the
z-loss c mean(logsumexp^2), values and router-weight gradients against loops.

Ranks (the rank pool; tp2, cp2, dp2, tp2 x dp2, cp2 x dp2): x [S, B, h] split along s over
cp x tp (sp on: tp ranks hold different rows) and along b over dp (the trainer's dp x cp group
in MoEState.dp_cp). For both aux types:
'global' values equal the one-process value on every rank; 'seq' values agree inside a
sequence group and their mean over dp equals it; z-loss equals it. Gradients: every rank's
x-gradient equals dp x the one-process gradient of its rows, and the router-weight gradients
summed over all ranks equal dp x the one-process gradient (the trainer's aux_scale divides dp
out again, see attach_aux_loss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.config.sections import ModelConfig
from colonnade.moe.router import Router, aux_losses
from colonnade.moe.state import MoEState
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel.context import ParallelContext
from tests.parity import rank_groups, rel_err

S, B, H, E, K = 16, 4, 32, 8, 2
KEY = "layers.3.mlp.router"
TOL = 1e-11
KINDS = (("softmax", "seq"), ("softmax", "global"), ("sigmoid", "seq"), ("sigmoid", "global"))


def _cfg(router: str, aux_type: str, z: float = 0.02) -> ModelConfig:
    return ModelConfig(hidden_size=H, num_experts=E, moe_top_k=K, moe_router=router,
                       moe_aux_loss_coeff=0.1, moe_aux_loss_type=aux_type, moe_z_loss_coeff=z)


def _ctx(groups: ProcessGroups, sp: bool) -> ParallelContext:
    return ParallelContext(group=groups.tp, sp=sp, seed=9, rng=RNGTracker(9),
                           dtype=torch.float64, cp=groups.cp)


def _tokens() -> torch.Tensor:
    """[S, B, H] float64 hidden states."""
    return torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))


def _one_process(router_kind: str, aux_type: str) -> dict[str, Any]:
    """Aux losses of all S x B tokens in one process, with their gradients."""
    cfg, ctx = _cfg(router_kind, aux_type), _ctx(ProcessGroups.single(), False)
    router = Router(cfg, ctx, KEY)
    x = _tokens().requires_grad_(True)
    aux = aux_losses(router(x.reshape(S * B, H)), cfg, ctx, S, B)
    sum(aux.values()).backward()  # type: ignore[union-attr]
    values = {k: float(v.detach()) for k, v in aux.items()}
    return {"aux": values, "x": x.grad, "w": router.weight.grad}


def _loops(router_kind: str, aux_type: str) -> dict[str, Any]:
    """The same losses written as loops over experts and sequences, plain torch."""
    cfg = _cfg(router_kind, aux_type)
    router = Router(cfg, _ctx(ProcessGroups.single(), False), KEY)
    x = _tokens().reshape(S * B, H)
    r = router(x)
    w = router.weight
    logits = x @ w.t()  # [t, E]
    if router_kind == "softmax":
        probs = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    else:
        scores = 1 / (1 + torch.exp(-logits))
        probs = scores / scores.sum(-1, keepdim=True)
    seqs = [[row for row in range(S * B) if row % B == j] for j in range(B)]
    sets = seqs if aux_type == "seq" else [list(range(S * B))]
    terms = []
    for rows in sets:
        chosen = r.expert[rows]  # [n, k]: the selection is not differentiable
        total = 0.0
        for i in range(E):
            f = float((chosen == i).sum()) / (len(rows) * K)
            total = total + f * probs[rows, i].mean()
        terms.append(0.1 * E * total)
    balance = sum(terms) / len(terms)
    lse = torch.log(torch.exp(logits).sum(-1))
    z = 0.02 * (lse ** 2).mean()
    (balance + z).backward()  # type: ignore[union-attr]
    return {"aux": {"load_balance": float(balance.detach()),  # type: ignore[union-attr]
                    "z_loss": float(z.detach())}, "w": w.grad}


@pytest.mark.parametrize(("router_kind", "aux_type"), KINDS)
def test_aux_losses_match_loops(router_kind: str, aux_type: str) -> None:
    got, want = _one_process(router_kind, aux_type), _loops(router_kind, aux_type)
    for name, value in want["aux"].items():
        assert abs(got["aux"][name] - value) <= TOL * abs(value), name
    assert rel_err(got["w"], want["w"]) <= TOL
    assert got["aux"]["load_balance"] > 0.1 * 0.99  # >= c at perfect balance: plausible


def test_zero_coefficients_give_no_losses() -> None:
    cfg = ModelConfig(hidden_size=H, num_experts=E, moe_top_k=K)
    ctx = _ctx(ProcessGroups.single(), False)
    routing = Router(cfg, ctx, KEY)(_tokens().reshape(S * B, H))
    assert aux_losses(routing, cfg, ctx, S, B) == {}
    only_z = dataclasses.replace(_cfg("softmax", "global", z=0.5), moe_aux_loss_coeff=0.0)
    assert set(aux_losses(routing, only_z, ctx, S, B)) == {"z_loss"}


def _rank(tp: int, cp: int, dp: int) -> list[dict[str, Any]]:
    """This rank's rows of the tokens through every (router, aux type); values and grads."""
    groups = rank_groups(ParallelDims(tp=tp, cp=cp, dp=dp))
    ctx = _ctx(groups, sp=tp > 1)
    ctx.moe = MoEState(dp_cp=groups.dp_cp)
    chunk = groups.cp.rank * tp + groups.tp.rank  # sequence chunk: cp outer, sp inner
    s_l, b_l = S // (cp * tp), B // dp
    rows = slice(chunk * s_l, (chunk + 1) * s_l)
    cols = slice(groups.dp_rank * b_l, (groups.dp_rank + 1) * b_l)
    groups.stats.reset()
    out = []
    for router_kind, aux_type in KINDS:
        cfg = _cfg(router_kind, aux_type)
        router = Router(cfg, ctx, KEY)
        x = _tokens()[rows, cols].contiguous().requires_grad_(True)  # [s_l, b_l, h]
        aux = aux_losses(router(x.reshape(s_l * b_l, H)), cfg, ctx, s_l, b_l)
        sum(aux.values()).backward()  # type: ignore[union-attr]
        out.append({"aux": {k: float(v.detach()) for k, v in aux.items()}, "x": x.grad,
                    "w": router.weight.grad, "rows": rows, "cols": cols,
                    "dp_rank": groups.dp_rank})
    ops = groups.stats.snapshot()
    out[0]["calls"] = {k: v["calls"] for k, v in ops.items() if k.endswith("all_reduce/moe_aux")}
    return out


LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]
"""(tp, cp, dp) of the multi-rank checks."""


@pytest.mark.parametrize(("tp", "cp", "dp"), LAYOUTS)
def test_aux_losses_across_ranks_equal_one_process(run_ranks: Callable[..., list[Any]],
                                                   tp: int, cp: int, dp: int) -> None:
    results = run_ranks(tp * cp * dp, _rank, tp, cp, dp)
    # one all-reduce per group per reduction: 'seq' + z: sequence groups, then the global
    # groups (z); 'global' + z: the global groups once (counts, probs and z together)
    calls = 6 * (tp > 1) + 2 * (cp > 1) + 4 * (cp * dp > 1)
    assert all(sum(r[0]["calls"].values()) == calls for r in results), results[0][0]["calls"]
    for i, (router_kind, aux_type) in enumerate(KINDS):
        ref = _one_process(router_kind, aux_type)
        ranks = [res[i] for res in results]
        what = f"{router_kind}/{aux_type} tp{tp} cp{cp} dp{dp}"
        assert abs(sum(r["aux"]["z_loss"] for r in ranks) / len(ranks)
                   - ref["aux"]["z_loss"]) <= TOL, what
        balance = [r["aux"]["load_balance"] for r in ranks]
        if aux_type == "global":
            assert max(abs(v - ref["aux"]["load_balance"]) for v in balance) <= TOL, what
        else:
            per_dp: dict[int, float] = {}
            for r in ranks:  # one value per sequence group (= dp rank here)
                assert abs(per_dp.setdefault(r["dp_rank"], r["aux"]["load_balance"])
                           - r["aux"]["load_balance"]) <= TOL, what
            mean = sum(per_dp.values()) / len(per_dp)
            assert abs(mean - ref["aux"]["load_balance"]) <= TOL, what
        for r in ranks:
            assert rel_err(r["x"], dp * ref["x"][r["rows"], r["cols"]]) <= TOL, what
        w = torch.stack([r["w"] for r in ranks]).sum(0)
        assert rel_err(w, dp * ref["w"]) <= TOL, what
