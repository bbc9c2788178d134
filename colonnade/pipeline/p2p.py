"""Point-to-point transfers between pipeline stages: activations forward, gradients backward.

Every message of a step is known in advance from the schedule: the stage lists say who sends
what, in which order, and every message has the static shape of one micro-batch's hidden state,
[s/tp, b, h] under sequence parallelism, else [s, b, h], in the model's dtype (the activation
sent forward and the gradient sent back have the same shape). So no shape handshake is needed:
the receiver allocates its buffer from the micro-batch's token shape.

NCCL's rules, which the posting must obey (gloo is more forgiving and hides their violations):
a rank's p2p operations run in order on one stream; a batched group (``batch_isend_irecv``)
starts only when the rank's earlier groups have completed and completes only when every
operation in it has matched; on each directed pair the k-th send matches the k-th receive
(tags are ignored). :mod:`colonnade.pipeline.nccl_model` replays these rules.

The posting (:func:`p2p_program`, the one place that decides it, used by the executor and the
NCCL model alike) is *matched by construction*:

1. Replay the whole schedule once with unit compute times (:func:`~colonnade.pipeline.simulate
   .replay`); message X gets the time t_X its producing compute ended, and the key
   (t_X, sending stage, index of the send in its list).
2. Every rank orders its operations (sends and receives) by that one global key, and batches
   those with the same t into one group, so the groups of all ranks for time t match each
   other one to one (Megatron's ``send_forward_recv_backward`` pairs are this for 1F1B).
   Induction on the key: the smallest unfinished message has both ends at the heads of their
   ranks' streams, so under NCCL's rules every group completes: no deadlock, for any schedule
   the checker accepts.
3. Each group is posted at a point between computes: a send after the compute that made its
   data, a receive before the compute that consumes it. This is always possible: on one stage,
   if the consumer of X runs before the producer of Y then t_X <= start(consumer) < end(
   producer) = t_Y, so X's group comes first. With ``overlap`` a group is posted as early as
   its sends allow (receives then arrive during the computes in between); without, a group of
   receives only is posted just before the compute needing it (unless a later send needs it
   out of the way first).

``in_order`` (``parallel.p2p_in_order``) makes gloo behave as NCCL: a rank issues its next group
only when the previous one has completed (a worker thread), and a group is done only when all
its operations are, so the CPU tests run the exact NCCL ordering (on NCCL this is what the
backend does). Without it gloo issues every group at once, a compute waiting only for its own
receive (gloo's fastest; the posting order is the same). Either way gloo's groups are issued by
a posting thread (:class:`_PostingThread`), as gloo can block the caller of a send or receive
for a while; NCCL's are issued by the compute thread (an enqueue on its stream).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

import torch

from colonnade.parallel.comm import CommGroup, Handle
from colonnade.pipeline.actions import Action, Kind, ScheduleError, locate, virtual_stage
from colonnade.pipeline.simulate import replay
from colonnade.tensor_parallel.context import is_batch_first

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


@dataclass(frozen=True)
class Op:
    """One p2p operation of a stage: ``send`` to or ``recv`` from stage ``peer`` carrying
    ``msg``; ``action`` is the SEND/RECV action of this stage's list it performs (None in
    hand-written groups of the NCCL model's tests)."""

    kind: str
    peer: int
    msg: Message
    action: Action | None = field(default=None, compare=False)

    def __str__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        m = self.msg
        return f"{self.kind}{arrow}{self.peer} {m.direction}{m.microbatch}.{m.chunk}"


Group = tuple[Op, ...]


@dataclass(frozen=True)
class StageProgram:
    """When a stage posts which p2p groups: ``posts[i]`` before its i-th compute action (the
    last entry after its last compute), each a batched group posted with one call."""

    stage: int
    posts: tuple[tuple[Group, ...], ...]
    consumers: Mapping[Message, int] = field(default_factory=dict, compare=False)
    """Received message -> index of the compute that consumes it (read-only)."""

    @property
    def groups(self) -> list[Group]:
        """All groups in posting order."""
        return [g for point in self.posts for g in point]

    def consumer_point(self, op: Op) -> int:
        """Index of the compute that consumes the message of receive ``op``."""
        return self.consumers[op.msg]


