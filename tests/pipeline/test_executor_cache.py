"""The executor's per-step host work: schedules and stage programs are cached data, and
pp = 1 runs a plain accumulation loop that makes no p2p objects and gives bit for bit the
results of the general action loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from colonnade.config.sections import Config, ModelConfig, TrainingConfig
from colonnade.config.validate import resolve, validate
from colonnade.data.synthetic import random_batches
from colonnade.models.build import build_reference, make_context
from colonnade.models.gpt import ModelChunk
from colonnade.parallel.comm import CommGroup
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline import executor, p2p
from colonnade.pipeline.actions import Kind
from colonnade.pipeline.plan import ExecOptions, StepPlan
from colonnade.pipeline.schedules import build_schedule, schedule_lists
from colonnade.pipeline.split_backward import (
    backward_input,
    backward_weight,
    find_boundaries,
    grad_accumulators,
)
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX
from colonnade.training.step import forward_backward, forward_only

SEQ, MICRO, M = 16, 2, 3


def _config(arch: str = "gpt2") -> Config:
    model = ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_heads=4, vocab_size=64,
                        max_seq_len=SEQ, hidden_dropout=0.1)
    tr = TrainingConfig(steps=1, seq_len=SEQ, micro_batch_size=MICRO, microbatches=M,
                        precision="fp64", eval_interval=0)
    return validate(resolve(Config(model=model, training=tr), 1), 1)


def _batches(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = random_batches(cfg, seed=3)
    out[2][1][1, :4] = IGNORE_INDEX  # uneven valid counts
    return out


def test_schedule_and_stage_steps_are_cached_immutable_data() -> None:
    lists = schedule_lists("interleaved_1f1b", 2, 2, 4)
    assert lists is schedule_lists("interleaved_1f1b", 2, 2, 4)
    assert isinstance(lists, tuple) and all(isinstance(s, tuple) for s in lists)
    fresh = build_schedule("interleaved_1f1b", 2, 2, 4)  # an editable copy, equal content
    assert fresh == [list(s) for s in lists] and fresh[0] is not lists[0]
    fresh[0].pop()
    assert len(schedule_lists("interleaved_1f1b", 2, 2, 4)[0]) == len(fresh[0]) + 1

    args = ("zb_h1", 2, 1, 4, 1, True, True)
    steps = executor.stage_steps(*args)
    assert steps is executor.stage_steps(*args)
    assert steps is not executor.stage_steps("zb_h1", 2, 1, 4, 1, False, True)  # overlap in key
    assert steps.program is p2p.stage_program(schedule_lists("zb_h1", 2, 1, 4), 1, True)
    assert steps.splits_w and steps.has_p2p and not steps.accumulate
    assert [str(a) for a in steps.computes][:5] == ["F0c0", "B0c0", "F1c0", "B1c0", "W0c0"]
    assert [None if m is None else (m.direction, m.microbatch) for m in steps.inputs][:2] == [
        ("F", 0), None]  # stage 1 is last: F waits for an activation, B for nothing
    with pytest.raises(TypeError):
        steps.program.consumers[p2p.Message("F", 9, 0)] = 0  # type: ignore[index]

    one = executor.stage_steps("1f1b", 1, 1, M, 0, True, True)
    assert one.accumulate and not one.has_p2p and not one.splits_w
    assert all(not point for point in one.program.posts)
    evals = executor.stage_steps("1f1b", 1, 1, M, 0, True, False)
    assert not evals.accumulate and [a.kind for a in evals.computes] == [Kind.F] * M


def test_repeated_steps_hit_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config()
    model = build_reference(cfg, torch.float64)
    built: list[int] = []
    real = executor.build_stage_steps

    def counted(*args: Any, **kwargs: Any) -> executor.StageSteps:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(executor, "build_stage_steps", counted)
    executor.stage_steps.cache_clear()
    batches = _batches(cfg)
    for step in range(3):
        forward_backward([model], batches, StepPlan(ProcessGroups.single(), step))
    assert built == [1]
    info = executor.stage_steps.cache_info()
    assert (info.hits, info.misses) == (2, 1)


class _NoComm:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("pp = 1 made a PipeComm")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_pp1_accumulation_loop_makes_no_p2p_and_matches_the_action_loop(
        arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tight pp = 1 loop (no PipeComm, no p2p call) gives the general action loop's losses
    and gradients bit for bit, dropout and the grad_sync hook included."""
    cfg = _config(arch)
    batches = _batches(cfg)
    groups = ProcessGroups.single()
    model = build_reference(cfg, torch.float64)
    model.train()

    def run(record: bool) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
        model.zero_grad(set_to_none=True)
        synced: list[int] = []
        plan = StepPlan(groups, 7, grad_sync=synced.append,
                        options=ExecOptions(record=record))
        losses = forward_backward([model], batches, plan)
        return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, synced

    general = run(record=True)  # recording always takes the action loop
    fast_calls: list[int] = []
    accumulate = executor.StageExecutor._accumulate

    def spy(self: executor.StageExecutor) -> executor.ExecResult:
        fast_calls.append(self.m)
        return accumulate(self)

    monkeypatch.setattr(executor.StageExecutor, "_accumulate", spy)
    monkeypatch.setattr(executor, "PipeComm", _NoComm)

    def no_p2p(self: CommGroup, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pp = 1 posted a p2p operation")

    monkeypatch.setattr(CommGroup, "p2p", no_p2p)
    fast = run(record=False)
    assert fast_calls == [M]
    assert fast[0] == general[0] and len(fast[0]) == M
    assert fast[2] == general[2] == list(range(M))
    for name, grad in general[1].items():
        assert torch.equal(fast[1][name], grad), name
    with torch.no_grad():  # evaluation at pp = 1 makes no PipeComm either
        evals = forward_only([model], batches, StepPlan(groups, 7))
    assert len(evals) == M and all(v > 0 for v in evals)


def test_grad_accumulators_computed_once_stay_valid_for_later_forwards() -> None:
    """The executor looks the parameters' AccumulateGrad nodes up once per chunk and step;
    holding them keeps them alive, so the next micro-batch's graph uses the same nodes and
    find_boundaries gives the same boundaries as with a fresh lookup, W the same gradients."""
    cfg = _config()
    ctx = make_context(cfg, ProcessGroups.single(), dtype=torch.float64)
    chunk = ModelChunk(cfg.model, ctx, [0, 1], first=False, last=True)
    params = list(chunk.parameters())
    tokens, labels = random_batches(cfg, seed=4)[0]
    x0 = torch.randn(SEQ, MICRO, 32, dtype=torch.float64)
    acc: dict[Any, torch.nn.Parameter] | None = None
    grads = []
    for cached in (False, True, True):
        chunk.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y = chunk(x, labels, reduction="sum", tokens=tokens)
        fresh = find_boundaries(y, x, params)
        if acc is None:
            acc = grad_accumulators(params)
        assert fresh is not None and len(fresh) > len(params) // 4
        assert [b.node for b in find_boundaries(y, x, params, acc)] == [b.node for b in fresh]
        dx, pending = backward_input(y, None, x, params, accumulators=acc if cached else None)
        backward_weight(pending)
        grads.append([dx] + [p.grad.clone() for p in params])
    for later in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], later, strict=True))


