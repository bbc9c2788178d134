"""Run one stage's pipeline action list: forwards, backwards, weight gradients and p2p.

A schedule (:mod:`colonnade.pipeline.schedules`) gives every stage an ordered list of actions.
The executor walks this stage's computes; before each it posts the p2p groups that
:func:`~colonnade.pipeline.p2p.p2p_program` places there (matched one to one with the peers'
groups, so they complete under NCCL's in-order rules; with ``overlap`` as early as their sends
allow, so receives arrive during the computes in between); a compute waits only for the group
holding the message it consumes. Compute actions on micro-batch k of local chunk c:

* F: point dropout at micro-batch k (``set_rng_context``), then y = chunk(x). The first virtual
  stage takes the tokens [b, s]; the others the received activation x [s(/tp), b, h] (a leaf
  that requires grad). The last virtual stage returns the micro-batch's loss summed over its
  valid tokens S_k; the step's loss is sum over the global batch / N (``StepPlan.tokens``), so
  backward starts from y = S_k * plan.loss_multiplier() (= S_k * loss_scale * dp / N; see
  :mod:`colonnade.pipeline.plan`). pp = 1 is the degenerate case: one stage, 1f1b, no p2p.
  (x, y) are stashed until B.
* B: backward of the stashed y with the received gradient dy (none on the last virtual stage),
  giving dx (sent back unless this is the first virtual stage). Schedules with W actions (ZB-H1)
  compute only dx here and keep what W needs (:mod:`colonnade.pipeline.split_backward`).
* W: the deferred weight gradients dW of micro-batch k, accumulated into ``.grad``.

Megatron's output deallocation: once y [s(/tp), b, h] is sent, this stage needs only its
autograd node (``grad_fn``) for B, not its values. The send keeps its own reference to the
storage (released when the send completes), and y's data is replaced by one element expanded
to y's shape, so the activation memory goes as soon as the transfer does.

Host work per step: everything derived from (schedule, pp, vp, m, stage, overlap, train), the
compute list, the p2p program and the message each compute consumes, is pure data computed once
(:func:`stage_steps`, cached; :class:`StageSteps`). pp = vp = 1 training makes no PipeComm and
runs a plain accumulation loop (``StageExecutor._accumulate``: forward, loss * multiplier,
backward per micro-batch, the same operations in the same order as the action loop, so the
results are bit for bit the same). Zero-bubble B looks the parameters' AccumulateGrad nodes up
once per chunk and step.

Memory: a stage holds at most `peak_stashed` (x, y, graph) stashes, the schedule's peak
in-flight count (1F1B: min(p - s, m)), plus, for ZB-H1, up to s + 1 pending W graphs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import Any

import torch

from colonnade.config.choices import schedule_placement
from colonnade.models.gpt import ModelChunk, local_labels
from colonnade.pipeline.actions import Action, Kind, compute, virtual_stage
from colonnade.pipeline.p2p import (
    Message,
    PipeComm,
    StageProgram,
    message_shape,
    received_message,
    stage_program,
)
from colonnade.pipeline.plan import (
    Batch,
    ExecOptions,
    StepPlan,
    micro_batch_mean,
    scaled_loss,
    set_rng_context,
    stack_losses,
    with_tokens,
)
from colonnade.pipeline.schedules import (
    add_comm,
    interleaved_items,
    schedule_lists,
)
from colonnade.pipeline.split_backward import (
    PendingWeightGrad,
    backward_input,
    backward_weight,
    grad_accumulators,
)

Item = tuple[int, int]  # (microbatch, local chunk)


@dataclass(frozen=True)
class ActionTime:
    """When a compute action ran on this stage (seconds of ``time.perf_counter``)."""

    action: Action
    start: float
    end: float


@dataclass
class ExecResult:
    """What one step of the executor did on this stage."""

    loss_values: torch.Tensor
    """Per-micro-batch losses [m] in micro-batch order, on the device, on the stage holding the
    last virtual stage (pp - 1, or 0 under zbv); [0] elsewhere. Never read on the host here
    (:attr:`losses` reads them)."""
    start: float
    end: float
    timeline: list[ActionTime] = field(default_factory=list)
    """Compute actions with start/end times (only when recording)."""
    peak_stashed: int = 0
    """Most micro-batch stashes (F done, B not done) held at once, over all chunks."""
    peak_pending_w: int = 0
    """Most deferred weight gradients (B done, W not done) held at once."""
    recv_wait: float = 0.0
    """Seconds spent blocked on receives (only when recording)."""
    peak_output_bytes: int = 0
    """Most bytes held by stashed chunk outputs, seen before each F (only when recording);
    with output deallocation only the unsent ones and the scalar losses remain."""

    @property
    def losses(self) -> list[float]:
        """:attr:`loss_values` as host floats (one device-to-host copy; tests and tools: the
        training step reads them with its other values instead)."""
        return self.loss_values.tolist()

    @property
    def busy(self) -> float:
        """Seconds spent computing (sum over compute actions; needs recording)."""
        return sum(t.end - t.start for t in self.timeline)


def forward_only_lists(pp: int, vp: int, m: int, placement: str = "loop"
                       ) -> list[list[Action]]:
    """Action lists of an inference pass: every (micro-batch, chunk) forward, no backward.

    "loop": items run in Megatron's interleaved order (chunk-major within micro-batch groups),
    the same on every stage, so each item's input comes from an item earlier in that order.
    "v": every micro-batch's chunk 0, then every chunk 1 (a chunk-1 input comes back up from
    the stage below, which sent it asynchronously).
    """
    return [list(actions) for actions in _forward_only(pp, vp, m, placement)]


@lru_cache(maxsize=32)
def _forward_only(pp: int, vp: int, m: int,
                  placement: str = "loop") -> tuple[tuple[Action, ...], ...]:
    """:func:`forward_only_lists` computed once per (pp, vp, m, placement), immutable."""
    if placement == "v":
        items = [(mb, c) for c in range(vp) for mb in range(m)]
    else:
        items = interleaved_items(pp, vp, m, backward=False)
    return tuple(tuple(add_comm([compute(Kind.F, mb, c) for mb, c in items], s, pp, vp,
                                placement)) for s in range(pp))


@dataclass(frozen=True)
class StageSteps:
    """Everything the executor derives from (action lists, stage, overlap): pure data,
    computed once per key (:func:`stage_steps`) instead of once per step."""

    program: StageProgram
    """Which p2p groups to post before each compute (:func:`~colonnade.pipeline.p2p
    .p2p_program`)."""
    computes: tuple[Action, ...]
    """The stage's compute actions (F, B, W) in order."""
    inputs: tuple[Message | None, ...]
    """Per compute, the message it consumes: the activation for F of a non-first virtual stage,
    the gradient for B of a non-last one, else None."""
    splits_w: bool
    """The schedule defers weight gradients to W actions (zero bubble)."""
    has_p2p: bool
    """The stage posts at least one p2p group (False at pp = 1: no communicator is made)."""
    accumulate: bool
    """The computes are exactly F0 B0 F1 B1 ... on one chunk with no p2p (pp = vp = 1): the
    executor runs them as a plain gradient-accumulation loop."""
    placement: str = "loop"
    """The virtual-stage placement of the lists (:mod:`~colonnade.pipeline.actions`)."""
    local: frozenset[Message] = frozenset()
    """Messages this stage sends to itself (the "v" turn), handed over without p2p."""
    local_sends: Mapping[tuple[Kind, Item], Message] = field(default_factory=dict)
    """(F or B, (micro-batch, chunk)) whose output is a local message -> that message."""


