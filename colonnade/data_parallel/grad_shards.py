"""ZeRO-2 / ZeRO-3 gradient path: each rank keeps only its shard of the reduced gradient.

With ``FlatBuffers(full_grads=False)`` there is no flat gradient buffer [N] and no
``main_grad``. Autograd writes each parameter's gradient of one micro-batch into ``param.grad``;
a post-accumulate-grad hook then

1. copies it (cast to the reduce dtype: ``parallel.grad_reduce_dtype``, fp64 for fp64
   models) into its slot of its bucket's *transient* full-size buffer ``T_i`` [numel_i],
   allocated uninitialised when the bucket's first gradient arrives (the padding and the slots
   of parameters that did not arrive are zeroed at launch), and frees ``param.grad``;
2. when every parameter of bucket i has arrived (and ``overlap_grad_reduce``), launches the
   asynchronous reduce-scatter of ``T_i`` over the bucket's shard group into a temporary
   ``O_i`` [L_i], ``L_i = numel_i / n``: rank r receives ``sum_ranks T_i[r L_i : (r + 1) L_i]``.

Groups (:class:`~colonnade.data_parallel.shard_groups.ShardGroups`): a dense bucket's shard
group is dp x cp (n = dp x cp) or hybrid sharding's group, an expert bucket's the expert-dp
group (n = edp) or its hybrid shard group. Averaging: ``T_i`` is pre-scaled by
:meth:`ShardGroups.prescale` (1 / D before a SUM, D = dp x cp for both kinds;
``average_in_collective``: AVG in both collectives, pre-scaled by n R / D). Hybrid sharding
(``zero_shard_size``): the reduce-scatters run inside the shard group, and at the step's sync
the accumulated shard ``G`` is all-reduced once over the replicate group (the ranks holding the
same shard index; the expert buckets' pieces over the expert replicate group), so every rank
holds the average over all dp x cp ranks: one all-reduce of N / n elements per step, not one
per bucket and micro-batch (the sum is linear).

When a reduce-scatter is waited, ``O_i`` is added into this rank's persistent shard gradient
``G`` [sum_i L_i] (fp32; fp64 for fp64 models: :meth:`GradShards.owned_grads`) and ``T_i`` and
``O_i`` are freed. At most ``max_in_flight`` reduce-scatters are outstanding: after each
launch the oldest ones already finished are folded in (a local add, no collective), and the
oldest is waited for while more than ``max_in_flight`` remain.

Cost of accumulating m micro-batches: every bucket is reduce-scattered once per micro-batch
(m reduce-scatters per bucket and step, against one for ZeRO-1, whose full fp32 buffer [N]
accumulates locally), and no full gradient buffer ever exists: the gradient memory is the
shard ``G`` (N / n elements) plus the transient buffers alive at once, ``peak_transient_bytes``
(the buckets being filled plus those in flight, each ``numel_i`` reduce-dtype elements plus
its [L_i] output).

Completion triggers (the schedule never has to say when a micro-batch ends):
* a bucket is launched as soon as all its parameters have arrived;
* a parameter whose gradient arrives while it is already marked arrived starts the next
  micro-batch for its bucket: the previous, partial bucket is launched first (a parameter
  unused by a micro-batch, or one accumulated twice; the reduce-scatter is linear, so partial
  launches give the same sum);
* a parameter read by several local chunks (``uses``: the tied embedding and head of the "v"
  pipeline placement, one Parameter on stage 0) arrives once per chunk backward; its
  arrivals are summed into the slot and it counts as arrived after ``uses`` of them (in
  whatever micro-batches they come: the sum is linear), so its bucket is still launched m
  times per step, not m x uses;
* :meth:`GradShards.finish` (``DataParallel.finish_grad_sync``) launches every partial bucket
  and waits for all.
Every dp rank runs the same program, so all of them issue the same collectives in the same
order. Buckets never span model chunks (virtual pipeline stages fill them at different times)
and the tied embedding / head has a bucket of its own with pp > 1, so its shards coincide on
the first and last stage.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from colonnade.config.choices import GRAD_REDUCE_DTYPES
from colonnade.config.sections import ParallelConfig
from colonnade.data_parallel.buffer import FlatBuffers
from colonnade.data_parallel.shard_groups import ShardGroups, bucket_name
from colonnade.parallel.comm import Handle

REDUCE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""parallel.grad_reduce_dtype -> torch dtype (keys equal config.choices.GRAD_REDUCE_DTYPES)."""
if set(REDUCE_DTYPES) != set(GRAD_REDUCE_DTYPES):
    raise ImportError(f"REDUCE_DTYPES {sorted(REDUCE_DTYPES)} must cover "
                      f"config.choices.GRAD_REDUCE_DTYPES {sorted(GRAD_REDUCE_DTYPES)}")


def reduce_dtype_for(name: str, grad_dtype: torch.dtype) -> torch.dtype:
    """The reduce-scatter dtype: fp64 for fp64 models, else ``grad_reduce_dtype``'s dtype."""
    return torch.float64 if grad_dtype == torch.float64 else REDUCE_DTYPES[name]


