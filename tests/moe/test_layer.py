"""The MoE layer against an independent plain-PyTorch mixture of experts, in float64.

The reference (:func:`plain_moe`) is written here from the definitions only: softmax router,
top-k by descending probability, optional renormalisation, per-sequence capacity decided by
walking positions in order, a Python loop over experts applying each expert's MLP to the
rows routed to it, and the (gated) shared expert. It reads the layer's full weights.

* ep 1: SwiGLU and GELU(+bias) experts, with / without a gated shared expert, dropless and
  with capacity drops, renormalised or not: output and gradients (input and every weight);
* ep 2 / ep 4 (rank pool, each rank its own tokens, both dispatchers): each rank's output and
  input gradient equal the reference on its tokens; a replicated weight's gradient is its
  rank's share; an expert weight's gradient sums every rank's tokens (the rank pool's
  expert-parallel groups, ep folded into dp); an expert receiving no token has zero gradient;
* with an MoEState the auxiliary loss reaches the router's gradient and stats are recorded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from colonnade.config.sections import ModelConfig
from colonnade.models.spec import GeluMoELayer, SwiGLUMoELayer
from colonnade.moe.layer import MoELayer
from colonnade.moe.state import MoEState
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel.context import ParallelContext
from tests.parity import tiny_model

S, B, E = 16, 2, 4
KEY = "layers.0.mlp"


def _cfg(arch: str, *, shared: bool = False, capacity: float | None = None,
         norm: bool = True, top_k: int = 2) -> ModelConfig:
    return dataclasses.replace(
        tiny_model(arch, bias=arch == "gpt2"), num_experts=E, moe_top_k=top_k,
        moe_ffn_hidden_size=24, moe_norm_topk_prob=norm, moe_capacity_factor=capacity,
        moe_shared_expert_ffn_hidden_size=16 if shared else 0, moe_shared_expert_gate=shared)


def _ctx(ep: CommGroup | None = None, dispatcher: str = "all_to_all",
         state: MoEState | None = None) -> ParallelContext:
    one = CommGroup("tp", [0], None, CommStats(), 0)
    return ParallelContext(group=one, sp=False, seed=7, rng=RNGTracker(7), dtype=torch.float64,
                           ep=ep, moe_dispatcher=dispatcher, moe=state)


def _layer(cfg: ModelConfig, ctx: ParallelContext) -> MoELayer:
    cls = SwiGLUMoELayer if cfg.arch == "llama" else GeluMoELayer
    layer = cls(cfg, ctx, KEY, 0)
    with torch.no_grad():  # decisive routing, non-zero biases
        layer.router.weight.mul_(20.0)
        for index, (name, p) in enumerate(layer.named_parameters()):
            if name.endswith("bias") and p.requires_grad:  # same full draw in every layout
                sharding = p.sharding  # type: ignore[attr-defined]
                gen = torch.Generator().manual_seed(100 + index)
                full = 0.1 * torch.randn(sharding.full_shape, generator=gen, dtype=p.dtype)
                p.copy_(sharding.shard(full, {"ep": (ctx.ep_rank, ctx.ep_size)}))
    return layer


def _input(seed: int, h: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, h, generator=gen, dtype=torch.float64)  # [s, b, h]


def _capacity_keep(expert: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """keep [s, b, k]: per sequence b and expert, the first C slots in (position, k) order."""
    assert cfg.moe_capacity_factor is not None
    cap = math.ceil(cfg.moe_capacity_factor * S * cfg.moe_top_k / E)
    keep = torch.zeros_like(expert, dtype=torch.bool)
    for b in range(B):
        used = [0] * E
        for s in range(S):
            for c in range(cfg.moe_top_k):
                e = int(expert[s, b, c])
                keep[s, b, c] = used[e] < cap
                used[e] += 1
    return keep


def _mlp(p: dict[str, torch.Tensor], pre: str, x: torch.Tensor, gated: bool,
         index: int | None = None) -> torch.Tensor:
    """One expert (``index``) or the shared expert (None) on rows x [n, h]."""
    def w(name: str) -> torch.Tensor:
        return p[f"{pre}.{name}"] if index is None else p[f"{pre}.{name}"][index]

    if index is None:  # shared: nn-style names
        up, down = p[f"{pre}.up.weight"], p[f"{pre}.down.weight"]
        if gated:
            return (F.silu(x @ p[f"{pre}.gate.weight"].T) * (x @ up.T)) @ down.T
        hidden = F.gelu(x @ up.T + p[f"{pre}.up.bias"], approximate="tanh")
        return hidden @ down.T + p[f"{pre}.down.bias"]
    if gated:
        return (F.silu(x @ w("gate").T) * (x @ w("up").T)) @ w("down").T
    hidden = F.gelu(x @ w("up").T + w("up_bias"), approximate="tanh")
    return hidden @ w("down").T + w("down_bias")


def plain_moe(x: torch.Tensor, p: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The independent reference: x [s, b, h] -> [s, b, h] (module docstring)."""
    gated, k = cfg.arch == "llama", cfg.moe_top_k
    probs = torch.softmax(x @ p[f"{KEY}.router.weight"].T, dim=-1)  # [s, b, E]
    expert = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[..., :k]
    weight = probs.gather(-1, expert)  # [s, b, k]
    if cfg.moe_norm_topk_prob:
        weight = weight / weight.sum(-1, keepdim=True)
    keep = (_capacity_keep(expert, cfg) if cfg.moe_capacity_factor is not None
            else torch.ones_like(expert, dtype=torch.bool))
    out = torch.zeros_like(x)
    for e in range(E):
        for c in range(k):
            mask = (expert[..., c] == e) & keep[..., c]  # [s, b]
            if mask.any():
                y = _mlp(p, f"{KEY}.experts", x[mask], gated, e)  # [n, h]
                out = out.index_put((mask,), weight[..., c][mask].unsqueeze(-1) * y,
                                    accumulate=True)
    if cfg.moe_shared_expert_ffn_hidden_size:
        shared = _mlp(p, f"{KEY}.shared", x, gated)
        if cfg.moe_shared_expert_gate:
            shared = shared * torch.sigmoid(x @ p[f"{KEY}.shared_gate.weight"].T)
        out = out + shared
    return out


