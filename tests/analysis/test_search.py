"""Enumeration, ranking, bad-input messages and the time model's pieces."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from colonnade.analysis.hardware import PRESETS, cluster_from_toml, get_cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import memory_per_device
from colonnade.analysis.search import Constraints, PlanError, layouts, plan
from colonnade.analysis.timing import _pipeline, _Stage, step_time
from colonnade.config.load import load_config
from colonnade.config.sections import Config, ModelConfig
from colonnade.config.validate import problems

A100 = PRESETS["a100-80gb"]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _llama7b() -> Workload:
    return Workload.from_config(load_config(CONFIGS / "llama2-7b.toml"))


def test_every_enumerated_layout_passes_colonnade_validation() -> None:
    w = Workload(model=ModelConfig(num_layers=8, hidden_size=64, num_heads=4, num_kv_heads=2),
                 seq_len=64, global_batch=16)
    seen = list(layouts(w, 8, A100, Constraints()))
    assert len(seen) > 100
    for lay in seen:
        assert problems(lay.to_config(Config(), w), 8) == [], lay
    tps = {lay.tp for lay in seen}
    assert tps == {1, 2}  # kv heads 2 bound tp
    assert all(lay.world == 8 for lay in seen)
    assert any(lay.schedule == "interleaved_1f1b" and lay.vp == 4 for lay in seen)


def test_fixed_degrees_are_respected() -> None:
    result = plan(_llama7b(), A100, 64, Constraints(tp=2, pp=2, recompute=("full",)))
    assert {(e.layout.tp, e.layout.pp, e.layout.dp) for e in result.ranked} == {(2, 2, 16)}
    assert {e.layout.recompute for e in result.ranked} == {"full"}
    times = [e.step_s for e in result.ranked]
    assert times == sorted(times)


def test_model_that_fits_nowhere() -> None:
    w = Workload.from_config(load_config(CONFIGS / "gpt3-175b.toml"))
    with pytest.raises(PlanError) as err:
        plan(w, A100, 8)
    msg = str(err.value)
    assert "fits on no layout of 8 x a100-80gb" in msg
    assert "174.60B parameters" in msg and "at least 64 GPUs" in msg
    # and the suggestion is right: a layout of 64 fits (plan's test, without timing them all)
    assert any(memory_per_device(w, lay).total <= A100.memory_bytes
               for lay in layouts(w, 64, A100, Constraints()))


def test_gpu_count_not_factorable() -> None:
    """37 GPUs: tp 1 (37 is prime), pp 37 > 32 layers, dp 37 does not divide 1024. (13 GPUs
    plan now: no pp searched divides the 32 layers, so pp 13 gets uneven stages.)"""
    with pytest.raises(PlanError) as err:
        plan(_llama7b(), A100, 37)
    msg = str(err.value)
    assert "37 GPUs cannot be factored as tp x pp x dp" in msg
    assert "pp must divide layers=32 (or be <= them with uneven stages" in msg
    assert "global batch 1024" in msg and "36" in msg.split("work:")[1]


def test_gpu_counts_suggested_beyond_16_away() -> None:
    """1001 GPUs for GPT-3 175B at global batch 1536 (1001 = 7 x 11 x 13): no count within
    +-16 factors, so the search reaches further (up to a quarter of the count) and names the
    four nearest that do, each of which plans. (pp 7, 11, 13 would need uneven stages of the
    96 layers, but no dp = 1001 / pp divides 1536.)"""
    gpt3 = Workload.from_config(load_config(CONFIGS / "gpt3-175b.toml"))
    w = dataclasses.replace(gpt3, global_batch=1536)
    with pytest.raises(PlanError) as err:
        plan(w, A100, 1001)
    counts = [int(n) for n in str(err.value).split("work: ")[1].rstrip(".").split(", ")]
    assert counts == [768, 864, 1024, 1152]
    for n in counts:
        assert any(True for _ in layouts(w, n, A100, Constraints()))


def test_bad_workloads_name_the_field() -> None:
    w = dataclasses.replace(_llama7b(), seq_len=8192)
    with pytest.raises(PlanError, match="max_seq_len=4096"):
        plan(w, A100, 8)
    with pytest.raises(ValueError, match="unknown cluster 'tpu'"):
        get_cluster("tpu")
    with pytest.raises(ValueError, match="precision"):
        dataclasses.replace(_llama7b(), precision="int8")


def test_bubble_fractions() -> None:
    """Equal stages: 1F1B (p-1)/m, interleaved (p-1)/(v m), ZB-H1 (p-1)(T_F + T_B - T_W)."""
    st = _Stage(fwd=1.0, bwd=2.0, wgrad=1.0, comm=0.0)
    steady, bubble, _ = _pipeline(Layout(pp=4), 16, [st] * 4)
    assert bubble / steady == pytest.approx(3 / 16)
    steady, bubble, _ = _pipeline(Layout(pp=4, vp=3, schedule="interleaved_1f1b"), 16, [st] * 4)
    assert bubble / steady == pytest.approx(3 / (3 * 16))
    _, zb, _ = _pipeline(Layout(pp=4, schedule="zb_h1"), 16, [st] * 4)
    assert zb == pytest.approx(3 * (1.0 + 1.0 - 1.0))


def test_bubble_of_unequal_stages_is_the_other_stages_fill_and_drain() -> None:
    """The slowest stage (the head's) sets the steady state; the first micro-batch's forward
    reaches it through the others and the last backward drains through them."""
    cheap, slow = _Stage(1.0, 2.0, 1.0, 0.0), _Stage(2.0, 4.0, 2.0, 0.5)
    steady, bubble, comm = _pipeline(Layout(pp=3), 8, [cheap, cheap, slow])
    assert (steady, bubble, comm) == (8 * 6.0, 2 * 3.0, 8 * 0.5)
    _, bubble, _ = _pipeline(Layout(pp=3, vp=2, schedule="interleaved_1f1b"), 8,
                             [cheap, cheap, slow])
    assert bubble == pytest.approx(2 * 3.0 / 2)


def test_collective_formulas() -> None:
    """Ring all-reduce 2(n-1)/n S/W; across nodes k NICs of 25 GB/s per group."""
    s = 1e9
    assert A100.all_reduce_s(s, 8, 8) == pytest.approx(2 * 7 / 8 * s / 300e9 + 14 * 5e-6)
    assert A100.all_reduce_s(s, 32, 1) == pytest.approx(2 * 31 / 32 * s / 25e9 + 62 * 10e-6)
    assert A100.all_reduce_s(s, 32, 8) == pytest.approx(2 * 31 / 32 * s / 200e9 + 62 * 10e-6)
    assert A100.gather_s(s, 4, 4) == pytest.approx(3 / 4 * s / 300e9 + 3 * 5e-6)


def test_tp_comm_volume_is_8bsh_per_layer() -> None:
    """tp comm per layer per micro-batch: 8 b s h (t-1)/t elements x E bytes, no recompute."""
    w = Workload(model=ModelConfig(arch="gpt2", num_layers=4, hidden_size=1024, num_heads=8,
                                   vocab_size=1024, max_seq_len=512), seq_len=512,
                 global_batch=2)
    fast = dataclasses.replace(A100, intra_latency_us=0.0)
    lay = Layout(tp=4, micro_batch=1)
    t = step_time(w, lay, fast)
    per_layer = 8 * 512 * 1024 * 3 / 4 * 2 / 300e9
    # 4 layers, 2 micro-batches, + embedding fwd and head bwd all-reduces (2 x 2(t-1)/t bsh E)
    extra = 2 * (2 * 2 * 512 * 1024 * 3 / 4 * 2 / 300e9)
    # + vocab-parallel CE's 2 fp32 all-reduces ([b s] max, [2, b s] sums) per micro-batch
    extra += 2 * (2 * 3 / 4 * 512 * (4 + 8) / 300e9)
    assert t.tp_comm == pytest.approx(4 * 2 * per_layer + extra, rel=1e-9)
    full = step_time(w, dataclasses.replace(lay, recompute="full"), fast)
    assert full.tp_comm == pytest.approx(4 * 2 * per_layer * 1.5 + extra, rel=1e-9)


def test_zero1_and_overlap_reduce_exposed_dp_time() -> None:
    w = _llama7b()
    lay = Layout(tp=1, pp=1, dp=64, micro_batch=1, recompute="full")
    plain = step_time(dataclasses.replace(w, overlap_grad_reduce=False), lay, A100)
    overlapped = step_time(w, lay, A100)
    assert overlapped.dp_comm < plain.dp_comm
    n = 6_738_415_616
    ring = 2 * 63 / 64 * n * 4 / 200e9 + 126 * 10e-6
    assert plain.dp_comm == pytest.approx(ring, rel=1e-6)


def test_cluster_files_override_a_preset(tmp_path) -> None:
    small = get_cluster("a100-40gb")  # configs/clusters/a100-40gb.toml, base a100-80gb
    assert (small.memory_gib, small.peak_tflops, small.gpus_per_node) == (40.0, 312.0, 8)
    path = tmp_path / "mine.toml"
    path.write_text('[cluster]\nbase = "h100"\nname = "mine"\ngpus_per_node = 4\n')
    mine = get_cluster(str(path))
    assert (mine.name, mine.gpus_per_node, mine.peak_tflops) == ("mine", 4, 989.0)
    path.write_text('[cluster]\nbase = "h100"\nflops = 1\n')
    with pytest.raises(ValueError, match="unknown field"):
        get_cluster(str(path))
    assert get_cluster("dgx-a100") is PRESETS["a100-80gb"]
    stored = cluster_from_toml(Path(__file__).parents[2] / "configs/clusters/cpu-local.toml")
    assert get_cluster("cpu") == stored != PRESETS["cpu-local"]  # the measured file wins
    assert stored.head_efficiency is not None and 0.05 <= stored.efficiency <= 1
