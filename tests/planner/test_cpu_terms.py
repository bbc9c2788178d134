"""CPU terms of the timing model: the fitted efficiency and time-sharing of the cores."""

from __future__ import annotations

import dataclasses

import pytest

from colonnade.planner.calibrate import fit_cpu_efficiency, tiny_workload
from colonnade.planner.estimate import estimate
from colonnade.planner.hardware import PRESETS
from colonnade.planner.layout import Layout
from colonnade.planner.timing import layer_forward_s

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
    w = tiny_workload()
    single = estimate(w, Layout(micro_batch=4), CPU).step_s
    dp2_two_cores = estimate(w, Layout(dp=2, micro_batch=4), CPU).step_s
    one_core = dataclasses.replace(CPU, compute_units=1.0)
    dp2_one_core = estimate(w, Layout(dp=2, micro_batch=4), one_core)
    assert dp2_two_cores < 0.6 * single  # half the micro-batches per rank, two cores
    # one free core: the two ranks' summed busy time (compute + communication + optimizer)
    t = dp2_one_core.timing
    busy = (t.compute + t.tp_comm + t.dp_comm + t.optimizer) * 2
    assert t.total == pytest.approx(busy + CPU.step_overhead_s, rel=1e-9)
    assert single * 0.95 < t.total < single * 1.15