def seq_first(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """``layer`` on x [s, b, h] -> [s, b, h]: through its batch-first [b, s, h] input and
    output when its context says so (cp = 1 without sp), so every comparison with the plain
    [s, b]-ordered reference also checks that the batch-first path routes tokens in that
    order (capacity drops, per-sequence balance)."""
    if layer.ctx.batch_first:
        return layer(x.transpose(0, 1).contiguous()).transpose(0, 1)
    return layer(x)


def _grads(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
           params: list[torch.Tensor], g: torch.Tensor) -> list[torch.Tensor]:
    """[output, dx, d params...] of ``(fn(x) * g).sum()`` for x [s, b, h] (an MoE layer is
    called through :func:`seq_first`)."""
    xs = x.clone().requires_grad_(True)
    out = seq_first(fn, xs) if isinstance(fn, MoELayer) else fn(xs)
    grads = torch.autograd.grad((out * g).sum(), [xs, *params], allow_unused=True)
    return [out.detach(), *[gr if gr is not None else torch.zeros_like(p)
                            for gr, p in zip(grads, [xs, *params], strict=True)]]


def _check(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str]) -> None:
    """||a - b|| <= 1e-12 ||b|| + 1e-15 for every output and gradient. The absolute term is
    for gradients that are zero in exact arithmetic: under top-1 routing with normalized
    weights the gate is p / p = 1, so the router's gradient is rounding noise of ~1e-18 on
    both sides, whose relative difference depends on the summation order of the machine's
    kernels (it is O(1) on some CPUs)."""
    for name, a, b in zip(["out", "dx", *names], got, want, strict=True):
        diff, ref = float((a - b).norm()), float(b.norm())
        assert diff <= 1e-12 * ref + 1e-15, f"{name}: |a - b| {diff} against |b| {ref}"


CASES = [("llama", {}), ("llama", {"shared": True, "capacity": 1.0}),
         ("llama", {"norm": False, "capacity": 0.5}), ("gpt2", {}),
         ("gpt2", {"shared": True, "capacity": 0.75, "top_k": 1})]


@pytest.mark.parametrize(("arch", "opts"), CASES)
def test_layer_matches_plain_moe(arch: str, opts: dict[str, Any]) -> None:
    cfg = _cfg(arch, **opts)
    layer = _layer(cfg, _ctx())
    named = {f"{KEY}.{n}": p for n, p in layer.named_parameters()}
    names = sorted(named)
    x, g = _input(1, cfg.hidden_size), _input(2, cfg.hidden_size)
    got = _grads(layer, x, [named[n] for n in names], g)
    want = _grads(lambda xs: plain_moe(xs, named, cfg), x, [named[n] for n in names], g)
    _check(got, want, names)
    if opts.get("capacity"):
        assert float(got[0].norm()) > 0
    assert (f"{KEY}.shared_gate.weight" in named) == bool(opts.get("shared"))