def test_zbv_stage_steps_are_cached_with_the_v_turn_local() -> None:
    """zbv pp=2 m=4: the steps carry the "v" placement; stage 1 (the turn) hands chunk 0's
    activation and chunk 1's gradient over locally (2 m messages, no p2p op to itself);
    stage 0 has no local message and consumes no input for F of chunk 0 and B of chunk 1."""
    args = ("zbv", 2, 2, 4, 1, True, True)
    steps = executor.stage_steps(*args)
    assert steps is executor.stage_steps(*args) and steps.placement == "v"
    assert steps.splits_w and steps.has_p2p and not steps.accumulate
    assert steps.local == frozenset({p2p.Message(d, k, c) for k in range(4)
                                     for d, c in (("F", 1), ("B", 0))})
    assert dict(steps.local_sends) == {(Kind.F, (k, 0)): p2p.Message("F", k, 1) for k in
                                       range(4)} | {(Kind.B, (k, 1)): p2p.Message("B", k, 0)
                                                    for k in range(4)}
    assert steps.local == p2p.local_messages(schedule_lists("zbv", 2, 2, 4)[1], 1)
    assert all(op.peer == 0 for g in steps.program.groups for op in g)
    first = executor.stage_steps("zbv", 2, 2, 4, 0, True, True)
    assert first.local == frozenset() and not first.local_sends
    inputs = {(str(a), None if m is None else m.direction) for a, m in
              zip(first.computes, first.inputs, strict=True) if a.kind != Kind.W}
    assert {a for a, d in inputs if d is None} == ({f"F{k}c0" for k in range(4)}
                                                   | {f"B{k}c1" for k in range(4)})
    evals = executor.stage_steps("zbv", 2, 2, 4, 1, False, False)
    assert evals.placement == "v" and len(evals.local) == 4 and not evals.splits_w
    assert [str(a) for a in evals.computes] == [f"F{k}c{c}" for c in (0, 1) for k in range(4)]
