"""The grouped GEMM and the stacked experts on their own.

* grouped_mm (both paths) against a per-row reference ``y_i = x_i w_{e(i)}^T`` built by
  gathering each row's expert weight: float64 (the loop), float32 (``torch._grouped_mm`` where
  this build has it), forward and gradients, with experts that get no row;
* GroupedExperts' initial weights: the ep x expert tp shards of every layout (ep 1, 2, 4;
  expert tp 1, 2) put together equal the single-process experts bit for bit, gate/up at
  init_std and down at the output std;
* GroupedExperts' forward against plain per-expert SwiGLU / GELU(+bias) MLPs.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from colonnade.config.sections import ModelConfig
from colonnade.moe.experts import GroupedExperts, expert_splits
from colonnade.moe.grouped_gemm import grouped_mm, grouped_mm_loop, grouped_mm_supported
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.sharding import output_std
from tests.parity import tiny_model

COUNTS = [3, 0, 5, 0, 4]  # experts 1 and 3 get no row


def _problem(dtype: torch.dtype, inp: int = 32, out: int = 48
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(COUNTS), inp, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(len(COUNTS), out, inp, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(sum(COUNTS), out, generator=gen, dtype=torch.float64).to(dtype)
    return x, w, g


def _per_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y_i = x_i w_{e(i)}^T, each row's expert weight gathered: [t, out, in] x [t, in]."""
    owner = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))  # [t]
    return torch.einsum("toi,ti->to", w[owner], x)


def _grads(fn: object, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fn(xs, ws)  # type: ignore[operator]
    y.backward(g)
    assert xs.grad is not None and ws.grad is not None
    return y.detach(), xs.grad, ws.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_mm_matches_per_row_products(dtype: torch.dtype) -> None:
    x, w, g = _problem(dtype)
    got = _grads(lambda a, b: grouped_mm(a, b, torch.tensor(COUNTS)), x, w, g)
    want = _grads(_per_row, x, w, g)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        err = float((a - b).double().norm() / b.double().norm())
        assert err <= tol, f"{dtype} {name}: {err}"
    assert torch.all(got[2][1] == 0) and torch.all(got[2][3] == 0), "empty experts' dw"


def test_kernel_and_loop_agree_in_fp32() -> None:
    """Where torch._grouped_mm runs on this machine (CPU float32), it equals the loop."""
    x, w, g = _problem(torch.float32)
    loop = _grads(lambda a, b: grouped_mm_loop(a, b, COUNTS), x, w, g)
    assert not grouped_mm_supported("cpu", torch.float64)  # float64 always takes the loop
    if torch.__version__ >= "2.9":  # this venv's build runs the CPU kernel: exercise it
        assert grouped_mm_supported("cpu", torch.float32)
    fast = _grads(lambda a, b: grouped_mm(a, b, COUNTS), x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), fast, loop, strict=True):
        assert float((a - b).norm() / b.norm()) <= 1e-6, name


def test_grouped_mm_rejects_counts_not_matching_rows() -> None:
    x, w, _ = _problem(torch.float64)
    with pytest.raises(ValueError, match="do not match"):
        grouped_mm_loop(x, w, [1, 2, 3, 4, 5])


def _context(ep: int, rank: int, etp: int = 1, etp_rank: int = 0) -> ParallelContext:
    stats = CommStats()
    return ParallelContext(group=CommGroup("tp", [0], None, stats, 0), sp=False, seed=7,
                           rng=RNGTracker(7), dtype=torch.float64,
                           ep=CommGroup("ep", list(range(ep)), None, stats, rank),
                           expert_tp=CommGroup("expert_tp", list(range(etp)), None, stats,
                                               etp_rank))


