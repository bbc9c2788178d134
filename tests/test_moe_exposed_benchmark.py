"""benchmarks/moe_exposed_a2a.py's accounting, no timing run: the ep all-to-alls split into
forward (counts, dispatch, combine) and backward ('_grad'), per step; the step rows' exposed
share and its split into the exchanges' own cost (part 1's layer times the stage's MoE layers
and micro-batches) and waiting for late ranks."""

from __future__ import annotations

import pytest

from tests.bench_import import load_benchmark


def test_ep_times_split_forward_and_backward() -> None:
    bench = load_benchmark("moe_exposed_a2a.py", "bench_moe_exposed_a2a")
    snap = {"ep/all_to_all/moe_counts": {"waited_s": 0.2, "calls": 2},
            "ep/all_to_all/moe_dispatch": {"waited_s": 1.0, "calls": 2},
            "ep/all_to_all/moe_combine_grad": {"waited_s": 3.0, "calls": 2},
            "dp/all_reduce/grads": {"waited_s": 7.0, "calls": 1}}
    got = bench.ep_times(snap, 2)
    assert got == pytest.approx({"a2a_fwd_s": 0.6, "a2a_bwd_s": 1.5, "a2a_calls": 3.0})


def test_model_rows_share_own_and_late() -> None:
    bench = load_benchmark("moe_exposed_a2a.py", "bench_moe_exposed_a2a")
    shape = bench.Shape(microbatches=4)
    rank = {"times": [0.1, 0.2, 0.3], "a2a_fwd_s": 0.03, "a2a_bwd_s": 0.01, "a2a_calls": 10}
    runs = {"ep2-pp2": [rank] * 8}  # 2 rounds of 4 ranks
    layer = {"a2a_fwd_s": 0.002, "a2a_bwd_s": 0.001}
    (row,) = bench.model_rows(runs, {2: layer}, shape)
    assert row["step_s"] == pytest.approx(0.2)
    assert row["share"] == pytest.approx(0.04 / 0.2)
    assert row["own_s"] == pytest.approx(0.003 * 1 * 4)  # 2 layers / pp 2, 4 micro-batches
    assert row["late_s"] == pytest.approx(0.04 - 0.012)