def test_aux_loss_reaches_router_and_stats_are_recorded() -> None:
    """With an MoEState: the forward value is unchanged, the router's gradient gains
    aux_scale x d(aux)/dW (aux from router.aux_losses on the same routing), stats recorded."""
    from colonnade.moe.router import aux_losses

    cfg = dataclasses.replace(_cfg("llama", capacity=0.5), moe_aux_loss_coeff=0.1,
                              moe_z_loss_coeff=0.01)
    state = MoEState(aux_scale=3.0)
    layer = _layer(cfg, _ctx(state=state))
    plain = _layer(cfg, _ctx())
    x, g = _input(1, cfg.hidden_size), _input(2, cfg.hidden_size)
    out = seq_first(layer, x)
    (out * g).sum().backward()
    routing = plain.router(x.reshape(S * B, -1))
    aux = sum(aux_losses(routing, cfg, plain.ctx, S, B).values())
    assert isinstance(aux, torch.Tensor)
    ref = seq_first(plain, x)
    ((ref * g).sum() + 3.0 * aux).backward()
    assert torch.equal(out.detach(), ref.detach())
    assert layer.router.weight.grad is not None and plain.router.weight.grad is not None
    err = (layer.router.weight.grad - plain.router.weight.grad).norm()
    assert float(err / plain.router.weight.grad.norm()) <= 1e-12
    stats = state.read()[KEY]
    assert stats.routed == S * B * 2 and stats.loads is not None
    assert int(stats.loads.sum()) == S * B * 2 and 0 < stats.dropped < S * B * 2
    assert set(stats.aux_sums) == {"load_balance", "z_loss"}


# ----------------------------------------------------------------------------- ep > 1


def _starve(layer: MoELayer) -> None:
    """Expert E-1 gets no token (top-1): its router row equals expert 0's, and equal scores
    go to the lower id."""
    with torch.no_grad():
        layer.router.weight[E - 1] = layer.router.weight[0]


def _ep_rank(ep: int, arch: str, dispatcher: str, capacity: float | None,
             starve: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(dp=ep, ep=ep, etp=1), experts=True)
    assert groups.ep is not None and groups.ep.size == ep
    cfg = _cfg(arch, shared=True, capacity=capacity, top_k=1 if starve else 2)
    layer = _layer(cfg, _ctx(groups.ep, dispatcher))
    if starve:
        _starve(layer)
    rank = groups.ep.rank
    x, g = _input(10 + rank, cfg.hidden_size), _input(20 + rank, cfg.hidden_size)
    named = dict(layer.named_parameters())
    names = sorted(named)
    got = _grads(layer, x, [named[n] for n in names], g)
    return {"names": names, "got": got, "rank": rank}


@pytest.mark.parametrize(("ep", "arch", "dispatcher", "capacity", "starve"), [
    (2, "llama", "all_to_all", None, False), (2, "gpt2", "all_gather", 1.0, False),
    (4, "llama", "all_gather", None, True), (4, "llama", "all_to_all", 0.75, False),
    (2, "llama", "all_to_all", None, True)])
def test_ep_layer_equals_ep1(run_ranks: Callable[..., list[Any]], ep: int, arch: str,
                             dispatcher: str, capacity: float | None, starve: bool) -> None:
    results = run_ranks(ep, _ep_rank, ep, arch, dispatcher, capacity, starve)
    cfg = _cfg(arch, shared=True, capacity=capacity, top_k=1 if starve else 2)
    single = _layer(cfg, _ctx())
    if starve:
        _starve(single)
    named = dict(single.named_parameters())
    names = sorted(named)
    refs = [_grads(single, _input(10 + r, cfg.hidden_size), [named[n] for n in names],
                   _input(20 + r, cfg.hidden_size)) for r in range(ep)]
    local = E // ep
    for res in results:
        r, got = res["rank"], res["got"]
        assert res["names"] == names
        want = list(refs[r][:2])
        for i, n in enumerate(names):
            if n.startswith("experts."):  # summed over every rank's tokens, local slice
                total = sum(ref[2 + i] for ref in refs)
                assert isinstance(total, torch.Tensor)
                want.append(total[r * local:(r + 1) * local])
            else:
                want.append(refs[r][2 + i])
        _check(got, want, names)
        if starve and r == ep - 1:
            assert torch.all(got[2 + names.index("experts.down")][-1] == 0)
