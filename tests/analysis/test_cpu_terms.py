"""CPU terms of the timing model: the fitted efficiency and time-sharing of the cores."""

from __future__ import annotations

import dataclasses

import pytest

from colonnade.analysis.calibrate import fit_cpu_efficiency, fit_cpu_head_efficiency, tiny_workload
from colonnade.analysis.estimate import estimate
from colonnade.analysis.hardware import PRESETS
from colonnade.analysis.layout import Layout
from colonnade.analysis.timing import (
    head_fwd_bwd_s,
    layer_forward_s,
    step_collectives_s,
    step_time,
)

CPU = dataclasses.replace(PRESETS["cpu-local"], efficiency=1.0, compute_units=2,
                          op_overhead_us=10.0)


def test_fit_cpu_efficiency_inverts_the_layer_model() -> None:
    w = tiny_workload()
    roof, host = layer_forward_s(w, Layout(micro_batch=4), CPU)
    assert host == pytest.approx(24 * 10e-6)
    measured = 3 * roof / 0.4 + 3 * host  # a layer reaching 40% of the micro-benchmark peaks
    assert fit_cpu_efficiency(CPU, w, 4, measured) == pytest.approx(0.4, rel=1e-9)
    assert fit_cpu_efficiency(CPU, w, 4, 3 * roof / 2 + 3 * host) == 1.0  # clamped
    assert fit_cpu_efficiency(CPU, w, 4, host) == 0.05  # host time alone exceeds it


def test_ranks_beyond_free_cores_time_share() -> None:
    w = dataclasses.replace(tiny_workload(), overlap_grad_reduce=False)  # dp comm all exposed
    single = estimate(w, Layout(micro_batch=4), CPU).step_s
    dp2_two_cores = estimate(w, Layout(dp=2, micro_batch=4), CPU).step_s
    one_core = dataclasses.replace(CPU, compute_units=1.0)
    t = estimate(w, Layout(dp=2, micro_batch=4), one_core).timing
    assert dp2_two_cores < 0.6 * single  # half the micro-batches per rank, two cores
    # one free core: the two ranks' compute + optimizer time-share it, the waits add on top
    expected = ((t.compute + t.optimizer) * 2 + t.dp_comm + CPU.step_overhead_s
                + step_collectives_s(w, Layout(dp=2, micro_batch=4), one_core))
    assert t.total == pytest.approx(expected, rel=1e-9)
    assert single * 0.95 < t.total < single * 1.15


def test_sp_uses_the_gather_and_scatter_latencies() -> None:
    w = tiny_workload()
    lay = Layout(tp=2, micro_batch=4, sp=True)
    base = estimate(w, lay, CPU).timing.tp_comm
    slow_rs = dataclasses.replace(CPU, reduce_scatter_latency_us=CPU.intra_latency_us + 1000)
    # 4 layers x (2 fwd + 2 bwd) pairs = 16 reduce-scatters per micro-batch (4 micro-batches),
    # each 1 ms dearer (one ring step on 2 ranks); embedding and head are modelled apart
    assert estimate(w, lay, slow_rs).timing.tp_comm - base == pytest.approx(16 * 4 * 1e-3)
    no_sp = estimate(w, dataclasses.replace(lay, sp=False), CPU).timing.tp_comm
    assert base == pytest.approx(no_sp)  # ring model: all-reduce = reduce-scatter + all-gather


def test_step_collectives_count_the_layout() -> None:
    """Latency-only all-reduces per step: grad norm over tp and pp (+dp with ZeRO-1), the
    logged loss over the world, sp-partial grads over tp with sp; each 2 (n-1) alpha here."""
    w = tiny_workload()
    lat = dataclasses.replace(CPU, intra_latency_us=1000.0, intra_node_gbps=1e9)
    alpha = 1e-3

    def count(lay: Layout) -> float:
        return step_collectives_s(w, lay, lat) / alpha

    assert count(Layout()) == pytest.approx(0.0)
    assert count(Layout(dp=2)) == pytest.approx(2.0, rel=1e-6)  # log loss over 2 ranks
    assert count(Layout(tp=2, pp=2)) == pytest.approx(2 + 2 + 6, rel=1e-6)  # norm tp, pp; loss 4
    assert count(Layout(tp=2, dp=2, sp=True, zero=1)) == pytest.approx(
        2 + 2 + 6 + 2, rel=1e-6)  # norm tp, dp; loss over 4; sp grads over tp


