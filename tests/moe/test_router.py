"""The MoE router, the aux-loss scaler and the MoE state in one process, float64.

* softmax / sigmoid routing against hand-computed values (logits, probabilities, chosen
  experts, weights with and without renormalisation), ties broken towards the lower expert id;
* the sigmoid router's selection bias chooses but never weights; the bias update's direction;
* parameters: keys, replicated Shardings (sp_partial_grad under sp), the bias without grad;
  bf16 weights still give fp32 logits;
* attach_aux_loss: the gradients equal autograd of main + scale x aux;
* MoEState: per-layer sums over micro-batches, nothing counted twice under recomputation.
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint as tc

from colonnade.config.sections import ModelConfig
from colonnade.moe.router import Router, aux_losses, top_k, update_expert_bias
from colonnade.moe.state import MoEState, attach_aux_loss
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel.context import ParallelContext

KEY = "layers.0.mlp.router"
TOL = 1e-12


def _ctx(dtype: torch.dtype = torch.float64, sp: bool = False) -> ParallelContext:
    groups = ProcessGroups.single()
    return ParallelContext(group=groups.tp, sp=sp, seed=3, rng=RNGTracker(3), dtype=dtype,
                           cp=groups.cp)


def _cfg(**kw: object) -> ModelConfig:
    base: dict[str, object] = {"hidden_size": 2, "num_experts": 3, "moe_top_k": 2}
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def _router(cfg: ModelConfig, w: list[list[float]], ctx: ParallelContext | None = None) -> Router:
    router = Router(cfg, ctx or _ctx(), KEY)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(w, dtype=router.weight.dtype))
    return router


def _x(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_softmax_routing_hand_values() -> None:
    w = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    x = _x([[1.0, 2.0]])  # logits [1, 2, 3]
    e1, e2, e3 = math.exp(1), math.exp(2), math.exp(3)
    for norm in (True, False):
        r = _router(_cfg(moe_norm_topk_prob=norm), w)(x)
        assert torch.allclose(r.logits, _x([[1.0, 2.0, 3.0]]), atol=TOL)
        total = e1 + e2 + e3
        assert torch.allclose(r.probs, _x([[e1 / total, e2 / total, e3 / total]]), atol=TOL)
        assert r.expert.tolist() == [[2, 1]] and r.expert.dtype == torch.int64
        want = [e3 / (e2 + e3), e2 / (e2 + e3)] if norm else [e3 / total, e2 / total]
        assert torch.allclose(r.weight, _x([want]), atol=TOL), norm


def test_ties_go_to_lower_expert_id() -> None:
    w = [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]  # logits [0, 2, 2, 0]
    x = _x([[1.0, 1.0], [0.0, 0.0]])  # second row: all four tie
    for k, want in ((2, [[1, 2], [0, 1]]), (3, [[1, 2, 0], [0, 1, 2]])):
        for kind in ("softmax", "sigmoid"):
            r = _router(_cfg(num_experts=4, moe_top_k=k, moe_router=kind), w)(x)
            assert r.expert.tolist() == want, (k, kind)
    scores = torch.tensor([[0.5, 0.7, 0.7, 0.5, 0.7]])
    assert top_k(scores, 4).tolist() == [[1, 2, 4, 0]]


def test_sigmoid_routing_bias_selects_but_never_weights() -> None:
    w = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    x = _x([[1.0, 2.0]])  # logits [1, 2, 3]
    s = [1 / (1 + math.exp(-v)) for v in (1.0, 2.0, 3.0)]
    raw = _router(_cfg(moe_router="sigmoid", moe_norm_topk_prob=False), w)(x)
    assert torch.allclose(raw.weight, _x([[s[2], s[1]]]), atol=TOL)  # not renormalised
    router = _router(_cfg(moe_router="sigmoid"), w)  # moe_norm_topk_prob=True
    r = router(x)
    assert r.expert.tolist() == [[2, 1]]
    assert torch.allclose(r.weight, _x([[s[2] / (s[1] + s[2]), s[1] / (s[1] + s[2])]]), atol=TOL)
    assert torch.allclose(r.probs, _x([[v / sum(s) for v in s]]), atol=TOL)
    assert router.expert_bias is not None
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0]))
    r = router(x)
    assert r.expert.tolist() == [[0, 2]]
    assert torch.allclose(r.weight, _x([[s[0] / (s[0] + s[2]), s[2] / (s[0] + s[2])]]), atol=TOL)
    assert torch.allclose(r.probs, _x([[v / sum(s) for v in s]]), atol=TOL)


def test_parameters_and_shardings() -> None:
    soft = Router(_cfg(), _ctx(sp=True), KEY)
    assert [n for n, _ in soft.named_parameters()] == ["weight"]
    assert soft.weight.sharding.key == f"{KEY}.weight"  # type: ignore[attr-defined]
    assert soft.weight.sharding.full_shape == (3, 2)  # type: ignore[attr-defined]
    assert soft.weight.sharding.sp_partial_grad  # type: ignore[attr-defined]
    assert soft.weight.sharding.split_axes == ()  # type: ignore[attr-defined]
    sig = Router(_cfg(moe_router="sigmoid"), _ctx(), KEY)
    bias = sig.expert_bias
    assert bias is not None and not bias.requires_grad
    assert bias.sharding.key == f"{KEY}.expert_bias"  # type: ignore[attr-defined]
    assert torch.equal(bias, torch.zeros(3, dtype=torch.float64))
    assert dict(sig.named_parameters())["expert_bias"] is bias
    again = Router(_cfg(moe_router="sigmoid"), _ctx(), KEY)
    assert torch.equal(again.weight, sig.weight)  # seeded by key: same in every layout


def test_bf16_weights_route_in_fp32() -> None:
    router = Router(_cfg(hidden_size=8, num_experts=4), _ctx(torch.bfloat16), KEY)
    x = torch.randn(5, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    r = router(x)
    assert r.logits.dtype == r.probs.dtype == r.weight.dtype == torch.float32
    want = x.float() @ router.weight.float().t()
    assert torch.allclose(r.logits, want, atol=1e-6)
    sig = Router(_cfg(hidden_size=8, num_experts=4, moe_router="sigmoid"),
                 _ctx(torch.bfloat16), KEY)
    assert sig.expert_bias is not None and sig.expert_bias.dtype == torch.float32


def test_update_expert_bias_direction() -> None:
    router = Router(_cfg(num_experts=4, moe_router="sigmoid"), _ctx(), KEY)
    update_expert_bias(router, torch.tensor([10, 0, 5, 1]), 0.01)  # mean 4
    assert router.expert_bias is not None
    assert torch.allclose(router.expert_bias, _x([[-0.01, 0.01, -0.01, 0.01]])[0], atol=TOL)
    update_expert_bias(router, torch.tensor([4, 4, 4, 4]), 0.01)  # balanced: unchanged
    update_expert_bias(router, torch.tensor([0, 9, 0, 0]), 0.0)  # rate 0: off
    assert torch.allclose(router.expert_bias, _x([[-0.01, 0.01, -0.01, 0.01]])[0], atol=TOL)
    soft = Router(_cfg(num_experts=4), _ctx(), KEY)
    update_expert_bias(soft, torch.tensor([10, 0, 5, 1]), 0.01)  # softmax: no bias, no-op
    assert soft.expert_bias is None


def test_attach_aux_loss_gradients_are_main_plus_scaled_aux() -> None:
    cfg = _cfg(hidden_size=8, num_experts=4, moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.05)
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(6 * 2, 8, dtype=torch.float64, generator=gen)  # s 6, b 2
    c = torch.randn(6 * 2, 8, dtype=torch.float64, generator=gen)
    grads = []
    for scale, attach in ((0.37, True), (0.37, False), (1.0, True)):
        router = Router(cfg, _ctx(), KEY)
        x = x0.clone().requires_grad_(True)
        r = router(x)
        aux = aux_losses(r, cfg, _ctx(), 6, 2)
        assert set(aux) == {"load_balance", "z_loss"}
        total = aux["load_balance"] + aux["z_loss"]
        y = x * r.weight.sum(-1, keepdim=True) * 2.0  # the "main" path also uses the router
        if attach:
            state = MoEState(aux_scale=scale) if scale != 1.0 else None
            out = attach_aux_loss(y, total, state)
            assert torch.equal(out, y)
            (out * c).sum().backward()
        else:
            ((y * c).sum() + scale * total).backward()
        grads.append((x.grad, router.weight.grad))
    for a, b in zip(grads[0], grads[1], strict=True):
        assert a is not None and b is not None and torch.allclose(a, b, atol=TOL, rtol=0)
    assert not torch.allclose(grads[0][1], grads[2][1])  # type: ignore[arg-type]
    x = x0.clone()
    assert attach_aux_loss(x, None, MoEState()) is x
    assert attach_aux_loss(x, torch.tensor(1.0), MoEState()) is x  # no grad: nothing attached


def test_state_records_sums_and_skips_recomputation() -> None:
    state = MoEState(aux_scale=0.5)
    x = torch.ones(3, requires_grad=True)

    def layer(v: torch.Tensor) -> torch.Tensor:
        state.record("layers.1.mlp", torch.tensor([3, 1]), 1, 4,
                     {"load_balance": torch.tensor(0.25)})
        return v * 2

    tc.checkpoint(layer, x, use_reentrant=False).sum().backward()  # forward + recompute
    state.record("layers.1.mlp", torch.tensor([0, 4]), 2, 4, {"load_balance": torch.tensor(0.75)})
    got = state.read()["layers.1.mlp"]
    assert got.microbatches == 2 and got.dropped == 3 and got.routed == 8
    assert got.loads is not None and got.loads.tolist() == [3, 5]
    assert got.aux_means() == {"load_balance": 0.5} and got.dropped_fraction == 3 / 8
    state.reset()
    assert state.read() == {} and state.steps == 1 and state.aux_scale == 0.5


def test_group_limited_sigmoid_routing_and_scaling() -> None:
    """DeepSeek-V3's router: 4 experts in 2 groups, a token's experts only from its best group
    (the sum of the group's two largest biased scores), weights normalised then x 2.5."""
    w = [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 1.0]]
    x = _x([[3.0, 2.0]])  # logits [3, 0, 2, 2]: expert 0 is best, group 1 (2 + 2) beats 3 + 0
    s = [1 / (1 + math.exp(-v)) for v in (3.0, 0.0, 2.0, 2.0)]
    free = _router(_cfg(num_experts=4, moe_router="sigmoid"), w)(x)
    assert free.expert.tolist() == [[0, 2]]
    cfg = _cfg(num_experts=4, moe_router="sigmoid", moe_n_group=2, moe_topk_group=1,
               moe_routed_scaling_factor=2.5)
    r = _router(cfg, w)(x)
    assert r.expert.tolist() == [[2, 3]]
    assert torch.allclose(r.weight, _x([[1.25, 1.25]]), atol=TOL)
    assert torch.allclose(r.probs, _x([[v / sum(s) for v in s]]), atol=TOL)
