"""Narayanan et al. 2021 Table 1: every row within 10% with one efficiency; ranking checks."""

from __future__ import annotations

import dataclasses

import pytest

from colonnade.analysis.fit import MEGATRON_2021, fit_efficiency, predict_row, relative_errors
from colonnade.analysis.hardware import A100_EFFICIENCY, PRESETS
from colonnade.analysis.published import TABLE1
from colonnade.analysis.search import Constraints, explain, plan
from colonnade.config.sections import Config
from colonnade.config.validate import problems

A100 = PRESETS["a100-80gb"]


def test_every_row_within_10_percent_with_one_constant() -> None:
    errors = relative_errors(A100)
    for row, err in zip(TABLE1, errors, strict=True):
        assert abs(err) < 0.10, f"{row.params_b}B: predicted/published - 1 = {err:+.3f}"
    assert max(abs(e) for e in errors) < 0.06  # the fit is in fact much tighter than 10%


def test_efficiency_is_the_minimax_fit() -> None:
    """The stored A100 efficiency is what the documented fit returns (and it is sharp)."""
    assert fit_efficiency(A100) == pytest.approx(A100_EFFICIENCY, abs=0.005)
    worse = dataclasses.replace(A100, efficiency=A100_EFFICIENCY * 1.1)
    assert max(abs(e) for e in relative_errors(worse)) > 0.10


def test_aggregate_pflops_follow() -> None:
    for row in TABLE1:
        est = predict_row(row, A100)
        assert est.layout.world == row.gpus
        agg = est.tflops_per_device * row.gpus / 1e3
        assert agg == pytest.approx(row.aggregate_pflops, rel=0.10)


ALL_FEATURE_ROWS = tuple(r for r in TABLE1 if r.params_b in (1.7, 3.6, 7.5, 18.4, 76.1, 529.6))
"""The rows searched with every feature: from 32 to 2520 GPUs, tops with and without pp, vp,
sp, ZB-V, interleaving and selective recompute, each faster than published with a reason.
The other four (39.1B, 145.6B, 310.1B, 1T) took ~80% of this test's time through the same
code; the 2021 feature set still searches every row."""


@pytest.mark.parametrize("features", ["megatron-2021", "all"])
def test_first_ranked_layout_vs_published(features: str) -> None:
    """The top layout is within 5% of the published one (its best micro-batch and vp), or
    faster with a reason shown; searched with the 2021 system's features (every row) or with
    all (:data:`ALL_FEATURE_ROWS`)."""
    extra = MEGATRON_2021 if features == "megatron-2021" else {}
    assert len(ALL_FEATURE_ROWS) == 6
    for row in TABLE1 if features == "megatron-2021" else ALL_FEATURE_ROWS:
        w = row.workload()
        result = plan(w, A100, row.gpus, Constraints(**extra))
        ref = predict_row(row, A100)
        best = result.best
        assert any(e.layout == ref.layout for e in result.ranked)
        assert best.step_s <= ref.step_s
        if best.step_s < ref.step_s / 1.05:
            reason = explain(best, ref)
            print(f"{row.params_b}B: {best.layout.short()} vs published "
                  f"{ref.layout.short()}: {reason}")
            assert "changed nothing" not in reason and "s ->" in reason
        cfg = best.layout.to_config(Config(), w)
        assert problems(cfg, row.gpus) == [], best.layout