def test_skew_scales_the_compute_of_synchronised_ranks() -> None:
    w = tiny_workload()
    many = dataclasses.replace(CPU, compute_units=8)
    lay = Layout(tp=2, micro_batch=4)
    base = step_time(w, lay, many)
    skewed = dataclasses.replace(many, sync_skew_2=0.1, sync_skew_4=0.3)
    assert skewed.skew_fraction(1) == 0.0
    assert skewed.skew_fraction(2) == pytest.approx(0.1)
    assert skewed.skew_fraction(4) == pytest.approx(0.3)
    assert step_time(w, lay, skewed).total - base.total == pytest.approx(0.1 * base.compute)
    one = Layout(micro_batch=4)
    assert step_time(w, one, skewed) == step_time(w, one, many)


def test_fit_cpu_head_efficiency_inverts_the_head_model() -> None:
    w = tiny_workload()
    roof, host, fwd = head_fwd_bwd_s(w, Layout(micro_batch=4), CPU)
    assert host == pytest.approx(3 * 12 * 10e-6)
    assert 0 < fwd < roof + host
    assert fit_cpu_head_efficiency(CPU, w, 4, roof / 0.6 + host) == pytest.approx(0.6, rel=1e-9)
    slow_head = dataclasses.replace(CPU, head_efficiency=0.5)
    assert slow_head.head().efficiency == 0.5 and CPU.head() is CPU
    lay = Layout(micro_batch=4)
    extra = step_time(w, lay, slow_head).total - step_time(w, lay, CPU).total
    assert extra == pytest.approx(4 * roof, rel=1e-9)  # 4 micro-batches, roofline at half speed


def test_oversubscribed_tp_pipeline_follows_its_slowed_critical_path() -> None:
    """tp2 x pp2 on 2 cores: the slowest stage's compute (and the fill/drain) at 2/4 speed
    plus its tp waits bound the step from below, above the summed-work bound."""
    w = tiny_workload()
    lay = Layout(tp=2, pp=2, micro_batch=4)
    two = step_time(w, lay, CPU)
    many = step_time(w, lay, dataclasses.replace(CPU, compute_units=8))
    crit = 2 * (many.compute + many.bubble + many.optimizer) + many.tp_comm
    p2p_all = many.p2p * (2 * (4 * 1 + 2 - 1)) / 2  # overlap exposes 2 (p-1) of them
    extra = step_collectives_s(w, lay, CPU) + CPU.step_overhead_s
    assert two.total == pytest.approx(crit + p2p_all + extra, rel=1e-9)
    no_tp = step_time(w, Layout(pp=2, dp=2, micro_batch=4), CPU)
    assert no_tp.total < 0.8 * two.total  # dp x pp ranks sync rarely: the work bound holds


def test_backward_ratio_sets_the_backward_and_the_price_of_recompute() -> None:
    """A layer's backward = backward_ratio x its forward; full recompute adds one forward, so
    with a cheap backward (CPU: ~1.1) recompute costs a larger share of the step."""
    w = tiny_workload()
    lay = Layout(micro_batch=4)
    full = dataclasses.replace(lay, recompute="full")
    roof, host = layer_forward_s(w, lay, CPU)
    layers = 4 * w.model.num_layers  # micro-batches x layers of the step
    for ratio in (2.0, 1.0):
        c = dataclasses.replace(CPU, backward_ratio=ratio)
        extra = step_time(w, full, c).compute - step_time(w, lay, c).compute
        assert extra == pytest.approx(layers * (roof + host), rel=1e-9)
    slow, fast = (dataclasses.replace(CPU, backward_ratio=r) for r in (2.0, 1.0))
    assert (step_time(w, lay, slow).compute - step_time(w, lay, fast).compute
            == pytest.approx(layers * (roof + host), rel=1e-9))
    # the efficiency fit inverts (1 + r) (roof / eff + host)
    assert fit_cpu_efficiency(fast, w, 4, 2 * (roof / 0.4 + host)) == pytest.approx(0.4)


def test_zb_h1_pays_the_split_backward_per_layer_and_micro_batch() -> None:
    """ZB-H1's B / W split costs split_backward_us per layer and micro-batch on every stage:
    pp2, 4 micro-batches, 2 layers a stage -> the slowest stage's 4 x 2 and the other's
    fill/drain 2; other schedules do not pay it."""
    w = tiny_workload()
    many = dataclasses.replace(CPU, compute_units=8)
    split = dataclasses.replace(many, split_backward_us=1000.0)
    zb = Layout(pp=2, micro_batch=4, schedule="zb_h1")
    extra = step_time(w, zb, split).total - step_time(w, zb, many).total
    assert extra == pytest.approx((4 * 2 + 2) * 1e-3, rel=1e-9)
    plain = dataclasses.replace(zb, schedule="1f1b")
    assert step_time(w, plain, split) == step_time(w, plain, many)