@dataclass
class _InFlight:
    """One launched reduce-scatter: its bucket, handle, input [numel_i] and output [L_i]."""

    index: int
    handle: Handle
    full: torch.Tensor
    out: torch.Tensor


class GradShards:
    """The stage-2/3 gradient storage and its per-micro-batch reduce-scatters.

    ``groups``: each bucket's shard and replicate groups (dense: ``buffers.shard_count`` ranks;
    expert: ``buffers.expert_shard_count``); ``divisor``: D = dp x cp, the count every gradient
    is averaged over (default: the dense shard group times its replicas). ``on_bucket_done(i)``
    is called
    when bucket i's gradients of a micro-batch are complete and launched (ZeRO-3 frees its
    gathered parameters there). ``uses``: id(parameter) -> arrivals that complete it, for
    parameters read by more than one local chunk (``ddp.shared_uses``; others need one).
    """

    def __init__(self, buffers: FlatBuffers, groups: ShardGroups, cfg: ParallelConfig, *,
                 divisor: int | None = None, max_in_flight: int = 2,
                 on_bucket_done: Callable[[int], None] | None = None,
                 uses: dict[int, int] | None = None) -> None:
        if buffers.grad_data is not None:
            raise ValueError("GradShards needs FlatBuffers(full_grads=False)")
        for bucket in buffers.buckets:
            if buffers.count_of(bucket) != groups.shard(bucket).size:
                raise ValueError(f"buffers cut bucket {bucket.index} into "
                                 f"{buffers.count_of(bucket)} shards but its shard group has "
                                 f"{groups.shard(bucket).size} ranks")
        self.buffers, self.groups, self.cfg = buffers, groups, cfg
        self.rank = max(groups.dense.rank, 0)
        self.expert_rank = groups.expert_rank
        self.max_in_flight = max(1, max_in_flight)
        self.on_bucket_done = on_bucket_done
        replicas = groups.dense_replicate.size if groups.dense_replicate is not None else 1
        self.divisor = divisor if divisor is not None else groups.dense.size * replicas
        self.reduce_dtype = reduce_dtype_for(cfg.grad_reduce_dtype, buffers.grad_dtype)
        sizes = [b.numel // buffers.count_of(b) for b in buffers.buckets]
        self._offsets = [0]
        for size in sizes:
            self._offsets.append(self._offsets[-1] + size)
        self.shard = torch.zeros(self._offsets[-1], dtype=buffers.grad_dtype,
                                 device=buffers.device)  # [sum_i L_i]
        self._full: list[torch.Tensor | None] = [None] * len(buffers.buckets)
        self._ready: list[set[int]] = [set() for _ in buffers.buckets]
        self._uses = dict(uses or {})
        self._partial: dict[int, int] = {}  # id(param) -> arrivals summed into its slot so far
        self._pending: deque[_InFlight] = deque()
        self._live = 0
        self.peak_transient_bytes = 0
        """Most bytes of transient buffers (T_i and O_i) alive at once since construction."""
        self.launches = 0
        """Reduce-scatters launched since the last :meth:`zero_grad`."""
        self.launched_in_backward = 0
        """Of those, launched from a hook (the bucket complete during backward)."""
        buffers.hook_grads(self._on_grad)

    # ------------------------------------------------------------------ views

    def bucket_shard(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s persistent shard gradient, a [L_i] view of :attr:`shard`."""
        return self.shard[self._offsets[index]:self._offsets[index + 1]]

    def owned_grads(self) -> list[torch.Tensor]:
        """1-D views of the shard aligned with ``buffers.owned_ranges(rank)`` (the shard is
        the owned ranges concatenated in bucket order, so merged ranges are contiguous)."""
        out, offset = [], 0
        for lo, hi in self.buffers.owned_ranges(self.rank, self.expert_rank):
            out.append(self.shard[offset:offset + hi - lo])
            offset += hi - lo
        return out

    # ------------------------------------------------------------------ the hook

    def _on_grad(self, param: nn.Parameter) -> None:
        """Fold ``param.grad`` into its bucket's transient buffer; launch a complete bucket."""
        grad = param.grad
        if grad is None:
            return
        slot = self.buffers.slot(param)
        index = slot.bucket
        if id(param) in self._ready[index]:  # a new micro-batch reached a partial bucket
            self._launch(index)
        full = self._full[index]
        if full is None:
            bucket = self.buffers.buckets[index]
            full = torch.empty(bucket.numel, dtype=self.reduce_dtype,
                               device=self.buffers.device)  # [numel_i], zeroed at launch
            self._full[index] = full
            self._count(full)
        start = self.buffers.buckets[index].start
        seen = self._partial.pop(id(param), 0)
        with torch.no_grad():  # each slot written once per buffer (a repeat launches first)
            view = full[slot.start - start:slot.end - start]
            if seen:  # a shared parameter's later arrival adds to the earlier ones
                view.add_(grad.reshape(-1))
            else:
                view.copy_(grad.reshape(-1))
        param.grad = None
        if seen + 1 < self._uses.get(id(param), 1):  # another local chunk still adds to it
            self._partial[id(param)] = seen + 1
            return
        ready = self._ready[index]
        ready.add(id(param))
        if self.cfg.overlap_grad_reduce and len(ready) == len(self.buffers.buckets[index].params):
            self._launch(index)
            self.launched_in_backward += 1

    def _count(self, t: torch.Tensor, sign: int = 1) -> None:
        self._live += sign * t.numel() * t.element_size()
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._live)

    def _ops(self) -> tuple[object, object]:
        if self.cfg.average_in_collective:
            return dist.ReduceOp.AVG, dist.ReduceOp.AVG
        return dist.ReduceOp.SUM, dist.ReduceOp.SUM

    def _launch(self, index: int) -> None:
        """Reduce-scatter bucket ``index``'s transient buffer (async); bound the in-flight."""
        full = self._full[index]
        self._full[index] = None
        if full is None:
            return
        bucket = self.buffers.buckets[index]
        group = self.groups.shard(bucket)
        with torch.no_grad():
            self._zero_unwritten(index, full)
            scale = self.groups.prescale(bucket, self.divisor, self.cfg.average_in_collective)
            if scale != 1.0:
                full.mul_(scale)
            out = torch.empty(full.numel() // group.size, dtype=full.dtype,
                              device=full.device)  # [L_i]
            self._count(out)
            op, _ = self._ops()
            handle = group.reduce_scatter_into(out, full, op=op,
                                               name=bucket_name(bucket, "grad_shard"),
                                               async_op=True)
        assert handle is not None
        self._pending.append(_InFlight(index, handle, full, out))
        self.launches += 1
        if self.on_bucket_done is not None:
            self.on_bucket_done(index)
        while self._pending and (len(self._pending) > self.max_in_flight
                                 or self._pending[0].handle.is_completed()):
            self._complete(self._pending.popleft())  # the finished ones first, without waiting

    def _zero_unwritten(self, index: int, full: torch.Tensor) -> None:
        """Zero the slots of parameters that did not arrive, and the padding (at the bucket's
        tail); then forget who arrived."""
        bucket = self.buffers.buckets[index]
        ready = self._ready[index]
        tail = bucket.start
        for p in bucket.params:
            slot = self.buffers.slot(p)
            tail = max(tail, slot.end)
            if id(p) not in ready and self._partial.pop(id(p), None) is None:
                full[slot.start - bucket.start:slot.end - bucket.start].zero_()
        full[tail - bucket.start:].zero_()
        ready.clear()

    def _complete(self, job: _InFlight) -> None:
        """Wait for one reduce-scatter and add its output into the shard."""
        job.handle.wait()
        with torch.no_grad():
            self.bucket_shard(job.index).add_(job.out)
        self._count(job.full, -1)
        self._count(job.out, -1)

    # ------------------------------------------------------------------ step boundaries

    def finish(self) -> None:
        """Launch every partial bucket (in bucket order, the same on every rank), wait for
        all, then (hybrid sharding) all-reduce the shard over the replicas: afterwards
        :attr:`shard` holds this rank's averaged gradient of the step."""
        for index in range(len(self._full)):
            if self._full[index] is not None:
                self._launch(index)
        while self._pending:
            self._complete(self._pending.popleft())
        self._reduce_replicas()

    def _reduce_replicas(self) -> None:
        """Hybrid sharding: all-reduce the shard over the replicate groups, one call per run of
        consecutive buckets of one kind (dense, expert), in bucket order on every rank."""
        buckets = self.buffers.buckets
        start = 0
        _, op = self._ops()
        for index in range(1, len(buckets) + 1):
            if index < len(buckets) and buckets[index].expert == buckets[start].expert:
                continue
            group = self.groups.replicate(buckets[start])
            if group is not None:
                run = self.shard[self._offsets[start]:self._offsets[index]]  # [run]
                with torch.no_grad():
                    group.all_reduce(run, op=op, name=bucket_name(buckets[start],
                                                                  "grad_shard_replicas"))
            start = index

    def abandon(self) -> None:
        """Forget the reduce-scatters in flight (their groups were released after a peer's
        death; the state is restored after the rejoin), so the next :meth:`zero_grad` starts
        clean."""
        self._pending.clear()

    def zero_grad(self) -> None:
        """Zero the shard gradient and forget partial buckets (the step's start)."""
        if self._pending:
            raise RuntimeError("zero_grad with gradient reduce-scatters in flight; call "
                               "finish_grad_sync first")
        for index, full in enumerate(self._full):
            if full is not None:
                self._count(full, -1)
                self._full[index] = None
        for ready in self._ready:
            ready.clear()
        self._partial.clear()
        self.shard.zero_()
        for p in self.buffers.params:
            p.grad = None
        self.launches = 0
        self.launched_in_backward = 0