def _consumed(a: Action, stage: int, pp: int, vp: int, placement: str) -> Message | None:
    """The message compute ``a`` waits for (None if it takes none)."""
    v = virtual_stage(stage, a.chunk, pp, placement)
    if a.kind == Kind.F and v > 0:
        return Message("F", a.microbatch, a.chunk)
    if a.kind == Kind.B and v < pp * vp - 1:
        return Message("B", a.microbatch, a.chunk)
    return None


def build_stage_steps(lists: Sequence[Sequence[Action]], stage: int, vp: int,
                      overlap: bool, placement: str = "loop") -> StageSteps:
    """:class:`StageSteps` of ``stage`` for any action lists in ``placement`` (uncached)."""
    pp = len(lists)
    computes = tuple(a for a in lists[stage] if a.is_compute)
    program = stage_program(lists, stage, overlap, placement)
    pairs = tuple(a for k in range(len(computes) // 2)
                  for a in (compute(Kind.F, k), compute(Kind.B, k)))
    has_p2p = any(point for point in program.posts)
    local_sends = {(Kind.F if a.kind == Kind.SEND_F else Kind.B, (a.microbatch, a.chunk)):
                   received_message(a, stage, pp, placement)[1]
                   for a in lists[stage] if a.is_send and a.peer_stage == stage}
    return StageSteps(program, computes,
                      tuple(_consumed(a, stage, pp, vp, placement) for a in computes),
                      any(a.kind == Kind.W for a in computes), has_p2p,
                      vp == 1 and not has_p2p and computes == pairs, placement,
                      frozenset(local_sends.values()), MappingProxyType(local_sends))


@lru_cache(maxsize=128)
def stage_steps(schedule: str, pp: int, vp: int, m: int, stage: int, overlap: bool,
                train: bool) -> StageSteps:
    """:class:`StageSteps` of a named schedule (``train``) or the forward-only pass, computed
    once per key: the same object for the same arguments."""
    placement = schedule_placement(schedule)
    lists = (schedule_lists(schedule, pp, vp, m) if train
             else _forward_only(pp, vp, m, placement))
    return build_stage_steps(lists, stage, vp, overlap, placement)


def release_output(y: torch.Tensor) -> torch.Tensor:
    """Megatron's output deallocation: keep y's autograd node, drop its values.

    Returns a tensor sharing y's current storage (to hand to the send, which keeps it alive
    until the transfer completes); y itself then points at one element expanded to its shape,
    so ``backward(y, dy)`` still type- and shape-checks while the [s(/tp), b, h] values are
    gone. Leaves and views (whose storage others share) are left alone.
    """
    data = y.detach()
    if y.grad_fn is not None and y._base is None:
        y.data = torch.zeros((), dtype=y.dtype, device=y.device).expand(y.shape)
    return data


class StageExecutor:
    """Executes one stage's action list for one step (see the module docstring)."""

    def __init__(self, chunks: list[ModelChunk], batches: list[Batch], plan: StepPlan,
                 steps: StageSteps, *, train: bool, options: ExecOptions) -> None:
        groups = plan.groups
        self.chunks, self.batches, self.plan = chunks, batches, plan
        self.train, self.options, self.steps = train, options, steps
        self.pp, self.vp, self.m = groups.pp.size, len(chunks), len(batches)
        self.stage = groups.pp_rank
        self.splits_w = steps.splits_w
        self.multiplier = plan.loss_multiplier() if train else 1.0
        self.params = ([[p for p in c.parameters() if p.requires_grad] for c in chunks]
                       if steps.splits_w else [])
        ctx = chunks[0].ctx
        self.device = next((p.device for c in chunks for p in c.parameters()),
                           ctx.device or torch.device("cpu"))  # a chunk may hold no layers
        self.comm: PipeComm | None = None  # none at all without p2p (pp = 1)
        if steps.has_p2p:
            hidden = chunks[0].cfg.hidden_size
            self.comm = PipeComm(
                groups.pp, self.stage,
                lambda k: message_shape(batches[k][0].shape, hidden, ctx.tp, ctx.sp,
                                        ctx.cp_size),
                ctx.dtype, self.device, in_order=options.in_order)
        self.stash: dict[Item, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.outbox: dict[tuple[Kind, Item], torch.Tensor] = {}
        self.inbox: dict[Message, torch.Tensor] = {}  # local messages (the "v" turn)
        self.pending_w: dict[Item, PendingWeightGrad] = {}
        self.accumulators: dict[int, dict[Any, torch.nn.Parameter]] = {}  # chunk -> grad nodes
        self.losses: dict[int, torch.Tensor] = {}  # detached 0-d, copied to host at the end
        self.result = ExecResult(torch.zeros(0, dtype=torch.float64), 0.0, 0.0)

    def _virtual(self, chunk: int) -> int:
        return virtual_stage(self.stage, chunk, self.pp, self.steps.placement)

    def run(self) -> ExecResult:
        """Execute every action; returns losses, timings and memory peaks."""
        if (self.train and self.steps.accumulate and not self.options.record
                and self.chunks[0].first and self.chunks[0].last):
            return self._accumulate()
        computes, comm = self.steps.computes, self.comm
        self._sync()
        self.result.start = time.perf_counter()
        try:
            for i, groups in enumerate(self.steps.program.posts):
                if comm is not None:
                    for ops in groups:
                        comm.post(ops, [self._outgoing(op.action) for op in ops
                                        if op.kind == "send"])
                    comm.reap()
                if i < len(computes):
                    self._compute(i)
        except BaseException:
            if comm is not None:
                comm.abandon()
            raise
        if comm is not None:
            comm.finish()
        self._sync()
        self.result.end = time.perf_counter()
        if self.stash or self.pending_w or self.outbox or self.inbox:
            raise RuntimeError(f"stage {self.stage}: schedule left work undone: stashes "
                               f"{sorted(self.stash)}, pending W {sorted(self.pending_w)}")
        self.result.loss_values = stack_losses([self.losses[k] for k in sorted(self.losses)],
                                               self.device)
        return self.result

    def _accumulate(self) -> ExecResult:
        """pp = vp = 1 training (F0 B0 F1 B1 ...): plain gradient accumulation, the same
        operations as :meth:`_forward` and :meth:`_backward` in the same order, without
        stashes, messages or per-action bookkeeping."""
        (chunk,) = self.chunks
        sync, losses = self.plan.grad_sync, []
        self.result.start = time.perf_counter()
        for k, (tokens, labels) in enumerate(self.batches):
            set_rng_context(self.chunks, self.plan, k, self.m)
            loss = chunk(tokens, labels, reduction="sum", tokens=tokens)
            losses.append(micro_batch_mean(loss.detach(), local_labels(labels, chunk.ctx)))
            y = scaled_loss(loss, self.multiplier)
            if sync is not None:
                sync(k)
            torch.autograd.backward(y)
        self.result.peak_stashed = 1 if self.batches else 0
        self.result.end = time.perf_counter()
        self.result.loss_values = stack_losses(losses, self.device)
        return self.result

    def _sync(self) -> None:
        if self.options.record:
            from colonnade.device import synchronize

            synchronize(self.device)

    def _outgoing(self, a: Action | None) -> torch.Tensor:
        """The tensor a send action ships; frees the stage's copy of a sent activation."""
        assert a is not None
        kind = Kind.F if a.kind == Kind.SEND_F else Kind.B
        return self._take(kind, (a.microbatch, a.chunk))

    def _hand_over(self, kind: Kind, item: Item) -> None:
        """A local message (the "v" turn): move compute ``item``'s output from the outbox to
        the inbox, as a send to this stage would (the activation's values then live on in the
        receiving chunk's input only, as after a p2p send)."""
        msg = self.steps.local_sends.get((kind, item))
        if msg is not None:
            self.inbox[msg] = self._take(kind, item)

    def _take(self, kind: Kind, item: Item) -> torch.Tensor:
        """Pop an output from the outbox for shipping; frees the stage's copy of an
        activation (output deallocation)."""
        t = self.outbox.pop((kind, item))
        if kind == Kind.B:
            return t
        if self.train and self.options.deallocate:
            return release_output(t)
        return t.detach()

    def _compute(self, i: int) -> None:
        """Wait for the input message of compute ``i`` (idle time), then run it (busy time)."""
        a, msg = self.steps.computes[i], self.steps.inputs[i]
        if self.options.record:
            begin = time.perf_counter()
            received = self._receive(msg)
            start = time.perf_counter()
            self.result.recv_wait += start - begin
        else:
            received = self._receive(msg)
            start = 0.0
        if a.kind == Kind.F:
            self._forward(a.microbatch, a.chunk, received)
        elif a.kind == Kind.B:
            self._backward(a.microbatch, a.chunk, received)
        else:
            self._weight(a.microbatch, a.chunk)
        if self.options.record:
            self._sync()
            self.result.timeline.append(ActionTime(a, start, time.perf_counter()))

    def _receive(self, msg: Message | None) -> torch.Tensor | None:
        """The input message of a compute: from the inbox when local, else from p2p."""
        if msg is None:
            return None
        if msg in self.steps.local:
            return self.inbox.pop(msg)
        return None if self.comm is None else self.comm.wait(msg)

    def _forward(self, k: int, c: int, x: torch.Tensor | None) -> None:
        chunk = self.chunks[c]
        if self.options.record:
            held = sum(y.untyped_storage().nbytes() for _, y in self.stash.values())
            self.result.peak_output_bytes = max(self.result.peak_output_bytes, held)
        set_rng_context(self.chunks, self.plan, k, self.m)
        tokens, labels = self.batches[k]
        if chunk.first:
            inputs = tokens
        else:
            assert x is not None
            inputs = x.requires_grad_() if self.train else x
        if chunk.last:
            loss = chunk(inputs, labels, reduction="sum", tokens=tokens)
            self.losses[k] = micro_batch_mean(loss.detach(), local_labels(labels, chunk.ctx))
            y = scaled_loss(loss, self.multiplier) if self.train else loss
        else:
            y = chunk(inputs, tokens=tokens)  # tokens: document boundaries (doc_reset)
            self.outbox[(Kind.F, (k, c))] = y
            self._hand_over(Kind.F, (k, c))
        if self.train:
            self.stash[(k, c)] = (x, y)
            self.result.peak_stashed = max(self.result.peak_stashed, len(self.stash))

    def _backward(self, k: int, c: int, dy: torch.Tensor | None) -> None:
        x, y = self.stash.pop((k, c))
        v = self._virtual(c)
        if self.splits_w:
            full = self.chunks[c].recomputes_layers
            if x is not None and not full and c not in self.accumulators:
                self.accumulators[c] = grad_accumulators(self.params[c])  # once per step
            dx, pending = backward_input(y, dy, x, self.params[c], full_pass=full,
                                         accumulators=self.accumulators.get(c))
            self.pending_w[(k, c)] = pending
            self.result.peak_pending_w = max(self.result.peak_pending_w, len(self.pending_w))
        else:
            if self.plan.grad_sync is not None:
                self.plan.grad_sync(k)
            torch.autograd.backward(y, dy)
            dx = x.grad if x is not None else None
        if v > 0:
            if dx is None:
                raise RuntimeError(f"stage {self.stage}: no input gradient for micro-batch {k} "
                                   f"chunk {c}")
            self.outbox[(Kind.B, (k, c))] = dx
            self._hand_over(Kind.B, (k, c))

    def _weight(self, k: int, c: int) -> None:
        if self.plan.grad_sync is not None:
            self.plan.grad_sync(k)
        backward_weight(self.pending_w.pop((k, c)))


def execute(chunks: list[ModelChunk], batches: list[Batch], plan: StepPlan,
            lists: Sequence[Sequence[Action]] | None = None, *, train: bool = True,
            options: ExecOptions | None = None) -> ExecResult:
    """Run this stage's list of ``lists`` (default: ``plan.schedule`` for pp, vp = len(chunks),
    m = len(batches); with pp = vp = 1 always 1f1b, i.e. gradient accumulation) with
    ``options`` (default ``plan.options``); the full result with timings and memory peaks.
    Without ``lists`` the stage's steps come from the :func:`stage_steps` cache."""
    pp, vp, m = plan.groups.pp.size, len(chunks), len(batches)
    opts = options or plan.options
    stage = plan.groups.pp_rank
    if lists is None:  # pp = vp = 1: the degenerate 1f1b (F0 B0 F1 B1 ...: plain accumulation)
        name = "1f1b" if pp == vp == 1 else plan.schedule
        steps = stage_steps(name, pp, vp, m, stage, opts.overlap, train)
    elif len(lists) != pp:
        raise ValueError(f"{len(lists)} action lists for parallel.pp={pp} stages")
    else:
        steps = build_stage_steps(lists, stage, vp, opts.overlap, schedule_placement(plan.schedule))
    if train:
        plan = with_tokens(plan, batches)  # the loss divisor N, counted over dp when unset
    return StageExecutor(chunks, batches, plan, steps, train=train, options=opts).run()


def run_pipeline(chunks: list[ModelChunk], batches: list[Batch], plan: StepPlan) -> list[float]:
    """Forward and backward of every micro-batch through ``plan.schedule``.

    Returns this rank's per-micro-batch losses on the stage holding the last virtual stage
    (pp - 1; stage 0 under zbv), [] elsewhere.
    Executor switches come from ``plan.options`` (:class:`~colonnade.pipeline.plan.ExecOptions`).
    """
    return execute(chunks, batches, plan).losses


def run_pipeline_forward(chunks: list[ModelChunk], batches: list[Batch],
                         plan: StepPlan) -> list[float]:
    """Evaluation: forward every micro-batch through the pipeline (call under no_grad).

    Returns the per-micro-batch losses on the stage holding the last virtual stage, []
    elsewhere.
    """
    return execute(chunks, batches, plan, train=False).losses
