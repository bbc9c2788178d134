"""Issue 17's benchmark maths (benchmarks/moe.py), no timing run: the plain loop-over-experts
peer equals colonnade's MoE layer in float64; the dense-equivalent model has the MoE layer's
active FLOPs but the router's; DeepSpeed's capacity setting is dropless (t slots per expert);
the summary's per-round medians and ratios."""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType

import pytest
import torch

from colonnade.analysis.moe import MoEShape, mlp_forward_flops_per_token
from colonnade.config.load import load_config
from colonnade.config.validate import resolve, validate
from colonnade.models.build import build_chunks
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from tests.bench_import import load_benchmark

NAME = "bench_moe"


def _bench() -> ModuleType:
    """benchmarks/moe.py (see :func:`tests.bench_import.load_benchmark`)."""
    return load_benchmark("moe.py", NAME)


def test_plain_peer_equals_colonnade_layer() -> None:
    """plain_moe on the layer's own weights = MoELayer's output, float64 (ep 1)."""
    bench = _bench()
    shape = bench.QUICK
    w = shape.workload(layers=1)
    cfg = bench.colonnade_config(w, shape.batch, 1, bench.moe_overrides(shape, 1, "all_to_all"))
    (chunk,) = build_chunks(cfg, ProcessGroups.build(ParallelDims()))
    assert bench.plain_check(bench._moe_layer(chunk), shape) < 1e-12


def test_dense_equivalent_has_the_active_flops() -> None:
    """Dense-equivalent MLP width k f_e: its FLOPs = the MoE MLP's minus the router's 2 E h,
    and the analysis module agrees on both."""
    bench = _bench()
    shape = bench.Shape()
    moe, dense = bench.dense_equivalent_flops(shape)
    assert moe - dense == 2 * shape.experts * shape.hidden
    overrides = shape.workload().overrides(shape.batch)
    cfg = validate(resolve(load_config(None, [*overrides, *bench.moe_overrides(
        shape, 1, "all_to_all")]), 1), 1)
    assert mlp_forward_flops_per_token(MoEShape.of(cfg.model))[0] == moe
    dense_cfg = dataclasses.replace(cfg.model, num_experts=0,
                                    ffn_hidden_size=shape.top_k * shape.expert_ffn)
    assert mlp_forward_flops_per_token(MoEShape.of(dense_cfg))[1] == dense


@pytest.mark.parametrize("tokens,experts,k", [(512, 8, 2), (32, 4, 2), (100, 6, 1)])
def test_deepspeed_capacity_is_dropless(tokens: int, experts: int, k: int) -> None:
    """Capacity factor E/k makes DeepSpeed's ceil(t / E x factor x k) = t slots per expert."""
    bench = _bench()
    factor = bench.deepspeed_capacity_factor(bench.Shape(experts=experts, top_k=k))
    assert math.ceil(tokens / experts * factor * k) == tokens


def test_summary_medians_and_ratios() -> None:
    """Rounds of 2 ranks: the round median over the ranks' times, ratios per round."""
    bench = _bench()
    runs = {"a": [{"times": [1.0, 3.0]}, {"times": [2.0]}, {"times": [4.0]}, {"times": [6.0]}],
            "b": [{"times": [1.0]}, {"times": [1.0]}, {"times": [2.0]}, {"times": [2.0]}],
            "c": [{"error": "no"}]}
    assert bench.round_medians(runs["a"], 2) == [2.0, 5.0]
    rows = {r["name"]: r for r in bench.summarize(runs, {"a": 2, "b": 2, "c": 1}, "b")}
    assert rows["a"]["median_s"] == 3.5
    assert rows["a"]["vs_b"]["ratio"] == pytest.approx(2.25)  # median of 2/1 and 5/2
    assert rows["c"]["error"] == "no"
    assert torch.isfinite(torch.tensor(rows["b"]["vs_b"]["ratio"]))