def _model(arch: str, bias: bool = False) -> ModelConfig:
    return dataclasses.replace(tiny_model(arch, bias=bias), num_experts=4, moe_top_k=2,
                               moe_ffn_hidden_size=24)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_expert_init_identical_in_every_expert_layout(arch: str) -> None:
    cfg = _model(arch, bias=arch == "gpt2")
    single = dict(GroupedExperts(cfg, _context(1, 0), "layers.0.mlp.experts").named_parameters())
    names = ["gate", "up", "down"] if arch == "llama" else ["up", "down", "up_bias", "down_bias"]
    assert sorted(single) == sorted(names)
    for ep, etp in ((2, 1), (4, 1), (1, 2), (2, 2)):
        shards = [GroupedExperts(cfg, _context(ep, r, etp, t), "layers.0.mlp.experts")
                  for r in range(ep) for t in range(etp)]  # Sharding.layout order: ep, then tp
        for name in names:
            parts = [getattr(s, name) for s in shards]
            sharding = parts[0].sharding
            assert all(p.shape[0] == 4 // ep for p in parts)
            assert sharding.splits == expert_splits(name)
            assert sharding.tp_partial_grad == (name == "down_bias" and etp > 1)
            if "tp" not in sharding.split_axes:  # down_bias: the expert tp ranks hold copies
                assert all(torch.equal(p, parts[r - r % etp]) for r, p in enumerate(parts))
                parts = parts[::etp]
            full = sharding.unshard([p.detach() for p in parts], {"ep": ep, "tp": etp})
            assert torch.equal(full, single[name].detach()), f"ep{ep} etp{etp} {name}"
        assert [s.first for s in shards] == [r * (4 // ep) for r in range(ep) for _ in range(etp)]
    std, out_std = cfg.init_std, output_std(cfg.init_std, cfg.num_layers)
    assert abs(float(single["up"].detach().std()) - std) < 0.1 * std
    assert abs(float(single["down"].detach().std()) - out_std) < 0.1 * out_std
    assert math.isclose(out_std, std / math.sqrt(2 * cfg.num_layers))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_grouped_experts_forward_matches_plain_mlps(arch: str) -> None:
    cfg = _model(arch, bias=arch == "gpt2")
    experts = GroupedExperts(cfg, _context(1, 0), "k")
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.3)  # non-zero biases too
    counts = [2, 0, 3, 1]
    x = torch.randn(6, cfg.hidden_size, dtype=torch.float64)
    got = experts(x, torch.tensor(counts))
    rows, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start:start + n]
        start += n
        if arch == "llama":
            assert experts.gate is not None
            h = F.silu(xe @ experts.gate[e].T) * (xe @ experts.up[e].T)
            rows.append(h @ experts.down[e].T)
        else:
            assert experts.up_bias is not None and experts.down_bias is not None
            h = F.gelu(xe @ experts.up[e].T + experts.up_bias[e], approximate="tanh")
            rows.append(h @ experts.down[e].T + experts.down_bias[e])
    assert torch.allclose(got, torch.cat(rows), rtol=1e-12, atol=1e-14)


def _gpt_oss_rows(experts: GroupedExperts, x: torch.Tensor, counts: list[int],
                  alpha: float, limit: float) -> torch.Tensor:
    """transformers' GptOssExperts per expert: (x G^T + g), (x U^T + u), clamped SwiGLU
    (u' + 1) g' sigmoid(alpha g'), g' = min(gate, limit), u' = clamp(up, +-limit); down + d."""
    assert experts.gate is not None and experts.gate_bias is not None
    assert experts.up_bias is not None and experts.down_bias is not None
    rows, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start:start + n]
        start += n
        gate = (xe @ experts.gate[e].T + experts.gate_bias[e]).clamp(max=limit)
        up = (xe @ experts.up[e].T + experts.up_bias[e]).clamp(-limit, limit)
        h = (up + 1) * gate * torch.sigmoid(alpha * gate)
        rows.append(h @ experts.down[e].T + experts.down_bias[e])
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gpt_oss_experts_biases_and_clamped_swiglu(dtype: torch.dtype) -> None:
    """gpt-oss's experts (biases on gate, up, down; the clamped SwiGLU with a limit the
    random activations cross) equal the per-expert formula, forward and every gradient; in
    float32 through torch._grouped_mm (the kernel path; float64 takes the loop)."""
    from colonnade.moe.experts import clamped_swiglu

    cfg = dataclasses.replace(_model("llama", bias=True), arch="gpt_oss", moe_swiglu_limit=1.5)
    ctx = dataclasses.replace(_context(1, 0), dtype=dtype)
    experts = GroupedExperts(cfg, ctx, "k", gated=True, biases=True,
                             activation=clamped_swiglu(1.702, 1.5))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.3)  # non-zero biases too
    counts = [2, 0, 3, 1]
    x = torch.randn(6, cfg.hidden_size, dtype=dtype, generator=torch.Generator().manual_seed(2))
    got = experts(x, torch.tensor(counts))
    want = _gpt_oss_rows(experts, x, counts, 1.702, 1.5)
    params = [p for _, p in sorted(experts.named_parameters())]
    g_got = torch.autograd.grad(got.square().sum(), params)
    g_want = torch.autograd.grad(want.square().sum(), params)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert float((got - want).detach().norm() / want.detach().norm()) <= tol
    for (name, _), a, b in zip(sorted(experts.named_parameters()), g_got, g_want, strict=True):
        assert float((a - b).norm() / b.norm()) <= tol, name
    assert sorted(dict(experts.named_parameters())) == [
        "down", "down_bias", "gate", "gate_bias", "up", "up_bias"]
    assert dtype == torch.float64 or grouped_mm_supported("cpu", dtype)
