"""Point-to-point transfers between pipeline stages: activations forward, gradients backward.

Every message of a step is known in advance from the schedule: the stage lists say who sends
what, in which order, and every message has the static shape of one micro-batch's hidden state,
[s/tp, b, h] under sequence parallelism, else [s, b, h], in the model's dtype (the activation
sent forward and the gradient sent back have the same shape). So no shape handshake is needed:
the receiver allocates its buffer from the micro-batch's token shape.

Matching. Backends match a receive with a send by (source, order) on a pair of ranks (NCCL
ignores tags). On one directed pair of stages, messages of both directions can travel: with
pp = 2 and interleaving, stage 1 sends stage 0 both wrap-around activations and gradients.
:class:`PipeComm` therefore posts the receives on each directed pair in the *sender's* send
order (known from the sender's list), posting any earlier message of that pair together with
the one needed now; the buffers of messages posted early simply wait to be consumed.

Sends are asynchronous (post and continue); they are reaped when the backend reports them
complete (polled at every action) and waited at the end of the step. Receives are waited only
when the compute needs their data; with ``overlap`` the executor posts them one compute early.
On gloo each receive has its own handle (a send's wait needs the receiver to have posted, so
sends and receives are never waited together); on NCCL the sends and receives of one call are
posted as one group (``batch_isend_irecv``), as Megatron does, so that a send and the opposite
receive on the same pair cannot block each other on the GPU streams. Caveat (issue 20, open):
NCCL runs a rank's groups in order and completes a group only when all its ops matched, and
:mod:`colonnade.pipeline.nccl_model` shows today's posting (:func:`post_plan`) deadlocks there
with ``overlap`` for every schedule, and without it for interleaved pp = 2, m = 2pp.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from colonnade.parallel.comm import CommGroup, Handle
from colonnade.pipeline.actions import Action, Kind, ScheduleError, virtual_stage

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Message:
    """One transfer, named by what it feeds on the receiver.

    direction "F" (an activation, input of F) or "B" (a gradient, input of B); ``chunk`` is the
    receiver's local chunk whose compute consumes it.
    """

    direction: str
    microbatch: int
    chunk: int


def message_shape(tokens_shape: Sequence[int], hidden: int, tp: int, sp: bool) -> Shape:
    """Message shape for micro-batch tokens [b, s]: [s/tp, b, h] under sp, else [s, b, h]."""
    b, s = int(tokens_shape[0]), int(tokens_shape[1])
    if sp and s % tp:
        raise ValueError(f"sequence length {s} is not divisible by parallel.tp={tp} (needed by "
                         "parallel.sp=true)")
    return (s // tp if sp else s, b, hidden)


def received_message(sender: Action, src: int, pp: int) -> tuple[int, Message]:
    """(receiving stage, message) of a send action posted on stage ``src``."""
    v = virtual_stage(src, sender.chunk, pp) + (1 if sender.kind == Kind.SEND_F else -1)
    dst, chunk = v % pp, v // pp
    if dst != sender.peer_stage:
        raise ScheduleError(f"stage {src}: {sender} sends to stage {sender.peer} but virtual stage "
                            f"{v} lives on stage {dst}")
    return dst, Message(sender.direction, sender.microbatch, chunk)


def message_streams(lists: Sequence[Sequence[Action]], stage: int) -> dict[int, list[Message]]:
    """For each peer stage, the messages it sends to ``stage``, in its send order."""
    pp = len(lists)
    streams: dict[int, list[Message]] = {}
    for src, actions in enumerate(lists):
        for a in actions:
            if a.is_send:
                dst, msg = received_message(a, src, pp)
                if dst == stage:
                    streams.setdefault(src, []).append(msg)
    return streams


class RecvOrder:
    """Which receives to post, and when, so that each directed pair's receives follow its sender's
    send order (see the module docstring). Pure bookkeeping, shared by :class:`PipeComm` and the
    NCCL model (:mod:`colonnade.pipeline.nccl_model`), so both post the same receives.
    """

    def __init__(self, lists: Sequence[Sequence[Action]], stage: int) -> None:
        self.stage = stage
        self.streams = message_streams(lists, stage)
        self.where: dict[Message, tuple[int, int]] = {}
        for peer, msgs in self.streams.items():
            for i, msg in enumerate(msgs):
                if msg in self.where:
                    raise ScheduleError(f"stage {peer} sends {msg} to stage {stage} twice")
                self.where[msg] = (peer, i)
        self.posted = dict.fromkeys(self.streams, 0)

    def take(self, msgs: Sequence[Message]) -> list[tuple[Message, int]]:
        """(message, peer stage) receives to post so that each of ``msgs`` is posted, in
        per-pair stream order; marks them posted."""
        out: list[tuple[Message, int]] = []
        for msg in msgs:
            if msg not in self.where:
                raise ScheduleError(f"stage {self.stage} expects {msg} but no stage sends it")
            peer, index = self.where[msg]
            stream = self.streams[peer]
            while self.posted[peer] <= index:
                out.append((stream[self.posted[peer]], peer))
                self.posted[peer] += 1
        return out

    def unposted(self) -> list[tuple[int, int]]:
        """(peer, count) of receives never posted."""
        return [(p, len(s) - self.posted[p]) for p, s in self.streams.items()
                if self.posted[p] < len(s)]


@dataclass(frozen=True)
class Post:
    """One ``PipeComm.post`` call of the executor: the sends of a run, the receives it asks for
    (this run's, plus the next run's with overlap), then the compute that follows (None after
    the last run)."""

    sends: tuple[Action, ...]
    recvs: tuple[Message, ...]
    compute: Action | None


def split_runs(actions: Sequence[Action]) -> list[tuple[list[Action], Action | None]]:
    """[(communication run before a compute, the compute)], the last run has compute None."""
    out: list[tuple[list[Action], Action | None]] = []
    run: list[Action] = []
    for a in actions:
        if a.is_comm:
            run.append(a)
        else:
            out.append((run, a))
            run = []
    out.append((run, None))
    return out


def post_plan(actions: Sequence[Action], overlap: bool) -> list[Post]:
    """The posts the executor makes for one stage's action list, in order (the one place that
    decides how sends and receives are batched)."""
    runs = split_runs(actions)
    posts: list[Post] = []
    for i, (run, action) in enumerate(runs):
        recvs = [recv_message(a) for a in run if a.is_recv]
        if overlap and i + 1 < len(runs):
            recvs += [recv_message(a) for a in runs[i + 1][0] if a.is_recv]
        posts.append(Post(tuple(a for a in run if a.is_send), tuple(recvs), action))
    return posts


def recv_message(a: Action) -> Message:
    """The message a receive action brings (named by the compute it feeds)."""
    return Message(a.direction, a.microbatch, a.chunk)


class PipeComm:
    """The p2p messages of one stage in one step (see the module docstring).

    Args:
        group: the pp group; peers are addressed by stage index (``group.ranks[stage]``).
        stage: this stage.
        lists: the action lists of *all* stages (to know every sender's order).
        shape_of: micro-batch index -> message shape.
        dtype, device: of the message buffers.
    """

    def __init__(self, group: CommGroup, stage: int, lists: Sequence[Sequence[Action]],
                 shape_of: Callable[[int], Shape], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.group, self.stage = group, stage
        self.shape_of, self.dtype, self.device = shape_of, dtype, device
        self.order = RecvOrder(lists, stage)
        self.inbox: dict[Message, tuple[torch.Tensor, Handle]] = {}
        self.sends: deque[tuple[Handle, torch.Tensor]] = deque()
        self.fuse = group.pg is not None and dist.get_backend(group.pg) == "nccl"
        self.peak_buffers = 0

    def _rank(self, stage: int) -> int:
        return self.group.ranks[stage]

    def post(self, sends: Sequence[tuple[Action, torch.Tensor]],
             recvs: Sequence[Message]) -> None:
        """Post ``sends`` (action, tensor) and the receives of ``recvs`` not yet posted."""
        out = [(t, self._rank(a.peer_stage)) for a, t in sends]
        todo = self.order.take(recvs)
        bufs = [torch.empty(self.shape_of(msg.microbatch), dtype=self.dtype, device=self.device)
                for msg, _ in todo]
        ins = [(buf, self._rank(peer)) for buf, (_, peer) in zip(bufs, todo, strict=True)]
        if self.fuse and (out or ins):
            handle = self.group.p2p(out, ins, name="pp")
            self.sends.extend((handle, t) for t, _ in out)
            self.inbox.update({msg: (buf, handle) for buf, (msg, _) in zip(bufs, todo,
                                                                            strict=True)})
        else:
            if out:
                handle = self.group.p2p(out, [], name="pp_send")
                self.sends.extend((handle, t) for t, _ in out)
            for buf, (msg, peer) in zip(bufs, todo, strict=True):
                self.inbox[msg] = (buf, self.group.p2p([], [(buf, self._rank(peer))],
                                                       name=f"pp_recv_{msg.direction}"))
        self.peak_buffers = max(self.peak_buffers, len(self.inbox))

    def wait(self, msg: Message) -> torch.Tensor:
        """The data of ``msg`` (posting its receive first if needed); blocks until it arrived."""
        if msg not in self.inbox:
            self.post([], [msg])
        buf, handle = self.inbox.pop(msg)
        handle.wait()
        return buf

    def reap(self) -> None:
        """Complete (and release) the sends the backend has finished, oldest first."""
        while self.sends and self.sends[0][0].is_completed():
            self.sends.popleft()[0].wait()

    def finish(self) -> None:
        """Wait for every send; fail if a message was posted but never consumed."""
        while self.sends:
            self.sends.popleft()[0].wait()
        left = sorted(str(m) for m in self.inbox)
        unposted = self.order.unposted()
        if left or unposted:
            raise ScheduleError(f"stage {self.stage}: step ended with unconsumed messages "
                                f"{left} and unposted receives {unposted}")
