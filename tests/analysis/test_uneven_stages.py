"""Uneven pipeline stages in the planner: memory and time per stage use each stage's own
layer count (parallel.pipeline_layout), the search splits layers that pp x vp does not divide
(DeepSeek-V3's 61) with lighter embedding and head stages, and a planned layout is a config
the validator accepts."""

from __future__ import annotations

import dataclasses

import pytest

from colonnade.analysis.hardware import PRESETS
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import memory_per_device, stage_memory, stage_params
from colonnade.analysis.search import Constraints, pipeline_layouts, plan
from colonnade.analysis.timing import _stage_costs, step_time
from colonnade.config.load import load_config
from colonnade.config.validate import problems, resolve
from colonnade.models.counts import LayerShape, layer_params

H100 = PRESETS["h100-sxm"]


def _workload(preset: str, **model: object) -> Workload:
    cfg = load_config(f"configs/{preset}.toml")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
    return Workload.from_config(cfg)


@pytest.mark.parametrize(("layers", "pp", "vp", "placement"), [
    (61, 8, 1, "loop"), (61, 16, 2, "v"), (28, 8, 1, "loop"), (30, 4, 2, "loop")])
def test_search_splits_lighten_the_ends(layers: int, pp: int, vp: int, placement: str) -> None:
    """Every split sums to the layers, has pp x vp entries, and no stage holding the
    embedding or the head holds more than the fullest other stage."""
    found = pipeline_layouts(layers, pp, vp, placement)
    assert found and None not in found
    for lay in found:
        assert lay is not None and len(lay) == pp * vp and sum(lay) == layers
        held = Layout(pp=pp, vp=vp, schedule="zbv" if placement == "v" else "1f1b",
                      pipeline_layout=lay).stage_layers(layers)
        ends = {0, pp - 1} if placement == "loop" else {0}
        counts = [len(h) for h in held]
        assert max(counts[j] for j in ends) <= max(counts), counts
        assert max(counts) - min(counts[j] for j in range(pp) if j not in ends) <= 1, counts
    assert pipeline_layouts(32, 4, 1) == [None]  # divisible: the even split only
    assert len(pipeline_layouts(32, 4, 1, uneven=True)) > 1


def test_memory_and_time_per_stage_use_the_layer_counts() -> None:
    """llama3-8b at pp4: moving 2 layers from the last stage to the middle ones changes each
    stage's parameters by exactly its layers' and its compute in proportion; the fullest
    middle stage becomes the memory bound's candidate."""
    w = _workload("llama3-8b")
    m: LayerShape = w.shape
    even = Layout(pp=4, dp=8, tp=1, micro_batch=1)
    uneven = dataclasses.replace(even, pipeline_layout=(8, 9, 9, 6))
    per_layer = layer_params(m)
    assert stage_params(m, uneven, "last") == pytest.approx(
        stage_params(m, even, "last") - 2 * per_layer)
    assert stage_params(m, uneven, "first") == stage_params(m, even, "first")
    assert stage_params(m, uneven, "middle") == pytest.approx(
        stage_params(m, even, "middle") + per_layer)
    fwd = [_stage_costs(w, uneven, H100, uneven.stage_kind(j), j).fwd for j in range(4)]
    base = [_stage_costs(w, even, H100, even.stage_kind(j), j).fwd for j in range(4)]
    one = base[1] / 8  # a middle stage holds layers only
    assert fwd[1] == pytest.approx(9 * one) and fwd[2] == pytest.approx(9 * one)
    assert fwd[3] == pytest.approx(base[3] - 2 * one)
    mid = stage_memory(w, uneven, "middle")
    assert mid.params == pytest.approx(stage_params(m, uneven, "middle") * 2)  # bf16
    assert memory_per_device(w, uneven).total >= mid.total
    # the head stage is the heavy one: lightening it shortens the step
    assert step_time(w, uneven, H100).total < step_time(w, even, H100).total


def test_plan_places_deepseek_v3_with_pp() -> None:
    """DeepSeek-V3 (61 layers) on 1024 H100s at pp 8: planned with uneven stages whose fullest
    stages are middle ones, a config the validator accepts (before: pp had to divide 61)."""
    w = _workload("deepseek-v3")
    cons = Constraints(pp=8, tp=4, ep=(16,), sp=(True,), recompute=("none", "full"),
                       zero=(1,), schedules=("1f1b", "zb_h1"), micro_batch=1)
    best = plan(w, H100, 1024, cons).best
    lay = best.layout
    assert lay.pipeline_layout is not None and sum(lay.pipeline_layout) == 61
    counts = [len(h) for h in lay.stage_layers(61)]
    assert counts[0] < max(counts) and counts[-1] < max(counts), counts
    cfg = resolve(lay.to_config(load_config("configs/deepseek-v3.toml"), w), lay.world)
    assert problems(cfg, lay.world) == []
    assert f"--parallel.pipeline_layout={','.join(map(str, lay.pipeline_layout))}" in \
        lay.overrides()
    assert Layout.from_config(cfg, lay.world) == lay
    assert best.memory.total <= H100.memory_bytes and best.step_s > 0
