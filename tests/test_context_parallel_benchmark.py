"""Issue 16's benchmark maths (benchmarks/context_parallel.py and context_parallel_peer.py), no
timing run: the peer's (picotron-style) eager block kernel, log-sum-exp merge and block
backward against SDPA in float64, the fused block kernels against the eager ones; its ring over
contiguous rows on 2 and 4 ranks (outputs and gradients); the probe of
torch's experimental context-parallel API records why it does not run on CPU; the summary's
per-round ratios, memory ratios and the first-loss check."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.bench_import import load_benchmark

NAME = "bench_context_parallel"
"""The module name the benchmark is loaded under (``context_parallel`` would be found as
tests/context_parallel by the ranks, which import rank functions by module name first)."""


def _bench() -> ModuleType:
    """benchmarks/context_parallel.py (see :func:`tests.bench_import.load_benchmark`)."""
    return load_benchmark("context_parallel.py", NAME)


def _peer() -> ModuleType:
    """benchmarks/context_parallel_peer.py (the benchmark imports it)."""
    _bench()
    return sys.modules["context_parallel_peer"]


def _qkv(s: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, s, 8, generator=gen, dtype=torch.float64) for _ in range(4)]


@pytest.mark.parametrize("causal", [True, False])
def test_eager_blocks_merge_to_sdpa(causal: bool) -> None:
    """Keys split in two blocks: the merged block outputs equal full attention, and the block
    backward with the final out / lse gives SDPA's gradients (summed over blocks for q)."""
    cpb = _peer()
    q, k, v, dout = _qkv(16)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    ref.backward(dout)
    scale = 8 ** -0.5
    # rows 8..15 of q against key blocks [0, 8) (full) and [8, 16) (the causal diagonal)
    qb = q[:, :, 8:]
    o1, l1 = cpb.eager_block(qb, k[:, :, :8], v[:, :, :8], scale, False)
    o2, l2 = cpb.eager_block(qb, k[:, :, 8:], v[:, :, 8:], scale, causal)
    out, lse = cpb.merge_lse(o1, l1, o2, l2)
    torch.testing.assert_close(out, ref[:, :, 8:], rtol=0, atol=1e-13)
    # the full-row block gives the same lse as torch.logsumexp over all scores
    o_all, l_all = cpb.eager_block(q, k, v, scale, causal)
    torch.testing.assert_close(o_all, ref.detach(), rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, l_all[:, :, 8:], rtol=0, atol=1e-13)
    dq, dk, dv = cpb.eager_block_backward(dout, q, k, v, o_all, l_all, scale, causal)
    for got, want in zip((dq, dk, dv), leaves, strict=True):
        torch.testing.assert_close(got, want.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_block_kernels_equal_eager(causal: bool) -> None:
    """The fused peer kernel gives the eager block's out / lse and, with the merged out / lse
    of a two-block split, the same per-block gradients."""
    cpb = _peer()
    q, k, v, dout = _qkv(16, seed=5)
    fused, eager = cpb.fused_block(q, k, v, 0.3, causal), cpb.eager_block(q, k, v, 0.3, causal)
    for a, b in zip(fused, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    blocks = [(k[:, :, :8], v[:, :, :8], False), (k[:, :, 8:], v[:, :, 8:], causal)]
    qb = q[:, :, 8:]
    out, lse = cpb.merge_lse(*cpb.eager_block(qb, *blocks[0], 0.3),
                             *cpb.eager_block(qb, *blocks[1], 0.3))
    for kb, vb, c in blocks:
        fused = cpb.fused_block_backward(dout[:, :, 8:], qb, kb, vb, out, lse, 0.3, c)
        eager = cpb.eager_block_backward(dout[:, :, 8:], qb, kb, vb, out, lse, 0.3, c)
        for a, b in zip(fused, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_merge_lse_is_order_free_and_exact() -> None:
    """merge(a, b) = merge(b, a), and the merged lse is log(e^la + e^lb)."""
    cpb = _peer()
    oa, ob, _, _ = _qkv(4, seed=3)
    la, lb = torch.randn(1, 2, 4, dtype=torch.float64), torch.randn(1, 2, 4, dtype=torch.float64)
    o1, l1 = cpb.merge_lse(oa, la, ob, lb)
    o2, l2 = cpb.merge_lse(ob, lb, oa, la)
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-15)
    torch.testing.assert_close(l1, l2, rtol=0, atol=1e-15)
    torch.testing.assert_close(l1, torch.log(la.exp() + lb.exp()), rtol=0, atol=1e-14)
    wa = (la - l1).exp().unsqueeze(-1)
    torch.testing.assert_close(o1, wa * oa + (1 - wa) * ob, rtol=0, atol=1e-14)


def test_contiguous_split_is_picotrons() -> None:
    cpb = _peer()
    x = torch.arange(12).view(1, 1, 12, 1)
    assert cpb.contiguous_local(x, 3, 1, 2).flatten().tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize(("cp", "name", "kv"), [(2, "picotron_ring", 4), (4, "picotron_ring", 4),
                                                (4, "picotron_ring_fused", 2)])
def test_picotron_ring_matches_sdpa(run_ranks: Callable[..., list[Any]], cp: int, name: str,
                                    kv: int) -> None:
    """The peer's ring (contiguous rows, k/v and dK/dV around the ring), eager or fused
    blocks, GQA by expanding kv heads first: out, dq, dk, dv equal full-sequence SDPA's rows
    on every rank (float64, relative to the largest value)."""
    cpb = _bench()
    errors = run_ranks(cp, cpb.attention_errors, name, cp, kv)
    assert max(errors) < 1e-12


def test_torch_cp_probe_records_the_cpu_error(run_ranks: Callable[..., list[Any]]) -> None:
    """torch 2.13's experimental context_parallel has no CPU SDPA sharding rule: the probe
    returns the error text the module doc quotes (None would mean it runs: benchmark it)."""
    probe = run_ranks(2, _peer().probe_torch_cp)
    assert probe[0] == probe[1]
    assert probe[0] is not None
    assert "_scaled_dot_product_flash_attention_for_cpu" in probe[0]
    assert "sharding strategy" in probe[0]


def test_round_medians_and_ratios() -> None:
    cpb = _bench()
    res = [{"times": [1.0, 3.0]}, {"times": [2.0, 2.0]},  # round 1, ranks 0 and 1
           {"times": [4.0, 4.0]}, {"times": [5.0, 7.0]}]  # round 2
    assert cpb.round_medians(res, 2) == [2.0, 4.5]
    assert cpb.round_medians([{"x": 1.0}, {"x": 3.0}], 1, "x") == [1.0, 3.0]
    stats = cpb.ratio_stats([2.0, 6.0, 9.0], [1.0, 2.0, 3.0])
    assert stats == {"ratio": 3.0, "ratio_q1": 2.5, "ratio_q3": 3.0,
                     "ratio_rounds": [2.0, 3.0, 3.0]}
    assert cpb.ratio_stats([3.0], [2.0])["ratio"] == 1.5


def _model_run(name: str, rank: int, t: float, saved: int, loss: float) -> dict[str, Any]:
    return {"name": name, "seq": 64, "cp": 1, "rank": rank, "losses": [loss], "times": [t],
            "cpu_s": [t], "exposed_s": 0.01 * rank, "wire_bytes": 100.0,
            "cp_ops": {"cp/p2p/cp_ring_kv": {"waited_s": 0.01 * rank}}, "saved_bytes": saved,
            "peak_bytes": 2 * saved, "model_activation_bytes": 1000.0}


def test_summarize_model_ratios_and_loss_check() -> None:
    """speedup = cp1 / cp2 per round; memory ratios use the largest rank; the loss check
    accepts 1e-5 relative and names the variant beyond it."""
    cpb = _bench()
    runs = {(64, "cp1"): [_model_run("cp1", 0, 2.0, 1000, 6.0)],
            (64, "cp2_ring"): [_model_run("cp2_ring", 0, 1.0, 480, 6.00001),
                               _model_run("cp2_ring", 1, 1.5, 520, 6.00001)]}
    rows = {r["variant"]: r for r in cpb.summarize_model(runs)}
    cp2 = rows["cp2_ring"]
    assert cp2["cp"] == 2 and cp2["step_s"] == 1.25
    assert cp2["speedup_vs_cp1"]["ratio"] == pytest.approx(1.6)
    assert cp2["saved_vs_cp1"] == pytest.approx(0.52)
    assert cp2["peak_vs_cp1"] == pytest.approx(0.52)
    assert cp2["saved_vs_model"] == pytest.approx(0.52)
    assert cp2["exposed_s"] == pytest.approx(0.005)
    assert cp2["cp_ops_waited_s"] == {"cp/p2p/cp_ring_kv": pytest.approx(0.005)}
    cpb.check_model_losses(list(rows.values()))
    rows["cp2_ring"]["loss"] = 6.001
    with pytest.raises(AssertionError, match="cp2_ring s=64"):
        cpb.check_model_losses(list(rows.values()))


def test_model_overrides_resolve_to_the_layout() -> None:
    cpb = _bench()
    w = cpb.cp_workload(64)
    cfg = cpb.colonnade_config(w, 1, 2, cpb.model_overrides(2, "all_to_all", False))
    assert (cfg.parallel.cp, cfg.parallel.cp_attention, cfg.parallel.cp_overlap) == (
        2, "all_to_all", False)
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == (64, 2, 4)
    assert cfg.training.seq_len == 64 and cfg.training.micro_batch_size == 1
