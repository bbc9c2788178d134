"""The ZB-V rows of the pipeline benchmarks (benchmarks/pipeline_train.py, pipeline.py,
peer_table.py, profile_step.py), no training run: Colonnade's zbv chunks hold exactly the layers
of torch's ZBV cuts on the same rank (so both sides start from the same weights), one torch ZBV
variant is the peer of both the ZB-H1 and the ZB-V row (ratios computed from the same timings)
and torch's ZB1P a second peer of ZB-H1,
zbv's bubble theory is its simulated schedule (unit stages, pp 2, m 4: makespan 12.5, bubble
0.04 against ZB-H1's 1/13), and the peer table places "pp2 ZB-V" after "pp2 ZB-H1" with no
issue-19 ratio."""

from __future__ import annotations

import statistics
from types import ModuleType
from typing import Any

import pytest

from colonnade.models.stages import stage_chunks
from colonnade.pipeline.checker import check_schedule
from colonnade.pipeline.schedules import build_schedule
from colonnade.pipeline.simulate import simulate
from tests.bench_import import load_benchmark


def _bench(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported as ``bench_<name>`` (not the tests.pipeline package)."""
    return load_benchmark(f"{name}.py", f"bench_{name}")


@pytest.mark.parametrize("workload", ["gpt2-tiny", "llama-tiny"])
def test_zbv_chunks_are_torch_zbv_cuts(workload: str) -> None:
    """Per rank, Colonnade's zbv chunks (layers, embedding, head) = torch's ZBV stages' cuts."""
    pt = _bench("pipeline_train")
    w = pt.WORKLOADS[workload]
    cls_name, per_rank, layout = pt.SCHEDULES["zbv"]
    assert (cls_name, per_rank, layout) == ("ScheduleZBVZeroBubble", 2, "pp2 ZB-V")
    count, size = pt.PP * per_rank, w.layers // (pt.PP * per_rank)
    for rank in range(pt.PP):
        ours = stage_chunks(w.layers, pt.PP, pt.COLONNADE_VP["zbv"], rank, placement="v")
        theirs = [(list(range(v * size, (v + 1) * size)), v == 0, v == count - 1)
                  for v in pt.stage_ids(cls_name, rank, per_rank)]
        assert ours == theirs
    assert pt.stage_ids(cls_name, 0, 2) == [0, 3] and pt.stage_ids(cls_name, 1, 2) == [1, 2]
    cfg = pt.colonnade_config(w, w.global_batch // pt.MICROBATCHES, pt.PP,
                              ["--parallel.pp=2", "--parallel.vp=2", "--parallel.schedule=zbv"])
    assert (cfg.parallel.schedule, cfg.parallel.vp, cfg.parallel.pp) == ("zbv", 2, 2)


def _runs(step_s: list[float], cpu_s: list[float]) -> list[dict[str, float]]:
    return [{"t0": 0.0, "t1": s, "cpu": c} for s, c in zip(step_s, cpu_s, strict=True)]


def test_zbv_row_shares_the_torch_zbv_timings() -> None:
    """Both ZB rows divide the one torch ZBV variant's per-round times (2 ranks, 3 rounds);
    ZB-H1 has a second row against torch's ZB1P (its own algorithm, one stage per rank)."""
    pt = _bench("pipeline_train")
    assert pt.peers("zbv")[0][:2] == pt.peers("zb_h1")[0][:2] == ("ScheduleZBVZeroBubble", 2)
    assert pt.peers("zb_h1")[1] == ("ScheduleInterleavedZeroBubble", 1, "pp2 ZB-H1 (torch ZB1P)")
    assert pt.stage_ids("ScheduleInterleavedZeroBubble", 1, 1) == [1]
    w = pt.WORKLOADS["gpt2-tiny"]
    spec = {"schedules": ["zb_h1", "zbv"], "steps": 1}
    times = {"colonnade/zb_h1": [2.0, 4.0, 1.0], "torch/ScheduleZBVZeroBubble": [1.0, 1.0, 1.0],
             "torch/ScheduleInterleavedZeroBubble": [4.0, 4.0, 4.0],
             "colonnade/zbv": [0.5, 1.0, 2.0]}
    ranks = [{"runs": {n: _runs(t, [x / 2 for x in t]) for n, t in times.items()},
              "first_loss": {n: [7.0, 6.9] for n in times}} for _ in range(2)]
    rows = pt.summarize(w, spec, ranks)["rows"]
    assert [r["layout"] for r in rows] == ["pp2 ZB-H1", "pp2 ZB-H1 (torch ZB1P)", "pp2 ZB-V"]
    zbv_peer = "torch.distributed.pipelining ScheduleZBVZeroBubble"
    assert rows[0]["peer"] == rows[2]["peer"] == zbv_peer
    assert rows[0]["ratio"] == pytest.approx(0.5)  # median of 1/2, 1/4, 1/1
    assert rows[1]["ratio"] == pytest.approx(2.0)  # median of 4/2, 4/4, 4/1
    assert rows[2]["ratio"] == pytest.approx(1.0)  # median of 2, 1, 1/2
    assert rows[2]["ratio_cpu"] == pytest.approx(1.0)
    assert rows[0]["peer_tokens_per_s"] == rows[2]["peer_tokens_per_s"] == w.tokens_per_step
    assert rows[2]["colonnade"] == pytest.approx(w.tokens_per_step / 1.0)


def test_zbv_loss_check_names_the_reference() -> None:
    pt = _bench("pipeline_train")
    pt._check_losses("colonnade/zbv", [7.0, 6.9], "colonnade/1f1b", [7.0 * (1 + 5e-6), 6.9])
    with pytest.raises(AssertionError, match=r"step-2 loss of torch/ScheduleZBVZeroBubble .* "
                                             r"colonnade/zbv's"):
        pt._check_losses("torch/ScheduleZBVZeroBubble", [7.0, 6.9], "colonnade/zbv",
                         [7.0, 6.9 * (1 + 2e-5)])


def test_zbv_bubble_theory_is_its_simulation() -> None:
    """Unit stages (chunk costs 1/2) at pp 2, m 4: zbv's makespan is 12.5 for 12 units of work
    per stage, bubble 0.5 / 12.5 = 0.04; ZB-H1's closed form gives 1/13 (makespan 13)."""
    pl = _bench("pipeline")
    assert pl.OURS["zbv"] == 2 and pl.TORCH["zbv"] == pl.TORCH["zb_h1"]
    half = {"F": 0.5, "B": 0.5, "W": 0.5}
    assert pl._formula("zbv", 2, 4, half) == pytest.approx(0.04, abs=1e-12)
    assert pl._simulated("zbv", 2, 4, [half, half]) == pytest.approx(0.04, abs=1e-12)
    assert pl._formula("zb_h1", 2, 4, {"F": 1.0, "B": 1.0, "W": 1.0}) == pytest.approx(1 / 13)
    sim = simulate(build_schedule("zbv", 4, 2, 8), 0.5, 0.5, 0.5, placement="v")
    assert sim.makespan == pytest.approx(25.5)
    assert pl._formula("zbv", 4, 8, half) == pytest.approx(
        statistics.mean(1 - b / 25.5 for b in sim.busy), abs=1e-12)


def _bubble_ranks(names: list[str]) -> list[dict[str, Any]]:
    """Fake bubble-mode rank results: every variant's step 1 s long, busy 0.9 s."""
    run = {"t0": 0.0, "t1": 1.0, "cpu": 2.0, "busy": 0.9, "recv_wait": 0.0,
           "mean": {"F": 0.1, "B": 0.1, "W": 0.1}, "peak_stashed": 1, "peak_pending_w": 1}
    return [{"stage": s, "runs": {n: [dict(run)] for n in names}} for s in range(2)]


def test_bubble_mode_compares_zbv_with_the_one_torch_zbv_run() -> None:
    pl = _bench("pipeline")
    names = ["colonnade/zb_h1", "torch/zb_h1", "colonnade/zbv"]
    args = {"pp": 2, "m": 4, "micro": 1, "seq": 8}
    rows = {r["impl"] + "/" + r["schedule"]: r for r in pl.summarise(args, _bubble_ranks(names))}
    assert rows["torch/zb_h1"]["torch_class"] == "ScheduleZBVZeroBubble"
    assert rows["colonnade/zbv"]["speedup_vs_torch"] == pytest.approx(1.0)
    report = check_schedule(build_schedule("zbv", 2, 2, 4), 2, 2, 4, placement="v")
    assert rows["colonnade/zbv"]["peak_stashed_checker"] == list(report.peak_in_flight) == [4, 4]
    assert rows["colonnade/zbv"]["bubble_measured"] == pytest.approx(0.1)


def test_peer_table_places_zbv_after_zb_h1() -> None:
    pt = _bench("peer_table")
    names = [name for name, _ in pt.LAYOUTS]
    h1 = names.index("pp2 ZB-H1")
    assert pt.LAYOUTS[h1 + 1] == ("pp2 ZB-H1 (torch ZB1P)", None)
    assert pt.LAYOUTS[h1 + 2] == ("pp2 ZB-V", None)
    assert pt.issue_key("pp2 ZB-V") == h1 + 2 and pt.issue_key("pp2 ZB-H1") == h1
    row = {"layout": "pp2 ZB-V", "colonnade": 1817.0, "peer": "torch ZBV",
           "peer_tokens_per_s": 2078.0, "ratio": 0.915, "ratio_cpu": 1.001, "issue_ratio": None}
    lines = pt.markdown([row], "gpt2-tiny").splitlines()
    assert lines[-1] == "| pp2 ZB-V | 1817 | torch ZBV 2078 | 0.92 | 1.00 | - |"
    assert lines[-2] == "| pp2 ZB-H1 | not run | - | - | - | 0.98 |"
    spread = {**row, "ratio_q1": 0.9, "ratio_q3": 0.951}  # benchmarks/ratios.ratio_stats's keys
    assert pt.markdown([spread], "gpt2-tiny").splitlines()[-1] == (
        "| pp2 ZB-V | 1817 | torch ZBV 2078 | 0.92 [0.90, 0.95] | 1.00 | - |")
    assert not any(line.startswith("| pp2 ZB-V") for line in pt.markdown([], "gpt2-tiny")
                   .splitlines())


def test_profile_step_zbv_layout_resolves() -> None:
    ps = _bench("profile_step")
    world, micro, extra = ps.LAYOUTS["pp2-zbv"]
    w = ps.WORKLOADS["gpt2-tiny"]
    cfg = ps._config(w, world, micro, extra)
    assert (world, micro) == (2, 4)
    assert (cfg.parallel.pp, cfg.parallel.vp, cfg.parallel.schedule) == (2, 2, "zbv")
    assert cfg.training.micro_batch_size * micro == w.global_batch


def test_zb_h1_row_carries_the_one_stage_bound() -> None:
    """Recorded action times (s) per rank replay every schedule; the ZB-H1 row against ZBV gets
    the one-stage bound, zbv's replay and their ratio; rows without recorded times get none."""
    pt = _bench("pipeline_train")
    w = pt.WORKLOADS["gpt2-tiny"]
    spec = {"schedules": ["zb_h1", "zbv"], "steps": 1}
    times = {"colonnade/zb_h1": [1.0], "torch/ScheduleZBVZeroBubble": [1.0],
             "torch/ScheduleInterleavedZeroBubble": [1.0], "colonnade/zbv": [1.0]}
    unit = {f"{k}{c}": 0.5e-3 for k in "FBW" for c in (0, 1)}  # half a stage per chunk
    zb = [{"F0": 1e-3, "B0": 0.0, "W0": 2e-3}, {"F0": 1e-3, "B0": 1e-3, "W0": 1e-3}]
    ranks = [{"stage": s, "runs": {n: _runs(t, t) for n, t in times.items()},
              "first_loss": {n: [7.0, 6.9] for n in times},
              "action_s": {"zb_h1": zb[s], "zbv": unit}} for s in (1, 0)]
    summary = pt.summarize(w, spec, ranks)
    sims = summary["replay"]
    assert sims["one_stage_bound_ms"] == pytest.approx(1.0 + 4 * 3.0)  # F of stage 0, stage 1
    assert sims["replay_ms"]["zb_h1"] == pytest.approx(13.0)
    assert sims["replay_ms"]["zbv"] == pytest.approx(12.5)  # unit stages: 12 + 0.5
    row = summary["rows"][0]
    assert row["layout"] == "pp2 ZB-H1" and row["bound_ratio"] == pytest.approx(12.5 / 13)
    assert "bound_ratio" not in summary["rows"][1] and "bound_ratio" not in summary["rows"][2]
    for r in ranks:
        del r["action_s"]
    assert pt.summarize(w, spec, ranks)["replay"] == {}


def test_peer_table_notes_the_one_stage_bound() -> None:
    pt = _bench("peer_table")
    row = {"layout": "pp2 ZB-H1", "colonnade": 5600.0, "peer": "torch ZBV",
           "peer_tokens_per_s": 5970.0, "ratio": 0.94, "ratio_cpu": 1.04, "issue_ratio": 0.98,
           "replay_ms": 334.1, "one_stage_bound_ms": 334.1, "zbv_replay_ms": 313.6,
           "bound_ratio": 313.6 / 334.1}
    lines = pt.markdown([row], "gpt2-tiny").splitlines()
    assert lines[-2] == ""
    assert lines[-1] == (
        "- pp2 ZB-H1: replayed with the measured action times, ZB-H1 computes a step's "
        "forward-backward in 334 ms, and no schedule with one stage per rank can take under "
        "334 ms; the V placement (zbv) takes 314 ms, so against ZBV a one-stage schedule "
        "reaches at most 0.94 at equal per-action work")
    assert pt.bound_notes([{k: v for k, v in row.items() if k != "bound_ratio"}]) == []
