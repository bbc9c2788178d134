"""ZeRO stages 0-3 in the memory model, the time model, the planner, Layout and --dry-run.

Derived values (colonnade/analysis/memory.py's docstring) for a 1e9-parameter model at dp 8:
bf16 18 / 7.5 / 4 / 2.25 GB per stage (weights 2, fp32 main grads 4, fp32 master + m + v 12),
fp32 16 / 9 / 5.5 / 2 GB (the parameters are their own masters: Adam m, v only, 8), and the
ZeRO paper's accounting 16 / 5.5 / 3.75 / 2 GB (fp16 gradients).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from colonnade.analysis.cli import main
from colonnade.analysis.dry_run import memory_lines
from colonnade.analysis.hardware import GIB, get_cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import (
    GRAD_BUCKETS_IN_FLIGHT,
    bucket_elements,
    memory_per_device,
    model_state_bytes,
    stage_params,
    state_bytes_per_param,
    zero_buffer_bytes,
    zero_paper_bytes,
)
from colonnade.analysis.search import Constraints, PlanError, layouts, plan
from colonnade.analysis.timing import step_time
from colonnade.config.load import load_config
from colonnade.config.validate import problems

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PSI = 1e9


def _llama7b(**kw: object) -> Workload:
    w = Workload.from_config(load_config(CONFIGS / "llama2-7b.toml"))
    return dataclasses.replace(w, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("precision", "want"), [
    ("bf16", {0: 18e9, 1: 7.5e9, 2: 4e9, 3: 2.25e9}),
    ("fp32", {0: 16e9, 1: 9e9, 2: 5.5e9, 3: 2e9}),
    ("fp64", {0: 32e9, 1: 18e9, 2: 11e9, 3: 4e9}),
])
def test_model_state_bytes_1e9_params_dp8(precision: str, want: dict[int, float]) -> None:
    for stage, nbytes in want.items():
        assert model_state_bytes(PSI, 8, stage, precision) == pytest.approx(nbytes, rel=1e-15)
    with pytest.raises(ValueError, match="stage"):
        model_state_bytes(PSI, 8, 4, precision)


def test_paper_accounting_and_colonnade_differ_by_the_fp32_gradients() -> None:
    """Paper 16 / 4 + 12/8 / 2 + 14/8 / 16/8 bytes per parameter; Colonnade's fp32 main
    gradients add 2 bytes unsharded (stages 0-1) and 2/dp once sharded (stages 2-3)."""
    paper = {s: zero_paper_bytes(PSI, 8, s) for s in range(4)}
    assert paper == pytest.approx({0: 16e9, 1: 5.5e9, 2: 3.75e9, 3: 2e9}, rel=1e-15)
    extra = {s: model_state_bytes(PSI, 8, s, "bf16") - paper[s] for s in range(4)}
    assert extra == pytest.approx({0: 2e9, 1: 2e9, 2: 0.25e9, 3: 0.25e9}, rel=1e-12)


def test_state_bytes_per_param_follow_the_layout() -> None:
    w = _llama7b()
    assert state_bytes_per_param(w, Layout(dp=8)) == (2, 4, 12)
    assert state_bytes_per_param(w, Layout(dp=8, zero=1)) == (2, 4, 1.5)
    assert state_bytes_per_param(w, Layout(dp=8, zero=2)) == (2, 0.5, 1.5)
    assert state_bytes_per_param(w, Layout(dp=8, zero=3)) == (0.25, 0.5, 1.5)
    hybrid = Layout(dp=8, zero=3, zero_shard_size=4)  # shard over 4, 2 replicas
    assert state_bytes_per_param(w, hybrid) == (0.5, 1.0, 3.0)
    w32 = dataclasses.replace(w, precision="fp32")
    assert state_bytes_per_param(w32, Layout(dp=4, zero=2)) == (4, 1, 2)
    with pytest.raises(ValueError, match="zero_shard_size=3 must divide dp=8"):
        Layout(dp=8, zero=3, zero_shard_size=3)
    with pytest.raises(ValueError, match="zero=4"):
        Layout(dp=8, zero=4)


def test_stage_buffers_in_memory_per_device() -> None:
    """Stage 2: 4 buckets x B x 4 bytes (fp32 reduce) or x 2 (bf16), 3 of them with their
    1/dp outputs; stage 3 adds (ceil(U/B) + 1 + prefetch) gathered buckets x B x 2 (U the
    largest module: a module straddles bucket boundaries), or every parameter without
    reshard."""
    w = _llama7b(bucket_size=40_000_000)
    lay = Layout(dp=8, zero=2)
    n = stage_params(w.shape, lay, "only")
    b = bucket_elements(w, lay, "only", n)
    assert b == 32000 * 4096  # the embedding: one parameter larger than bucket_size
    mem = memory_per_device(w, lay)
    assert mem.grad_buckets == 4 * b * 4 + 3 * b * 4 / 8
    assert GRAD_BUCKETS_IN_FLIGHT == 3
    assert mem.gathered == 0
    assert (mem.params, mem.grads, mem.optimizer) == pytest.approx((2 * n, n / 2, 1.5 * n))
    bf16 = dataclasses.replace(w, grad_reduce_dtype="bf16")
    assert memory_per_device(bf16, lay).grad_buckets == 4 * b * 2 + 3 * b * 2 / 8
    serial = dataclasses.replace(w, overlap_grad_reduce=False)  # every bucket, then 3 outputs
    assert memory_per_device(serial, lay).grad_buckets == n * 4 + 3 * b * 4 / 8
    s3 = memory_per_device(dataclasses.replace(w, zero_prefetch=2), Layout(dp=8, zero=3))
    # the MLP (3 x 4096 x 11008 > B) touches 3 buckets, + 2 prefetched
    assert b < 3 * 4096 * 11008
    assert s3.gathered == 5 * b * 2 and s3.params == pytest.approx(n / 4)
    kept = Layout(dp=8, zero=3, reshard_after_forward=False)
    assert zero_buffer_bytes(w, kept, "only", n)[1] == n * 2  # the whole model gathered
    # pp > 1: the micro-batch-window default keeps the chunk gathered
    piped = Layout(pp=2, dp=4, zero=3)
    assert not piped.reshard and Layout(dp=8, zero=3).reshard
    assert memory_per_device(w, piped).gathered == stage_params(
        w.shape, piped, memory_per_device(w, piped).stage) * 2
    small = dataclasses.replace(w, bucket_size=10**12)  # one bucket: capped at the model
    assert bucket_elements(small, lay, "only", n) == n
    assert memory_per_device(small, Layout(dp=8, zero=3)).gathered == n * 2
    assert memory_per_device(w, Layout(dp=8, zero=1)).grad_buckets == 0
    totals = [memory_per_device(w, Layout(dp=8, zero=z)).total for z in range(4)]
    assert totals == sorted(totals, reverse=True)


def test_dp_time_per_stage() -> None:
    """Full dp communication per step: stage 2 m reduce-scatters + one all-gather, stage 3
    2 m all-gathers + m reduce-scatters (one all-gather without reshard); no overlap."""
    c = get_cluster("a100-80gb")
    w = _llama7b(overlap_grad_reduce=False, overlap_param_gather=False, zero_prefetch=0,
                 global_batch=64)
    lay = Layout(dp=8, micro_batch=2, recompute="full")
    m = lay.microbatches(w.global_batch)
    n = stage_params(w.shape, lay, "only")
    rs = c.gather_s(n * 4, 8, 8, "reduce_scatter")
    ag = c.gather_s(n * 2, 8, 8, "all_gather")
    got = {z: step_time(w, dataclasses.replace(lay, zero=z), c).dp_comm for z in range(4)}
    assert got[0] == pytest.approx(c.all_reduce_s(n * 4, 8, 8), rel=1e-12)
    assert got[1] == pytest.approx(rs + ag, rel=1e-12)
    assert got[2] == pytest.approx(m * rs + ag, rel=1e-12)
    assert got[3] == pytest.approx(m * (2 * ag + rs), rel=1e-12)
    kept = dataclasses.replace(lay, zero=3, reshard_after_forward=False)
    assert step_time(w, kept, c).dp_comm == pytest.approx(ag + m * rs, rel=1e-12)
    bf16 = dataclasses.replace(w, grad_reduce_dtype="bf16")
    rs16 = c.gather_s(n * 2, 8, 8, "reduce_scatter")
    assert step_time(bf16, dataclasses.replace(lay, zero=2), c).dp_comm == pytest.approx(
        m * rs16 + ag, rel=1e-12)
    hybrid = dataclasses.replace(lay, zero=2, zero_shard_size=4)
    rs4, ag4 = c.gather_s(n * 4, 4, 4, "reduce_scatter"), c.gather_s(n * 2, 4, 4, "all_gather")
    rep = c.all_reduce_s(n * 4 / 4, 2, 2)
    assert step_time(w, hybrid, c).dp_comm == pytest.approx(m * rs4 + rep + ag4, rel=1e-12)


def test_planner_enumerates_and_ranks_stages() -> None:
    """dp 8 of a 7B model: stage 0 fits on no 80 GB layout, 1-3 do; on 40 GB only 2 and 3
    fit, and the ranking picks among them by step time; 'colonnade plan' flags select it."""
    w = _llama7b()
    a100, small = get_cluster("a100-80gb"), get_cluster("a100-40gb")
    seen = {lay.zero for lay in layouts(w, 8, a100, Constraints(tp=1, pp=1))}
    assert seen == {0, 1, 2, 3}
    assert {lay.zero for lay in layouts(w, 1, a100, Constraints())} == {0}  # dp 1
    result = plan(w, a100, 8, Constraints(tp=1, pp=1))
    assert {e.layout.zero for e in result.ranked} == {1, 2, 3}
    times = [e.step_s for e in result.ranked]
    assert times == sorted(times)
    with pytest.raises(PlanError, match="fits on no layout"):
        plan(w, small, 8, Constraints(tp=1, pp=1, zero=(0, 1)))
    tight = plan(w, small, 8, Constraints(tp=1, pp=1))
    assert {e.layout.zero for e in tight.ranked} == {2, 3}
    best = tight.best
    assert best.fits and f"--parallel.zero_stage={best.layout.zero}" in best.layout.overrides()
    both = plan(w, small, 8, Constraints(tp=1, pp=1, zero=(3,), reshard=(True, False)))
    assert {e.layout.reshard for e in both.ranked} <= {True, False}
    assert all(e.memory.gathered > 0 for e in both.ranked)


def test_layout_round_trips_through_a_valid_config() -> None:
    w = _llama7b(zero_prefetch=2, grad_reduce_dtype="bf16")
    base = load_config(CONFIGS / "llama2-7b.toml")
    for lay in (Layout(dp=8, zero=2), Layout(pp=2, dp=4, zero=3, reshard_after_forward=True),
                Layout(dp=8, zero=3, zero_shard_size=4), Layout(dp=8, zero=1)):
        cfg = lay.to_config(base, w)
        assert problems(cfg, 8) == [], lay
        assert cfg.parallel.zero == lay.zero
        assert Layout.from_config(cfg, 8) == lay
        assert Workload.from_config(cfg) == w
    flags = Layout(dp=8, zero=3, reshard_after_forward=False, zero_shard_size=2).overrides()
    assert {"--parallel.zero_stage=3", "--parallel.reshard_after_forward=false",
            "--parallel.zero_shard_size=2"} <= set(flags)
    assert Layout(dp=8, zero=3).short().endswith("zero3")
    assert Layout(pp=2, dp=4, zero=3).zero_label() == "3k"


def test_dry_run_shows_the_stage_terms() -> None:
    cfg = load_config(CONFIGS / "llama2-7b.toml", ["--parallel.zero_stage=3",
                                                    "--parallel.zero_prefetch=2"])
    lines = "\n".join(memory_lines(cfg, 8))
    assert ("ZeRO stage 3 over 8 rank(s): weights 0.25 + grads 0.5 + optimizer 1.5 = 2.25 "
            "bytes/parameter (ZeRO paper: 2); reshard_after_forward=true, prefetch 2") in lines
    mem = memory_per_device(Workload.from_config(cfg), Layout.from_config(cfg, 8))
    assert f"gathered     {mem.gathered / GIB:10.3f} GiB" in lines
    assert f"grad_buckets {mem.grad_buckets / GIB:10.3f} GiB" in lines
    plain = "\n".join(memory_lines(load_config(CONFIGS / "llama2-7b.toml"), 8))
    assert "ZeRO stage 0: weights 2 + grads 4 + optimizer 12 = 18 bytes/parameter" in plain
    assert "gathered" not in plain


def test_plan_cli_searches_the_requested_stages(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--model", "llama2-7b", "--gpus", "8", "--tp", "1", "--pp", "1", "--zero", "3",
               "--reshard", "any", "--top", "3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "--parallel.zero_stage=3" in out.splitlines()[-1]
    assert main(["--model", "llama2-7b", "--gpus", "8", "--zero", "1,5"]) == 2
    assert "--zero='1,5': use a comma list of 0, 1, 2, 3" in capsys.readouterr().err


def test_planner_hybrid_sharding_divides_by_the_shard_size() -> None:
    w = _llama7b()
    a100 = get_cluster("a100-80gb")
    hybrid = plan(w, a100, 8, Constraints(tp=1, pp=1, zero=(3,), zero_shard_size=4))
    assert {e.layout.zero_shard_size for e in hybrid.ranked} == {4}
    full = plan(w, a100, 8, Constraints(tp=1, pp=1, zero=(3,)))
    by_mb = {e.layout.micro_batch: e for e in full.ranked}
    for e in hybrid.ranked:
        n = stage_params(w.shape, e.layout, "only")
        assert e.memory.optimizer == pytest.approx(12 * n / 4)
        if e.layout.micro_batch in by_mb:
            assert e.memory.total > by_mb[e.layout.micro_batch].memory.total
    assert list(layouts(w, 2, a100, Constraints(tp=1, pp=1, zero=(1,), zero_shard_size=4))) == []
    assert list(layouts(w, 2, a100, Constraints(tp=1, pp=1, zero=(1,), zero_shard_size=2)))


def test_planned_stage_zero_overrides_a_stage_one_base() -> None:
    """A planned stage 0 stays stage 0 under a base config that says
    use_distributed_optimizer=true (the effective stage is the larger of the two)."""
    from colonnade.config.load import config_from_dict, parse_overrides
    from colonnade.config.sections import Config, ParallelConfig

    flags = Layout(dp=8, zero=0).overrides()
    base = Config(parallel=ParallelConfig(use_distributed_optimizer=True))
    assert config_from_dict(parse_overrides(flags), base).parallel.zero == 0
    assert config_from_dict(parse_overrides(flags[:1]), base).parallel.zero == 1  # the bug
