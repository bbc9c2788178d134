"""The GEMM efficiency curve: intensity, monotone in size, lower on H100 for small models, the
stored H100 constants are the fit, and published H100 runs that no fit saw are predicted."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from colonnade.analysis.efficiency import gemm_efficiency, gemm_intensity, layer_gemm_s, layer_gemms
from colonnade.analysis.fit import fit_gemm_curve, h100_errors
from colonnade.analysis.hardware import (
    A100_EFFICIENCY,
    H100_EFFICIENCY,
    H100_KNEE_BALANCE,
    PRESETS,
    Cluster,
)
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.published import HELD_OUT_H100, MPT_H100_FIT
from colonnade.analysis.timing import step_time
from colonnade.config.sections import ModelConfig

A100, H100, H200 = PRESETS["a100-80gb"], PRESETS["h100-sxm"], PRESETS["h200"]
OLD_H100 = dataclasses.replace(H100, efficiency=A100_EFFICIENCY, gemm_knee_balance=0.0)
"""The H100 preset before the curve: the A100's one constant."""


def workload(hidden: int, arch: str = "gpt2") -> Workload:
    model = ModelConfig(arch=arch, num_layers=2, hidden_size=hidden,
                        num_heads=max(1, hidden // 128), vocab_size=50304, max_seq_len=2048)
    return Workload(model=model, seq_len=2048, global_batch=4)


def layer_fraction(c: Cluster, hidden: int, tp: int = 1) -> float:
    """Achieved fraction of peak of one layer's GEMMs (forward, micro-batch 4)."""
    w, lay = workload(hidden), Layout(tp=tp, micro_batch=4)
    mats, core = layer_gemms(w, lay)
    flops = sum(f for f, _ in mats) + core[0]
    return flops / sum(layer_gemm_s(w, lay, c)) / c.peak_flops_per_s("bf16")


def test_gemm_intensity_numbers() -> None:
    # square n: 2 n^3 / (E 3 n^2) = 2n / (3E); a fused kernel that never writes [m, n]
    assert gemm_intensity(3000, 3000, 3000, 2) == pytest.approx(1000.0)
    assert gemm_intensity(2048, 128, 2048, 2, write_out=False) == pytest.approx(2048 / 2)
    # the smallest dimension sets it: a skinny GEMM is bandwidth-bound
    assert gemm_intensity(8192, 8192, 8, 2) == pytest.approx(2 / (2 * (1 / 8 + 2 / 8192)))
    assert H100.gemm_knee == pytest.approx(H100_KNEE_BALANCE * 989e12 / 3350e9)
    assert gemm_efficiency(H100, H100.gemm_knee) == pytest.approx(H100_EFFICIENCY / 2)
    assert gemm_efficiency(A100, 1.0) == A100.efficiency  # no knee: one constant


def test_curve_is_monotone_in_size_and_below_its_asymptote() -> None:
    hiddens = [256, 512, 1024, 2048, 4096, 8192, 16384]
    for c in (H100, H200):
        fractions = [layer_fraction(c, h) for h in hiddens]
        assert all(a < b for a, b in itertools.pairwise(fractions)), fractions
        assert fractions[-1] < c.efficiency and fractions[0] < 0.8 * c.efficiency
    # tp shards the GEMMs: the same layer over tp 8 runs each rank's GEMMs less efficiently
    assert layer_fraction(H100, 8192, tp=8) < layer_fraction(H100, 8192, tp=1)
    # the A100 keeps Table 1's one constant (Table 1 does not identify a knee)
    assert [layer_fraction(A100, h) for h in hiddens] == pytest.approx([A100_EFFICIENCY] * 7)


def test_small_models_reach_a_lower_fraction_of_peak_on_h100() -> None:
    """hidden <= 4096: the H100 reaches a lower fraction of its peak than the A100 (and than
    the old preset, which copied the A100's); the H200's bandwidth lifts small models."""
    for hidden in (1024, 2048, 4096):
        h100 = layer_fraction(H100, hidden)
        assert h100 < 0.8 * layer_fraction(A100, hidden)
        assert h100 < 0.8 * layer_fraction(OLD_H100, hidden)
        assert layer_fraction(H200, hidden) > h100
    # whole-step: a 1.3B-shaped model's predicted MFU on one H100 falls below the old one's
    w = Workload(model=ModelConfig(arch="gpt2", num_layers=24, hidden_size=2048, num_heads=16,
                                   vocab_size=50304, max_seq_len=2048),
                 seq_len=2048, global_batch=8)
    lay = Layout(micro_batch=4)
    assert step_time(w, lay, H100).total > 1.3 * step_time(w, lay, OLD_H100).total


def test_no_knee_is_the_one_constant_model() -> None:
    """knee 0: every GEMM at ``efficiency``, so the time is FLOPs / (efficiency x peak)."""
    w, lay = workload(1024, "llama"), Layout(tp=2, micro_batch=2)
    mats, core = layer_gemms(w, lay)
    flops = sum(f for f, _ in mats) + core[0]
    assert sum(layer_gemm_s(w, lay, A100)) == pytest.approx(flops / A100.flops_per_s("bf16"))


def test_h100_constants_are_the_minimax_fit() -> None:
    eff, knee = fit_gemm_curve(H100)
    assert eff == pytest.approx(H100_EFFICIENCY, abs=0.005)
    assert knee == pytest.approx(H100_KNEE_BALANCE, abs=0.02)
    assert max(abs(e) for e in h100_errors(H100, MPT_H100_FIT)) < 0.06
    # without a knee the best single constant is worse on the same rows
    flat = dataclasses.replace(H100, gemm_knee_balance=0.0)
    best_flat = min(max(abs(e) for e in h100_errors(dataclasses.replace(flat, efficiency=x),
                                                    MPT_H100_FIT))
                    for x in (0.46, 0.48, 0.50, 0.52, 0.54))
    assert best_flat > 0.065


def test_held_out_h100_runs_are_predicted() -> None:
    """Published H100 runs no fit used (other sizes, node counts, sequence lengths,
    checkpointing): within 16% each, where the old preset over-predicted every one by 16-59%."""
    after = h100_errors(H100, HELD_OUT_H100)
    before = h100_errors(OLD_H100, HELD_OUT_H100)
    assert max(abs(e) for e in after) < 0.16, after
    assert min(before) > 0.15, before
    small = [a for a, r in zip(after, HELD_OUT_H100, strict=True)
             if r.workload().model.hidden_size <= 4096]
    assert len(small) == 6 and max(abs(e) for e in small) < 0.16


def test_tiny_models_are_launch_bound_on_gpus() -> None:
    """A demo-sized model's kernels are shorter than their launches: its predicted step is the
    host's launch floor (ops x launch_us), not the microseconds of its FLOPs; a 1.3B model's
    step is its kernels'; the CPU has no floor (it pays op_overhead_us on top)."""
    from colonnade.analysis.timing import OPS_PER_LAYER, launch_floor_s

    tiny = Workload(model=ModelConfig(arch="llama", num_layers=4, hidden_size=96, num_heads=4,
                                      num_kv_heads=2, vocab_size=2048, max_seq_len=256),
                    seq_len=128, global_batch=16)
    lay = Layout(micro_batch=4)  # 4 micro-batches
    floor = launch_floor_s(tiny, lay, H200)
    assert floor == pytest.approx(4 * (4 * OPS_PER_LAYER * 3 + 12 * 3) * H200.launch_us * 1e-6)
    assert step_time(tiny, lay, H200).total == pytest.approx(floor)
    no_floor = dataclasses.replace(H200, launch_us=0.0)
    assert step_time(tiny, lay, no_floor).total < floor / 10
    big = workload(2048)
    assert step_time(big, Layout(micro_batch=4), H200).total > 10 * launch_floor_s(
        big, Layout(micro_batch=4), H200)
    assert launch_floor_s(tiny, lay, PRESETS["cpu-local"]) == 0.0
