"""pp = 1 is the degenerate pipeline: every step is one call into the executor.

With one stage and one chunk the executor runs 1f1b (F0 B0 F1 B1 ...: plain gradient
accumulation, no p2p) whatever ``parallel.schedule`` says, and gives bit for bit the losses and
gradients of a hand-written accumulation loop: backward of sum(CE over valid tokens) * dp / N per
micro-batch, N the valid tokens of the step.

ZB-V needs pp >= 2 (vp = 2 chunks per stage); its smallest pipelines, pp = 2 with m = 1, 2, 3
micro-batches (fewer than, equal to and more than the stages), run one step on gloo ranks and
give the single-process model's losses (on stage 0, which holds the head) and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.config.sections import Config, ModelConfig, TrainingConfig
from colonnade.config.validate import resolve, validate
from colonnade.data.synthetic import random_batches
from colonnade.models.build import build_chunks, build_reference
from colonnade.models.params import grad_of, unique_params
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline import executor
from colonnade.pipeline.actions import Kind
from colonnade.pipeline.checker import check_schedule
from colonnade.pipeline.plan import ExecOptions, StepPlan
from colonnade.pipeline.schedules import build_schedule
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX
from colonnade.training.step import forward_backward, forward_only
from tests.parity import TOL, rel_err
from tests.pipeline.test_parity import make_config, step_batches

SEQ, MICRO, M = 16, 2, 3


def _config() -> Config:
    model = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, vocab_size=64,
                        max_seq_len=SEQ)
    tr = TrainingConfig(steps=1, seq_len=SEQ, micro_batch_size=MICRO, microbatches=M,
                        precision="fp64", eval_interval=0)
    return validate(resolve(Config(model=model, training=tr), 1), 1)


def _batches(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = random_batches(cfg, seed=5)
    out[1][1][0, :5] = IGNORE_INDEX  # uneven valid counts: N != b * s * m
    return out


def _count_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    run = executor.StageExecutor.run

    def counted(self: executor.StageExecutor) -> Any:
        calls.append(self.pp)
        return run(self)

    monkeypatch.setattr(executor.StageExecutor, "run", counted)
    return calls


def test_pp1_step_is_one_executor_call_equal_to_plain_accumulation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config()
    batches = _batches(cfg)
    groups = ProcessGroups.single()
    model = build_reference(cfg, torch.float64)
    valid = sum(int((lab != IGNORE_INDEX).sum()) for _, lab in batches)
    assert valid == MICRO * SEQ * M - 5
    want_losses = []
    for tokens, labels in batches:  # the hand loop: sum CE / N per micro-batch, accumulated
        loss = model(tokens, labels, reduction="sum")
        (loss / valid).backward()
        want_losses.append(float(loss.detach()) / int((labels != IGNORE_INDEX).sum()))
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    calls = _count_runs(monkeypatch)
    losses = forward_backward([model], batches, StepPlan(groups, 0, schedule="gpipe"))
    assert calls == [1]
    assert losses == pytest.approx(want_losses, rel=1e-13)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, want[name]), name

    with torch.no_grad():
        evals = forward_only([model], batches, StepPlan(groups, 0))
    assert calls == [1, 1]
    assert evals == pytest.approx(want_losses, rel=1e-13)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_pp1_runs_the_degenerate_1f1b_whatever_the_schedule(schedule: str) -> None:
    cfg = _config()
    model = build_reference(cfg, torch.float64)
    plan = StepPlan(ProcessGroups.single(), 0, schedule=schedule,
                    options=ExecOptions(record=True))
    result = executor.execute([model], _batches(cfg), plan)
    order = [(t.action.kind, t.action.microbatch) for t in result.timeline]
    assert order == [(kind, k) for k in range(M) for kind in (Kind.F, Kind.B)]
    assert result.peak_stashed == 1 and result.peak_pending_w == 0
    assert len(result.losses) == M


def rank_zbv_step(m: int) -> dict[str, Any]:
    """One ZB-V step (pp = 2, float64, dropout): computes run, peaks, losses, gradients."""
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(pp=2))
    cfg = make_config(pp=2, vp=2, schedule="zbv", m=m, arch="gpt2")
    chunks = build_chunks(cfg, groups)
    res = executor.execute(chunks, step_batches(cfg, 0), StepPlan(groups, 0, "zbv"),
                           options=ExecOptions(record=True))
    return {"stage": groups.pp_rank, "computes": [str(t.action) for t in res.timeline],
            "peaks": (res.peak_stashed, res.peak_pending_w), "losses": res.losses,
            "grads": {p.sharding.key: grad_of(p).clone() for p in unique_params(chunks)}}


@pytest.mark.parametrize("m", [1, 2, 3])
def test_zbv_smallest_pipelines_match_the_reference(run_ranks: Callable[..., list[Any]],
                                                    m: int) -> None:
    cfg = make_config(pp=2, vp=2, schedule="zbv", m=m, arch="gpt2")
    lists = build_schedule("zbv", 2, 2, m)
    report = check_schedule(lists, 2, 2, m, placement="v")
    ref = build_reference(cfg, torch.float64)
    ref_losses = forward_backward([ref], step_batches(cfg, 0), StepPlan(ProcessGroups.single(), 0))
    want = {p.sharding.key: grad_of(p) for p in unique_params([ref])}
    seen: set[str] = set()
    for r in run_ranks(2, rank_zbv_step, m):
        s = r["stage"]
        assert r["computes"] == [str(a) for a in lists[s] if a.is_compute]
        assert r["peaks"] == (report.peak_in_flight[s], report.peak_pending_w[s])
        assert len(r["computes"]) == 6 * m  # F, B, W of both chunks per micro-batch
        if s == 0:
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-12)
        else:
            assert r["losses"] == []
        for key, g in r["grads"].items():
            assert rel_err(g, want[key], 1e-6) <= TOL, (s, key)
            seen.add(key)
    assert seen == set(want)