def message_shape(tokens_shape: Sequence[int], hidden: int, tp: int, sp: bool,
                  cp: int = 1) -> Shape:
    """Message shape for micro-batch tokens [b, s]: [s/cp/tp, b, h] under sp, [s/cp, b, h]
    under cp (a cp rank holds s/cp rows of the sequence), else the batch-first residual
    stream's [b, s, h] (:attr:`ParallelContext.batch_first`)."""
    b, s = int(tokens_shape[0]), int(tokens_shape[1])
    if s % cp:
        raise ValueError(f"sequence length {s} is not divisible by parallel.cp={cp}")
    s //= cp
    if sp and s % tp:
        raise ValueError(f"sequence length {s} is not divisible by parallel.tp={tp} (needed by "
                         "parallel.sp=true)")
    if is_batch_first(sp, cp):
        return (b, s, hidden)
    return (s // tp if sp else s, b, hidden)


def received_message(sender: Action, src: int, pp: int,
                     placement: str = "loop") -> tuple[int, Message]:
    """(receiving stage, message) of a send action posted on stage ``src`` (lists in
    ``placement``)."""
    v = virtual_stage(src, sender.chunk, pp, placement) + (1 if sender.kind == Kind.SEND_F
                                                           else -1)
    dst, chunk = locate(v, pp, placement)
    if dst != sender.peer_stage:
        raise ScheduleError(f"stage {src}: {sender} sends to stage {sender.peer} but virtual stage "
                            f"{v} lives on stage {dst}")
    return dst, Message(sender.direction, sender.microbatch, chunk)


def recv_message(a: Action) -> Message:
    """The message a receive action brings (named by the compute it feeds)."""
    return Message(a.direction, a.microbatch, a.chunk)


Key = tuple[float, int, int]  # (send time, sending stage, index of the send in its list)


def _message_keys(lists: Sequence[Sequence[Action]],
                  placement: str) -> dict[tuple[int, Message], Key]:
    """(receiving stage, message) -> the message's global key (module docstring, step 1)."""
    pp = len(lists)
    # raises on a deadlock or FIFO mismatch
    timeline = replay(lists, lambda stage, a: 1.0, placement=placement)
    keys: dict[tuple[int, Message], Key] = {}
    for src, events in enumerate(timeline):
        for e in events:
            if e.action.is_send:
                dst, msg = received_message(e.action, src, pp, placement)
                if (dst, msg) in keys:
                    raise ScheduleError(f"stage {src} sends {msg} to stage {dst} twice")
                keys[(dst, msg)] = (e.start, src, e.index)
    return keys


def _stage_ops(lists: Sequence[Sequence[Action]], stage: int,
               keys: dict[tuple[int, Message], Key],
               placement: str) -> list[tuple[Key, Op, int, int]]:
    """(key, op, earliest point, latest point) of each p2p action of ``stage``: a send may be
    posted once the compute before it ran, a receive must be posted before the compute after.
    Local messages (peer = this stage: the "v" placement's turn) take no p2p operation; the
    executor hands them over (:func:`local_messages`)."""
    pp = len(lists)
    out: list[tuple[Key, Op, int, int]] = []
    point = 0  # number of computes before the action
    for a in lists[stage]:
        if a.is_compute:
            point += 1
        elif a.peer_stage == stage:
            continue
        elif a.is_send:
            dst, msg = received_message(a, stage, pp, placement)
            out.append((keys[(dst, msg)], Op("send", dst, msg, a), point, 10**9))
        else:
            msg = recv_message(a)
            if (stage, msg) not in keys:
                raise ScheduleError(f"stage {stage} expects {msg} but no stage sends it")
            out.append((keys[(stage, msg)], Op("recv", a.peer_stage, msg, a), 0, point))
    return out


def _points(bounds: list[tuple[int, int, bool]], overlap: bool) -> list[int]:
    """Posting point of each group from (earliest, latest, has a send) (docstring, step 3)."""
    want = [lo if (overlap or has_send) else hi for lo, hi, has_send in bounds]
    for g in range(len(want) - 2, -1, -1):  # never hold back a later group
        want[g] = min(want[g], want[g + 1])
    points: list[int] = []
    for g, (lo, hi, _) in enumerate(bounds):
        p = max(points[-1] if points else 0, lo, want[g])
        if p > hi:
            raise ScheduleError(f"group {g} cannot be posted: its sends are ready at point {lo} "
                                f"but a receive is needed at point {hi}")
        points.append(p)
    return points


def stage_program(lists: Sequence[Sequence[Action]], stage: int, overlap: bool,
                  placement: str = "loop") -> StageProgram:
    """The groups ``stage`` posts and when (see the module docstring)."""
    return p2p_program(tuple(tuple(a) for a in lists), overlap, placement)[stage]


def local_messages(actions: Sequence[Action], stage: int) -> frozenset[Message]:
    """Messages ``stage`` receives from itself (the "v" placement's turn: chunk 0's output is
    chunk 1's input, chunk 1's input gradient chunk 0's output gradient)."""
    return frozenset(recv_message(a) for a in actions if a.is_recv and a.peer_stage == stage)


@lru_cache(maxsize=32)
def p2p_program(lists: tuple[tuple[Action, ...], ...], overlap: bool,
                placement: str = "loop") -> tuple[StageProgram, ...]:
    """Every stage's :class:`StageProgram` for one step's action lists in ``placement``
    (cached: a schedule is rebuilt every step with the same lists)."""
    keys = _message_keys(lists, placement)
    out: list[StageProgram] = []
    for stage, actions in enumerate(lists):
        ops = sorted(_stage_ops(lists, stage, keys, placement), key=lambda x: x[0])
        groups: list[list[tuple[Key, Op, int, int]]] = []
        for entry in ops:
            if groups and groups[-1][0][0][0] == entry[0][0]:
                groups[-1].append(entry)
            else:
                groups.append([entry])
        bounds = [(max(e[2] for e in g), min(e[3] for e in g), any(e[1].kind == "send"
                                                                   for e in g)) for g in groups]
        points = _points(bounds, overlap)
        n = sum(a.is_compute for a in actions)
        posts: list[list[Group]] = [[] for _ in range(n + 1)]
        for g, p in zip(groups, points, strict=True):
            posts[min(p, n)].append(tuple(e[1] for e in g))
        consumers = {e[1].msg: e[3] for e in ops if e[1].kind == "recv"}
        out.append(StageProgram(stage, tuple(tuple(p) for p in posts),
                                MappingProxyType(consumers)))
    return tuple(out)


class _Flag:
    """``threading.Event``'s ``is_set`` / ``set`` without its lock and condition: the done
    flag of a group that no other thread completes (free gloo and NCCL modes)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = False

    def is_set(self) -> bool:
        return self.value

    def set(self) -> None:
        self.value = True


class _Posted:
    """One posted group: the tensors it sends and receives (``messages``: the message of each
    receive), its backend handles once issued (one for the whole group on NCCL and in-order
    mode; on free gloo one for the sends and one per receive, so a compute waits only for its
    own message), whether it is done (an Event only when the in-order worker completes it), and
    on free gloo whether the posting thread has issued it."""

    __slots__ = ("done", "handles", "issued", "messages", "recv_handles", "recvs", "sends")

    def __init__(self, sends: list[tuple[torch.Tensor, int]], threaded: bool,
                 issued_by_thread: bool = False) -> None:
        self.sends = sends
        self.recvs: list[tuple[torch.Tensor, int]] = []
        self.messages: list[Message] = []
        self.handles: list[Handle] = []
        self.recv_handles: dict[Message, Handle] = {}
        self.done: threading.Event | _Flag = threading.Event() if threaded else _Flag()
        self.issued: threading.Event | None = threading.Event() if issued_by_thread else None


class _PostingThread:
    """Issues a stage's posted groups on a backend without NCCL's stream (gloo) from a worker
    thread, in posting order, so the compute thread never blocks issuing them.

    ``in_order`` (NCCL's per-rank p2p stream): a group is issued, as one operation, only when
    the previous one completed, and the worker completes it (gloo reports completion only
    through a blocking ``wait``, so a thread is the faithful model: the stream progresses while
    the rank computes, as the GPU's would). Exposed time is then the time the compute thread
    waits on :attr:`_Posted.done`, not recorded in the comm stats.

    Free (gloo's fastest): every group is issued at once, its sends as one operation and each
    receive as its own, and the worker only sets :attr:`_Posted.issued`. Issuing on gloo can
    block: a send or a receive takes its peer connection's lock, which gloo's I/O thread holds
    while it moves an earlier message (0.2-0.5 ms per call on average for 512 KiB messages on
    the 2-core machine, 24 messages a step under interleaved 1F1B at pp = vp = 2). On the
    worker that wait overlaps the compute instead of delaying it.
    """

    def __init__(self, group: CommGroup, in_order: bool) -> None:
        self.group, self.in_order = group, in_order
        self.queue: queue.SimpleQueue[_Posted | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="pp-p2p-post", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (posted := self.queue.get()) is not None:
            try:
                if self.error is None:
                    self._issue(posted)
            except BaseException as err:  # handed to the compute thread at its next wait
                self.error = err
            if posted.issued is not None:
                posted.issued.set()
            if self.in_order:
                posted.done.set()

    def _issue(self, posted: _Posted) -> None:
        if self.in_order:
            handle = self.group.p2p(posted.sends, posted.recvs, name="pp")
            posted.handles.append(handle)
            handle.wait()
            return
        if posted.sends:
            posted.handles.append(self.group.p2p(posted.sends, [], name="pp_send"))
        for msg, recv in zip(posted.messages, posted.recvs, strict=True):
            handle = self.group.p2p([], [recv], name=f"pp_recv_{msg.direction}")
            posted.handles.append(handle)
            posted.recv_handles[msg] = handle

    def put(self, posted: _Posted) -> None:
        self.queue.put(posted)

    def wait_issued(self, posted: _Posted) -> None:
        """Block until the worker issued ``posted`` (free mode)."""
        assert posted.issued is not None
        posted.issued.wait()
        if self.error is not None:
            raise self.error

    def wait_done(self, posted: _Posted) -> None:
        """Block until the worker completed ``posted`` (in-order mode)."""
        posted.done.wait()
        if self.error is not None:
            raise self.error

    def close(self, join: bool = True) -> None:
        """End the worker after the groups already posted (``join``: wait for them)."""
        self.queue.put(None)
        if join:
            self.thread.join()
            if self.error is not None:
                raise self.error


class PipeComm:
    """The p2p groups of one stage in one step (see the module docstring).

    Args:
        group: the pp group; peers are addressed by stage index (``group.ranks[stage]``).
        stage: this stage.
        shape_of: micro-batch index -> message shape.
        dtype, device: of the message buffers.
        in_order: run the groups as NCCL does, one after another on a stream
            (:class:`_PostingThread`; on NCCL the backend does this itself, so it only changes
            what gloo does).
    """

    def __init__(self, group: CommGroup, stage: int, shape_of: Callable[[int], Shape],
                 dtype: torch.dtype, device: torch.device, in_order: bool = False) -> None:
        self.group, self.stage = group, stage
        self.shape_of, self.dtype, self.device = shape_of, dtype, device
        self.nccl = group.coalesces  # NCCL: each group posted as one batch
        self.in_order = in_order and not self.nccl
        self.free = not self.in_order and not self.nccl  # gloo: every group issued at once
        self.stream: _PostingThread | None = None  # started by the first post (gloo)
        self.inbox: dict[Message, tuple[torch.Tensor, _Posted]] = {}
        self.pending: deque[_Posted] = deque()  # posted, not yet retired, in posting order
        self.peak_buffers = 0

    def _rank(self, stage: int) -> int:
        return self.group.ranks[stage]

    def post(self, ops: Group, tensors: Sequence[torch.Tensor]) -> None:
        """Post one group: its sends carry ``tensors`` (in the order of its send ops)."""
        sends = [op for op in ops if op.kind == "send"]
        posted = _Posted([(t, self._rank(op.peer)) for op, t in zip(sends, tensors, strict=True)],
                         threaded=self.in_order, issued_by_thread=self.free)
        for op in ops:
            if op.kind == "recv":
                buf = torch.empty(self.shape_of(op.msg.microbatch), dtype=self.dtype,
                                  device=self.device)
                posted.recvs.append((buf, self._rank(op.peer)))
                posted.messages.append(op.msg)
                self.inbox[op.msg] = (buf, posted)
        self.pending.append(posted)
        if self.nccl:
            posted.handles.append(self.group.p2p(posted.sends, posted.recvs, name="pp"))
        else:
            if self.stream is None:
                self.stream = _PostingThread(self.group, self.in_order)
            self.stream.put(posted)
        self.peak_buffers = max(self.peak_buffers, len(self.inbox))

    def _complete(self, posted: _Posted) -> None:
        """Block until ``posted`` is done."""
        if self.in_order:
            assert self.stream is not None
            self.stream.wait_done(posted)
        elif not posted.done.is_set():
            if self.free:
                assert self.stream is not None
                self.stream.wait_issued(posted)
            for handle in posted.handles:
                handle.wait()
            posted.done.set()

    def wait(self, msg: Message) -> torch.Tensor:
        """The data of ``msg``; blocks until its receive is done (NCCL: its group; in-order
        mode: its group and every earlier one)."""
        if msg not in self.inbox:
            raise ScheduleError(f"stage {self.stage}: {msg} is consumed before it was posted")
        buf, posted = self.inbox.pop(msg)
        if self.free:
            assert self.stream is not None
            self.stream.wait_issued(posted)
            posted.recv_handles[msg].wait()
        else:
            self._complete(posted)
        return buf

    def reap(self) -> None:
        """Release the groups known to be done, oldest first (their sent tensors), without
        blocking."""
        while self.pending:
            head = self.pending[0]
            if not head.done.is_set():
                if self.in_order or (head.issued is not None and not head.issued.is_set()):
                    return
                if not all(h.is_completed() for h in head.handles):
                    return
                self._complete(head)
            self.pending.popleft()

    def abandon(self) -> None:
        """The step failed: stop the posting thread after its current group, not waiting."""
        if self.stream is not None:
            self.stream.close(join=False)

    def finish(self) -> None:
        """Wait for every group; fail if a received message was never consumed."""
        try:
            while self.pending:
                self._complete(self.pending.popleft())
        except BaseException:
            self.abandon()  # the posting thread ends too
            raise
        if self.stream is not None:
            self.stream.close()
        left = sorted(str(m) for m in self.inbox)
        if left:
            raise ScheduleError(f"stage {self.stage}: step ended with unconsumed messages {left}")
