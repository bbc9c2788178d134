"""The executor's parts: zero-bubble backward split, output deallocation, p2p message order,
forward-only lists; and on gloo ranks: memory peaks, bytes sent, losses, evaluation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.config.choices import schedule_placement
from colonnade.config.sections import Config, ModelConfig
from colonnade.models.build import build_chunks, build_reference, make_context
from colonnade.models.gpt import ModelChunk
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.actions import Kind, ScheduleError
from colonnade.pipeline.checker import check_schedule
from colonnade.pipeline.executor import execute, forward_only_lists, release_output
from colonnade.pipeline.p2p import Message, PipeComm, message_shape, stage_program
from colonnade.pipeline.plan import ExecOptions, StepPlan
from colonnade.pipeline.schedules import build_schedule
from colonnade.pipeline.simulate import replay
from colonnade.pipeline.split_backward import backward_input, backward_weight, find_boundaries
from colonnade.training.step import forward_backward, forward_only, set_train_mode
from tests.pipeline.test_parity import make_config, step_batches

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2))


def _chunk(arch: str, first: bool, last: bool) -> ModelChunk:
    cfg = Config(model=ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_heads=4,
                                   vocab_size=64, max_seq_len=16, bias=arch == "gpt2"))
    ctx = make_context(cfg, ProcessGroups.single(), dtype=torch.float64)
    return ModelChunk(cfg.model, ctx, [0, 1], first=first, last=last)


def _grads(chunk: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in chunk.parameters()]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize(("first", "last"), [(False, False), (False, True), (True, False)])
def test_split_backward_is_bitwise_the_full_backward(arch: str, first: bool, last: bool) -> None:
    torch.manual_seed(0)
    chunk = _chunk(arch, first, last)
    tokens, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    shape = message_shape((2, 16), 32, 1, False)  # [b, s, h]: batch-first without sp, cp
    x0 = torch.randn(shape, dtype=torch.float64)
    dy = None if last else torch.randn(shape, dtype=torch.float64)

    def forward() -> tuple[torch.Tensor | None, torch.Tensor]:
        x = None if first else x0.clone().requires_grad_()
        inp = tokens if x is None else x
        return x, (chunk(inp, labels) if last else chunk(inp))

    x, y = forward()
    torch.autograd.backward(y, dy)
    full_dx, full = (None if x is None else x.grad), _grads(chunk)
    chunk.zero_grad(set_to_none=True)
    x, y = forward()
    dx, pending = backward_input(y, dy, x, list(chunk.parameters()))
    assert all(p.grad is None for p in chunk.parameters()), "B must not touch weight grads"
    if first:
        assert dx is None and pending.full_pass
    else:
        assert torch.equal(dx, full_dx) and not pending.full_pass
        assert len(pending.boundaries) >= 8  # q, k, v, o, mlp (3 llama / 2 gpt2), 2 norms
    backward_weight(pending)
    for a, b in zip(_grads(chunk), full, strict=True):
        assert torch.equal(a, b)


def test_split_backward_falls_back_when_a_weight_is_used_twice() -> None:
    w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tanh(x @ w) @ w  # w under two boundaries: per-boundary W would double count
    assert find_boundaries(y, x, [w]) is None
    dy = torch.randn(3, 4, dtype=torch.float64)
    dx, pending = backward_input(y, dy, x, [w])
    assert pending.full_pass and w.grad is None
    backward_weight(pending)
    x2 = x.detach().clone().requires_grad_()
    w2 = torch.nn.Parameter(w.detach().clone())
    torch.autograd.backward(torch.tanh(x2 @ w2) @ w2, dy)
    torch.testing.assert_close(dx, x2.grad, rtol=0, atol=1e-15)
    torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=1e-15)


def test_split_backward_of_a_chunk_without_layers_passes_the_gradient() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    dy = torch.randn(3, 4)
    dx, pending = backward_input(x, dy, x, [])
    assert dx is dy
    backward_weight(pending)  # nothing to do


def test_release_output_frees_values_and_keeps_backward() -> None:
    x = torch.randn(16, 2, 8, dtype=torch.float64, requires_grad=True)
    y = torch.tanh(x) * 3.0  # [s, b, h]
    values = y.detach().clone()
    sent = release_output(y)
    assert torch.equal(sent, values), "the send must still see the values"
    assert y.shape == (16, 2, 8) and y.untyped_storage().nbytes() == 8  # one float64 left
    dy = torch.randn_like(values)
    torch.autograd.backward(y, dy)
    torch.testing.assert_close(x.grad, dy * 3.0 * (1 - torch.tanh(x.detach()) ** 2))
    leaf = torch.randn(4, requires_grad=True)
    release_output(leaf)
    assert leaf.untyped_storage().nbytes() == 16  # leaves keep their data


def test_receives_follow_the_senders_order_across_directions() -> None:
    """With pp=2 and interleaving stage 0 sends stage 1 activations and gradients on one pair;
    the receiver's posting order must be the sender's send order (NCCL matches by order only)."""
    lists = build_schedule("interleaved_1f1b", 2, 2, 5)
    sent = [op.msg for g in stage_program(lists, 0, True).groups for op in g if op.kind == "send"]
    for overlap in (True, False):
        got = [op.msg for g in stage_program(lists, 1, overlap).groups for op in g
               if op.kind == "recv" and op.peer == 0]
        assert got == sent
    assert {m.direction for m in sent} == {"F", "B"}
    recv_order = [Message(a.direction, a.microbatch, a.chunk) for a in lists[1] if a.is_recv]
    assert sorted(sent, key=str) == sorted(recv_order, key=str) and sent != recv_order


def test_pipe_comm_rejects_a_message_never_posted() -> None:
    group = CommGroup("pp", [0, 1], None, CommStats(), 0)
    comm = PipeComm(group, 0, lambda k: (4, 1, 2), torch.float32, torch.device("cpu"))
    with pytest.raises(ScheduleError, match=r"consumed before it was posted"):
        comm.wait(Message("F", 0, 0))
    with pytest.raises(ValueError, match=r"not divisible by parallel.tp=2"):
        message_shape((2, 15), 32, 2, True)
    assert message_shape((2, 16), 32, 2, True) == (8, 2, 32)
    assert message_shape((2, 16), 32, 2, False) == (2, 16, 32)  # batch-first without sp, cp


@pytest.mark.parametrize(("pp", "vp", "m", "placement"), [
    (2, 1, 3, "loop"), (4, 1, 4, "loop"), (2, 2, 5, "loop"), (4, 2, 8, "loop"), (4, 2, 3, "loop"),
    (2, 2, 1, "v"), (2, 2, 5, "v"), (4, 2, 8, "v"), (4, 2, 3, "v")])
def test_forward_only_lists_are_complete_and_deadlock_free(pp: int, vp: int, m: int,
                                                           placement: str) -> None:
    lists = forward_only_lists(pp, vp, m, placement)
    for s, actions in enumerate(lists):
        fs = sorted((a.microbatch, a.chunk) for a in actions if a.kind == Kind.F)
        assert fs == sorted((k, c) for k in range(m) for c in range(vp)), f"stage {s}"
        assert all(a.kind in (Kind.F, Kind.RECV_F, Kind.SEND_F) for a in actions)
    # raises on deadlock / FIFO mismatch
    timeline = replay(lists, lambda stage, a: 1.0, placement=placement)
    assert sum(len(t) for t in timeline) == sum(len(a) for a in lists)
    if placement == "v":  # the turn hands each micro-batch over on stage pp - 1, nowhere else
        local = [sum(a.is_comm and a.peer == s for a in acts) for s, acts in enumerate(lists)]
        assert local == [0] * (pp - 1) + [2 * m]


def test_program_pairs_groups_like_megatron_1f1b() -> None:
    """1F1B pp=2 m=2, stage 1 (computes F0 B0 F1 B1): the receive of F1 is posted before F0
    with overlap, and the send of B0 goes out with nothing else (stage 0 is still forwarding)."""
    lists = build_schedule("1f1b", 2, 1, 2)

    def posts(stage: int, overlap: bool) -> list[list[list[str]]]:
        return [[[str(op) for op in g] for g in gs]
                for gs in stage_program(lists, stage, overlap).posts]

    assert posts(1, True) == [[["recv<-0 F0.0"], ["recv<-0 F1.0"]], [], [["send->0 B0.0"]], [],
                              [["send->0 B1.0"]]]
    assert posts(1, False) == [[["recv<-0 F0.0"]], [], [["recv<-0 F1.0"], ["send->0 B0.0"]],
                               [], [["send->0 B1.0"]]]
    assert posts(0, True) == [[], [["send->1 F0.0"]],
                              [["send->1 F1.0"], ["recv<-1 B0.0"], ["recv<-1 B1.0"]], [], []]


# ----------------------------------------------------------------------------- on ranks


def rank_executor_facts(pp: int, m: int) -> dict[str, Any]:
    """Run one step of each schedule; report peaks, bytes sent, timings and losses."""
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(pp=pp))
    out: dict[str, Any] = {"stage": groups.pp_rank}
    for sched, vp in SCHEDULES:
        cfg = make_config(pp=pp, vp=vp, schedule=sched, m=m)
        chunks = build_chunks(cfg, groups)
        batches = step_batches(cfg, 0)
        groups.stats.reset()
        res = execute(chunks, batches, StepPlan(groups, 0, sched),
                      options=ExecOptions(record=True))
        out[sched] = {"peak": res.peak_stashed, "peak_w": res.peak_pending_w,
                      "sent": groups.stats.total("pp/p2p", "payload_bytes"),
                      "computes": [str(t.action) for t in res.timeline],
                      "losses": res.losses, "grads": all(p.grad is not None or
                                                         getattr(p, "main_grad", None) is not None
                                                         for c in chunks for p in c.parameters())}
        if sched == "gpipe":  # m stashes everywhere: what output deallocation saves
            held = {}
            for dealloc in (True, False):
                opts = ExecOptions(record=True, deallocate=dealloc)
                held[dealloc] = execute(chunks, batches, StepPlan(groups, 0, sched),
                                        options=opts).peak_output_bytes
            out["held"] = held
        if vp == 2:  # evaluation through the loop and the V placements
            set_train_mode(chunks, False)
            out[sched]["eval"] = forward_only(chunks, batches, StepPlan(groups, 0, sched))
    return out


def test_executor_peaks_bytes_and_losses(run_ranks: Callable[..., list[Any]]) -> None:
    pp, m = 4, 6
    results = run_ranks(pp, rank_executor_facts, pp, m)
    msg_bytes = 16 * 2 * 32 * 8  # [s, b, h] float64
    for sched, vp in SCHEDULES:
        placement = schedule_placement(sched)
        lists = build_schedule(sched, pp, vp, m)
        report = check_schedule(lists, pp, vp, m, placement)
        cfg = make_config(pp=pp, vp=vp, schedule=sched, m=m)
        ref = build_reference(cfg, torch.float64)
        ref_losses = forward_backward([ref], step_batches(cfg, 0),
                                      StepPlan(ProcessGroups.single(), 0))
        loss_stage = 0 if placement == "v" else pp - 1  # the V's head is on stage 0
        for r in results:
            s, facts = r["stage"], r[sched]
            assert facts["peak"] == report.peak_in_flight[s], (sched, s)
            assert facts["peak_w"] == report.peak_pending_w[s], (sched, s)
            sends = sum(a.is_send and a.peer != s for a in lists[s])  # the V's turn is local
            assert facts["sent"] == sends * msg_bytes, (sched, s)
            assert facts["computes"] == [str(a) for a in lists[s] if a.is_compute]
            assert facts["grads"]
            if s == loss_stage:
                torch.testing.assert_close(torch.tensor(facts["losses"]),
                                           torch.tensor(ref_losses), rtol=1e-12, atol=0)
            else:
                assert facts["losses"] == []
        if vp == 2:
            ref_eval = forward_only([ref.eval()], step_batches(cfg, 0),
                                    StepPlan(ProcessGroups.single(), 0))
            for r in results:
                expected = ref_eval if r["stage"] == loss_stage else []
                assert r[sched]["eval"] == pytest.approx(expected, rel=1e-12), sched
    for r in results[:-1]:  # stages that send activations: only one float64 left per stash
        assert r["held"][False] == (m - 1) * msg_bytes and r["held"][True] == 8 * (m - 1)
