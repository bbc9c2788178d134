"""Data parallelism: bucketed gradient reduction overlapped with backward, and (ZeRO-1) the
bucketed parameter all-gather overlapped with the next forward.

Gradient accumulation: every parameter's gradient lands in its ``main_grad`` view of the flat
fp32 gradient buffer, which is never zeroed: a step starts with ``param.grad = None``, so
autograd hands the first micro-batch's fresh gradient over without a copy, and the first
arrival is *copied* into ``main_grad`` (one read, one write) where a zeroed buffer would take a
fill and an add (two reads, two writes). Then ``param.grad`` becomes the ``main_grad`` view
(fp32 / fp64 models: later micro-batches add into the buffer in place), or, for bf16 / fp16
models, later arrivals are added into it and freed. A post-accumulate-grad hook does this when
gradients are reduced across ranks or folded from a lower precision; with a reduction group of
one rank and the model in the gradient dtype (without ZeRO) no hook is registered and nothing
is copied either (:attr:`DataParallel.direct_grads`): the gradients stay in autograd's own
``param.grad`` tensors, which the optimizer reads directly, as ``torch.optim`` does, and the
sync, launch and gather calls return at once (a degree-1 data parallelism costs nothing). A
parameter that got no gradient in the step reads zero after the sync (its stale ``main_grad``
is zeroed; with direct gradients it is given a zero tensor). Nothing is communicated until the
step's
last micro-batch: the training step calls the hook returned by
:meth:`DataParallel.grad_sync_hook` before the backward of micro-batch k, which turns the sync
on for k = m - 1 only. During that backward, each hook
marks its parameter ready; when every parameter of a bucket is ready (and
``overlap_grad_reduce``) the bucket's reduction is launched asynchronously at once:

* DDP:    all-reduce of the bucket; every rank gets the whole averaged gradient.
* ZeRO-1: reduce-scatter of the bucket; rank r gets its range [start + rL, start + (r+1)L).

Averaging over the n = dp ranks: by default the bucket is pre-scaled by 1/n before a SUM (the
sum of n scaled gradients stays in range); with ``average_in_collective`` the collective
averages itself (ReduceOp.AVG). :meth:`finish_grad_sync` launches whatever is left and waits.

ZeRO-1 parameter gather: after the optimizer has written the updated shard of every bucket into
``param_data``, :meth:`start_param_gather` all-gathers the buckets in forward order. With
``overlap_param_gather`` nothing waits there: a forward-pre-hook on each module that owns
parameters waits for exactly the buckets holding them, so the gather of later layers overlaps
the forward of earlier ones (a module listing ``direct_children``, whose forward reads their
weights without calling them, waits for theirs too). :meth:`finish_param_gather` waits for
all (before reading weights outside a forward: export, checkpoint).

ZeRO-2 / ZeRO-3 (``parallel.zero_stage``; :attr:`ParallelConfig.zero` >= 2): no flat gradient
buffer; the gradient of every micro-batch is reduce-scattered bucket by bucket into this rank's
fp32 shard (:mod:`colonnade.data_parallel.grad_shards`). Stage 2 keeps ``param_data`` [N] and
gathers the updated shards as ZeRO-1 does; stage 3 keeps only this rank's shard of the
parameters, gathered per bucket before use and freed after (:class:`ParamShards`), so
:meth:`start_param_gather` / :meth:`finish_param_gather` do nothing there. The shard group is
dp x cp, or under hybrid sharding (``zero_shard_size``) groups of that many ranks, the
gradient shards then all-reduced over the replicate group.

Mixture of experts (``expert_group``, the expert-dp group): expert parameters
(:func:`~colonnade.data_parallel.buffer.is_expert_param`) have buckets of their own, reduced
(DDP: all-reduce; ZeRO-1: reduce-scatter, then all-gather of the updated shards) over
expert-dp instead of dp x cp, with the same overlap. Scaling: let the step's loss be
L = (1 / D) sum_r L_r, D = dp x cp, L_r what rank r back-propagates (its micro-batches' mean
loss; under sp the tp ranks of one sequence share one L_r, each back-propagating its own rows'
part of it). A dense weight's gradient on rank r is dL_r/dw, and dL/dw = (1/D) sum over the D
replicas: the dense reduction pre-scales by 1/D and sums. An expert weight lives on one rank of
each expert-dp group (its ep rank); the dispatcher's all-to-all carries the token gradients of
every rank of its ep group to it, so its local gradient is sum over those ranks' contributions,
and the expert-dp replicas together see every token of the stage exactly once:
dL/dw_e = (1/D) sum_{expert-dp replicas} g_local. Expert buckets are therefore pre-scaled by
1 / D too (not 1 / edp; edp = tp x cp x dp / ep differs from D when ep != tp) and summed
(``average_in_collective``: pre-scaled by edp / D, then averaged: the same number).
Every ZeRO stage shards expert buckets over the expert-dp group as it shards dense ones over
dp x cp (stage 1: optimizer state; 2: + the gradient shard; 3: + the parameters, gathered over
expert-dp). Hybrid sharding (``zero_shard_size``) shards them over groups of
min(zero_shard_size, edp) consecutive expert-dp ranks and replicates across those groups
(:func:`~colonnade.parallel.groups.expert_zero_partitions`); the replicas' gradient shards are
all-reduced over the expert replicate group as dense ones are over theirs.
:class:`~colonnade.data_parallel.shard_groups.ShardGroups` names each bucket's groups and
pre-scale for every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from colonnade.config.sections import Config, ParallelConfig
from colonnade.data_parallel.buffer import (
    Bucket,
    FlatBuffers,
    bucket_users,
    grad_dtype_for,
    is_expert_param,
    param_key,
)
from colonnade.data_parallel.grad_shards import GradShards
from colonnade.data_parallel.param_shards import ParamShards
from colonnade.data_parallel.shard_groups import ShardGroups, bucket_name
from colonnade.parallel.comm import CommGroup, Handle
from colonnade.parallel.groups import ProcessGroups

TIED_KEYS = frozenset({"embedding.word.weight"})
"""The tied word embedding, and the last stage's copy of it (the output head, same key:
``Sharding.tied_copy``): a bucket of its own when pp > 1 (identical layout on both ends). Under
zbv's "v" placement the head is the embedding's own Parameter on stage 0 (no copy); its bucket
stays its own, so ZeRO-3 gathers no other weight of chunk 0 for the head's chunk."""


def chunk_parameters(chunks: Sequence[nn.Module]) -> list[list[nn.Parameter]]:
    """Each chunk's parameters in forward order, each parameter once over all chunks."""
    seen: set[int] = set()
    out: list[list[nn.Parameter]] = []
    for chunk in chunks:
        mine = []
        for p in chunk.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                mine.append(p)
        out.append(mine)
    return out


def shared_uses(chunks: Sequence[nn.Module]) -> dict[int, int]:
    """id(parameter) -> number of ``chunks`` holding it, for those held by more than one."""
    counts: dict[int, int] = {}
    for chunk in chunks:
        for p in chunk.parameters():  # each chunk lists a parameter once
            counts[id(p)] = counts.get(id(p), 0) + 1
    return {key: n for key, n in counts.items() if n > 1}


class DataParallel:
    """Owns the flat buffers of one rank's chunks and every dp collective on them.

    ``group`` is the gradient-reduction group (dp x cp) and, with ZeRO, the shard group
    (``shard_group``: hybrid sharding's group of ``zero_shard_size`` ranks when given, with
    ``replicate_group`` across the shard groups). ``isolate`` names parameters that get a
    bucket of their own (the tied embedding and head when pp > 1). ``expert_group``: the
    expert-dp group reducing the expert parameters' buckets; needed when the chunks hold
    expert parameters, given for every rank of an MoE model. ``expert_shard_group`` /
    ``expert_replicate_group``: with ZeRO, hybrid sharding's expert shard and replicate groups
    (default: the expert buckets shard over the whole expert-dp group).
    """

    def __init__(self, chunks: Sequence[nn.Module], group: CommGroup, cfg: ParallelConfig,
                 isolate: frozenset[str] = frozenset(), *, shard_group: CommGroup | None = None,
                 replicate_group: CommGroup | None = None,
                 expert_group: CommGroup | None = None,
                 expert_shard_group: CommGroup | None = None,
                 expert_replicate_group: CommGroup | None = None) -> None:
        self.cfg, self.zero = cfg, cfg.zero
        self.sharded = self.zero >= 1
        self.shard_group = shard_group if shard_group is not None else group
        self.replicate_group = replicate_group
        self.group = self.shard_group if self.sharded else group
        """The group of this rank's ZeRO shard (dp x cp without hybrid sharding; DDP: dp x cp)."""
        self.expert_group = expert_group
        """Expert-dp: reduces (ZeRO-1: shards) the expert buckets (None: a dense model)."""
        params = chunk_parameters(chunks)
        self.direct_grads = self.zero == 0 and _one_replica(group, expert_group) and all(
            grad_dtype_for(p.dtype) == p.dtype for ps in params for p in ps)
        """Whether the step's gradients stay in autograd's ``param.grad`` tensors: one rank
        (dp x cp = 1, expert-dp = 1), no ZeRO, the model in the gradient dtype (fp32 / fp64),
        so nothing needs them in a flat buffer and none is allocated. :meth:`owned_ranges` is
        then one range per parameter and :meth:`step_grads` gives the tensors the optimizer
        reads."""
        if expert_group is None and any(is_expert_param(p) for ps in params for p in ps):
            raise ValueError("the model has expert parameters (an 'ep' split) but no expert-dp "
                             "group was given; build the groups with experts=True")
        expert_shard = (expert_shard_group or expert_group) if self.sharded else expert_group
        self.shard_groups = ShardGroups(
            self.group, replicate_group if self.sharded else None, expert_shard,
            expert_replicate_group if self.sharded and expert_group is not None else None)
        """Each bucket's reduction / shard group and replicas (dense: dp x cp; expert:
        expert-dp)."""
        self.buffers = FlatBuffers(params, cfg.bucket_size,
                                   self.group.size if self.sharded else 1, isolate,
                                   full_grads=self.zero < 2 and not self.direct_grads,
                                   shard_params=self.zero == 3,
                                   shard_rank=max(self.group.rank, 0) if self.zero == 3 else None,
                                   expert_shard_count=(expert_shard.size if self.sharded
                                                       and expert_shard is not None else None),
                                   expert_shard_rank=self.expert_rank if self.zero == 3 else None)
        self.buckets: list[Bucket] = self.buffers.buckets
        self.grad_divisor = self.group.size * self.replicas
        """D = dp x cp: every reduced gradient is a sum over ranks divided by D."""
        self.reduces = self._needs_reduction()
        """Whether any bucket needs a collective or a rescale (else the sync does nothing)."""
        self.param_shards: ParamShards | None = None
        """ZeRO-3: the :class:`ParamShards` gathering and freeing parameter buckets."""
        self.grad_shards: GradShards | None = None
        """ZeRO-2/3: the sharded gradient path."""
        if self.zero >= 2:
            self._init_sharded_grads(chunks)
            return
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._uses = shared_uses(chunks)
        """Parameters read by more than one local chunk (the tied embedding and head of the
        "v" pipeline placement, both on stage 0) -> that count: each chunk's backward
        accumulates its own gradient, so the last micro-batch brings that many arrivals."""
        self._arrivals: dict[int, int] = {}
        self._filled: set[int] = set()
        """id(parameter) whose main_grad holds this step's gradient (its first arrival was
        copied in)."""
        self._grad_handles: list[Handle | None] = [None] * len(self.buckets)
        self._gather_handles: list[Handle | None] = [None] * len(self.buckets)
        self._sync = False
        self.launched_in_backward = 0
        """Buckets whose reduction the last step launched from a hook (overlap evidence)."""
        self.alias = self.buffers.param_dtype == self.buffers.grad_dtype and not self.direct_grads
        """Whether ``param.grad`` is the ``main_grad`` view (autograd adds into the buffer)."""
        self.hooked = self.reduces or not (self.alias or self.direct_grads)
        """Whether post-accumulate hooks are registered (to reduce across ranks or to fold a
        bf16 / fp16 gradient into main_grad); neither is needed for dp x cp = 1 in fp32/fp64
        (and expert-dp = 1)."""
        assert not (self.direct_grads and self.hooked)
        if self.hooked:
            self.buffers.hook_grads(self._on_grad)
        if self.sharded and cfg.overlap_param_gather and self._gathers:
            self._install_pre_forward_hooks(chunks)
        self.zero_grad()

    @property
    def expert_rank(self) -> int:
        """This rank's index in the expert shard group (its expert buckets' ZeRO shard)."""
        return self.shard_groups.expert_rank

    def _needs_reduction(self) -> bool:
        """Whether the step's gradients need any collective or rescale at all: dp x cp > 1,
        or expert buckets with edp > 1 or D > 1 (their 1 / D)."""
        experts = self.expert_group is not None and any(b.expert for b in self.buckets) and (
            self.expert_group.size > 1 or self.grad_divisor > 1)
        return self.group.size > 1 or self.replicas > 1 or experts

    @property
    def _gathers(self) -> bool:
        """ZeRO-1/2: whether some bucket's shard group has more than one rank."""
        expert = self.shard_groups.expert
        return self.group.size > 1 or (expert is not None and expert.size > 1)

    def _group_of(self, bucket: Bucket) -> tuple[CommGroup, int]:
        """The group reducing (and sharding) ``bucket`` and this rank's index in it."""
        return self.shard_groups.shard(bucket), self.shard_groups.rank(bucket)

    def _init_sharded_grads(self, chunks: Sequence[nn.Module]) -> None:
        """ZeRO-2/3: gradients through :class:`GradShards`; stage 3 builds ParamShards."""
        self._gather_handles = [None] * len(self.buckets)
        self._sync = False
        self.alias = False
        self.hooked = True
        on_done = None
        if self.zero == 3:
            self.param_shards = ParamShards(self.buffers, self.shard_groups, chunks,
                                            reshard_after_forward=self.cfg.reshard,
                                            prefetch=self.cfg.zero_prefetch)
            on_done = self.param_shards.bucket_backward_done
        elif self.cfg.overlap_param_gather and self._gathers:
            self._install_pre_forward_hooks(chunks)
        self.grad_shards = GradShards(self.buffers, self.shard_groups, self.cfg,
                                      divisor=self.grad_divisor, on_bucket_done=on_done,
                                      uses=shared_uses(chunks))
        self.zero_grad()

    @property
    def launched_in_backward(self) -> int:
        """Buckets whose reduction the last step launched from a hook (overlap evidence)."""
        if self.grad_shards is not None:
            return self.grad_shards.launched_in_backward
        return self._launched

    @launched_in_backward.setter
    def launched_in_backward(self, value: int) -> None:
        self._launched = value

    @property
    def replicas(self) -> int:
        """Ranks holding the same shard (hybrid sharding's replicate group; else 1)."""
        return self.replicate_group.size if self.replicate_group is not None else 1

    def owned_grads(self) -> list[torch.Tensor]:
        """Main-gradient views aligned with :meth:`owned_ranges` (ZeRO-2/3: the fp32 shard)."""
        if self.grad_shards is not None:
            return self.grad_shards.owned_grads()
        if self.direct_grads:  # before the first step: zeros standing in for the gradients
            return [p.new_zeros(p.numel()) for p in self.buffers.params]
        assert self.buffers.grad_data is not None
        return [self.buffers.grad_data[lo:hi] for lo, hi in self.owned_ranges()]

    def owned_params(self) -> list[torch.Tensor]:
        """Parameter-dtype views aligned with :meth:`owned_ranges`: slices of ``param_data``,
        or (ZeRO-3) the persistent shard values :meth:`ParamShards.owned`."""
        if self.param_shards is not None:
            return self.param_shards.owned()
        assert self.buffers.param_data is not None
        return [self.buffers.param_data[lo:hi] for lo, hi in self.owned_ranges()]

    def owned_param_segments(self) -> list[tuple[nn.Parameter, int, int, torch.Tensor]]:
        """(param, lo, hi, values) for every owned piece of a parameter: elements [lo, hi) of
        the flattened local (tp-shard) parameter, ``values`` a 1-D view of the persistent
        storage (ZeRO-3: the shard; else ``param_data``)."""
        out = []
        for (lo, hi), values in zip(self.owned_ranges(), self.owned_params(), strict=True):
            for p, a, b in self.buffers.segments(lo, hi):
                start = self.buffers.slot(p).start
                out.append((p, a - start, b - start, values[a - lo:b - lo]))
        return out

    def local_param(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's full local (tp / ep shard) value of ``param`` [local_shape]: with ZeRO-3
        rebuilt from the persistent shards of its bucket's shard group (dense: dp x cp; expert:
        expert-dp), each element written by the one rank owning it into a zero-filled [numel]
        buffer and the buffers summed over that group (exact in every dtype; collective: every
        rank of the group calls for the same parameters in the same order); otherwise, or for
        a parameter the buffers do not hold (not trained), the parameter itself."""
        if self.param_shards is None or id(param) not in self.buffers.slots:
            return param
        slot = self.buffers.slot(param)
        flat = torch.zeros(param.numel(), dtype=param.dtype, device=self.buffers.device)
        for (lo, hi), values in zip(self.owned_ranges(), self.owned_params(), strict=True):
            a, b = max(lo, slot.start), min(hi, slot.end)
            if a < b:
                flat[a - slot.start:b - slot.start] = values[a - lo:b - lo]
        group = self.shard_groups.shard(self.buckets[slot.bucket])
        group.all_reduce(flat, name="gather_zero3_param")
        return flat.view(param.shape)

    @property
    def peak_transient_bytes(self) -> int:
        """ZeRO-2/3: most bytes of gradient bucket buffers alive at once (else 0)."""
        return self.grad_shards.peak_transient_bytes if self.grad_shards is not None else 0

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of this rank's data-parallel storage: persistent parameters (param_data, or
        the ZeRO-3 shard), persistent gradients (grad_data or the shard; with direct gradients
        autograd's tensors, held from backward to the next step), the transient gradient peak
        and the gathered-parameter peak (ZeRO-3)."""
        buf = self.buffers

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        params = nbytes(buf.param_data) if self.param_shards is None else nbytes(buf.shard_data)
        grads = (nbytes(self.grad_shards.shard) if self.grad_shards is not None
                 else nbytes(buf.grad_data))
        if self.direct_grads:
            grads = sum(p.numel() * p.element_size() for p in buf.params)
        gathered = (self.param_shards.peak_gathered_bytes
                    if self.param_shards is not None else 0)
        return {"params": params, "grads": grads, "transient_peak": self.peak_transient_bytes,
                "gathered_peak": gathered}

    # ------------------------------------------------------------------ gradients

    @property
    def rank(self) -> int:
        """This rank's index in the reduction group (its ZeRO shard)."""
        return max(self.group.rank, 0)

    def owned_ranges(self) -> list[tuple[int, int]]:
        """Ranges of the flat buffers whose reduced gradient this rank holds after the sync."""
        if self.direct_grads:  # one range per parameter: step_grads() aligns with them
            return [(s.start, s.end) for s in map(self.buffers.slot, self.buffers.params)]
        if not self.sharded:
            return [(0, self.buffers.numel)]
        return self.buffers.owned_ranges(self.rank, self.expert_rank)

    def step_grads(self) -> list[torch.Tensor]:
        """After the sync, flat views of this step's gradients aligned with
        :meth:`owned_ranges`: autograd's ``param.grad`` tensors (:attr:`direct_grads`), else
        the ``main_grad`` ranges (the same tensors every step)."""
        if not self.direct_grads:
            return self.owned_grads()
        return [p.grad.view(-1) for p in self.buffers.params]  # type: ignore[union-attr]

    def abandon_step(self) -> None:
        """A peer died mid-step (in-process restart): forget this step's reductions in flight
        (their handles were abandoned with their groups); the restored state replaces
        everything they fed, and the next :meth:`zero_grad` starts a clean step."""
        if self.grad_shards is not None:
            self.grad_shards.abandon()
        if self.param_shards is not None:  # ZeRO-3: no bucket stays gathered
            self.param_shards.abandon()
        self._gather_handles = [None] * len(self.buckets)

    def zero_grad(self) -> None:
        """Start a step: drop every ``param.grad`` and forget the previous step's sync state.

        The flat buffer is not zeroed: each parameter's first gradient of the step is copied
        over its stale ``main_grad`` (by the hook, or by :meth:`finish_grad_sync` for ZeRO-1 on
        one rank; with :attr:`direct_grads` nothing is copied), and a parameter that gets none
        reads zero once the sync finishes.
        """
        if self.grad_shards is not None:
            self.grad_shards.zero_grad()
            return
        for p in self.buffers.params:
            p.grad = None
        self._filled.clear()
        self.launched_in_backward = 0
        if self.reduces:
            self._reset()

    def _fill_grads(self) -> None:
        """Before the gradients are read: every parameter without a gradient this step gets
        its ``main_grad`` zeroed (stale values must not count). Direct gradients: that view
        becomes its ``param.grad``, the others keep autograd's tensor; unhooked without direct
        gradients (ZeRO-1 on one rank): every ``param.grad`` is copied into ``main_grad`` in
        one foreach call and becomes that view."""
        params = self.buffers.params
        if self.direct_grads:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        if not self.hooked:
            got = [p for p in params if p.grad is not None
                   and p.grad.data_ptr() != p.main_grad.data_ptr()]  # type: ignore[attr-defined]
            if got:
                torch._foreach_copy_([p.main_grad for p in got],  # type: ignore[attr-defined]
                                     [p.grad for p in got])
            self._filled.update(id(p) for p in got)
            for p in params:
                p.grad = p.main_grad  # type: ignore[attr-defined]
        for p in params:
            if id(p) not in self._filled:
                p.main_grad.zero_()  # type: ignore[attr-defined]
                self._filled.add(id(p))

    def _reset(self) -> None:
        for ready in self._ready:
            ready.clear()
        self._arrivals.clear()
        self._grad_handles = [None] * len(self.buckets)
        self._sync = False

    def grad_sync_hook(self, microbatches: int) -> Callable[[int], None]:
        """The ``StepPlan.grad_sync`` callback: sync on during micro-batch ``microbatches-1``
        (ZeRO-2/3 reduce every micro-batch: the callback does nothing there)."""
        last = microbatches - 1
        if self.grad_shards is not None:
            return _no_sync

        def grad_sync(k: int) -> None:
            self._sync = k == last

        return grad_sync

    def _on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate hook: fold param.grad into main_grad; mark ready on the last pass."""
        grad, main = param.grad, param.main_grad  # type: ignore[attr-defined]
        if grad is None:
            return
        if grad.data_ptr() != main.data_ptr():
            if id(param) in self._filled:
                main.add_(grad)
            else:  # the step's first gradient: copied over the stale buffer (never zeroed)
                main.copy_(grad)
                self._filled.add(id(param))
            param.grad = main if grad.dtype == main.dtype else None
        if not self._sync or not self.reduces:
            return
        index = self.buffers.slot(param).bucket  # type: ignore[arg-type]
        if self._grad_handles[index] is not None:
            raise RuntimeError(
                f"a gradient of {param_key(param)} arrived after its bucket's reduction was "  # type: ignore[arg-type]
                "launched: the parameter is accumulated twice in the last micro-batch's "
                "backward; set parallel.overlap_grad_reduce=false for this model")
        need = self._uses.get(id(param), 1)
        if need > 1:  # ready only once every chunk reading it has accumulated its part
            self._arrivals[id(param)] = self._arrivals.get(id(param), 0) + 1
            if self._arrivals[id(param)] < need:
                return
        ready = self._ready[index]
        ready.add(id(param))
        if self.cfg.overlap_grad_reduce and len(ready) == len(self.buckets[index].params):
            self._launch_reduce(index)
            self.launched_in_backward += 1

    def _reduce_op(self) -> object:
        return dist.ReduceOp.AVG if self.cfg.average_in_collective else dist.ReduceOp.SUM

    def _launch_reduce(self, index: int) -> None:
        bucket = self.buckets[index]
        assert self.buffers.grad_data is not None
        data = self.buffers.grad_data[bucket.start:bucket.end]  # [bucket]
        group, rank = self._group_of(bucket)
        scale = self.shard_groups.prescale(bucket, self.grad_divisor,
                                           self.cfg.average_in_collective)
        if scale != 1.0:
            data.mul_(scale)
        if self.sharded:
            lo, hi = self.buffers.shard(bucket, rank)
            out = self.buffers.grad_data[lo:hi]  # [bucket / n], aliases data
            handle = group.reduce_scatter_into(out, data, op=self._reduce_op(),
                                               name=bucket_name(bucket, "grad_bucket"),
                                               async_op=True)
        else:
            handle = group.all_reduce(data, op=self._reduce_op(),
                                      name=bucket_name(bucket, "grad_bucket"), async_op=True)
        assert handle is not None
        self._grad_handles[index] = handle

    def finish_grad_sync(self) -> None:
        """Launch every bucket not launched yet (overlap off, or unused params), wait for all.

        Afterwards main_grad holds the dp-averaged gradient: everywhere (DDP) or on this
        rank's owned ranges (ZeRO-1; elsewhere the buffer holds stale local values). One rank:
        no collective is called; direct gradients stay where autograd put them (parameters
        without one get zeros), ZeRO-1 copies them into the buffer.
        """
        if self.grad_shards is not None:
            self.grad_shards.finish()
            if self.param_shards is not None:
                self.param_shards.end_step()
            return
        self._fill_grads()
        if not self.reduces:
            return
        for index in range(len(self.buckets)):
            if self._grad_handles[index] is None:
                self._launch_reduce(index)
        for handle in self._grad_handles:
            assert handle is not None
            handle.wait()
        assert self.buffers.grad_data is not None
        for bucket in self.buckets:  # ZeRO-1 hybrid: sum the shards over their replicas
            replicate = self.shard_groups.replicate(bucket)
            if replicate is not None:
                lo, hi = self.buffers.shard(bucket, self.shard_groups.rank(bucket))
                replicate.all_reduce(self.buffers.grad_data[lo:hi], op=self._reduce_op(),
                                     name=bucket_name(bucket, "grad_shard_replicas"))
        self._reset()

    # ------------------------------------------------------------------ parameters (ZeRO-1)

    def start_param_gather(self) -> None:
        """All-gather every bucket's updated shards into param_data, in forward order (one
        rank: its shard is the whole buffer, nothing to gather)."""
        if not self.sharded or not self._gathers or self.param_shards is not None:
            return
        assert self.buffers.param_data is not None
        for bucket in sorted(self.buckets, key=lambda b: (b.chunk, b.first)):  # forward
            group, rank = self._group_of(bucket)
            if group.size == 1:
                continue
            lo, hi = self.buffers.shard(bucket, rank)
            full = self.buffers.param_data[bucket.start:bucket.end]  # [bucket]
            handle = group.all_gather_into(full, self.buffers.param_data[lo:hi],
                                           name=bucket_name(bucket, "param_bucket"),
                                           async_op=True)
            self._gather_handles[bucket.index] = handle
        if not self.cfg.overlap_param_gather:
            self.finish_param_gather()

    def finish_param_gather(self, buckets: Sequence[int] | None = None) -> None:
        """Wait for the all-gather of ``buckets`` (all when None)."""
        for index in range(len(self.buckets)) if buckets is None else buckets:
            handle = self._gather_handles[index]
            if handle is not None:
                handle.wait()
                self._gather_handles[index] = None

    @property
    def pending_gathers(self) -> int:
        """Buckets whose parameter all-gather has not been waited for yet."""
        return sum(h is not None for h in self._gather_handles)

    def _install_pre_forward_hooks(self, chunks: Sequence[nn.Module]) -> None:
        """A hook waiting for its buckets' gathers on every module that reads weights
        (:func:`~colonnade.data_parallel.buffer.bucket_users`: fused sibling linears' parents
        included, one hook per compiled layer)."""
        for chunk in chunks:
            for module, needed, _ in bucket_users(chunk, self.buffers.slots):
                module.register_forward_pre_hook(self._pre_forward_hook(needed))

    def _pre_forward_hook(self, needed: list[int]) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: object) -> None:
            self.finish_param_gather(needed)

        return hook


def _one_replica(group: CommGroup, expert_group: CommGroup | None) -> bool:
    """Whether no gradient needs a collective or a rescale: one rank in the reduction group
    and in the expert-dp group (D = 1, so nothing is scaled either)."""
    return group.size == 1 and (expert_group is None or expert_group.size == 1)


def _no_sync(_k: int) -> None:
    """ZeRO-2/3's grad_sync callback: every micro-batch is reduced, nothing to switch."""


def build_data_parallel(chunks: Sequence[nn.Module], config: Config,
                        groups: ProcessGroups) -> DataParallel:
    """The DataParallel of a run: reduction over dp x cp (ZeRO shards over the shard group,
    replicated over the replicate group under hybrid sharding), tied weights isolated when
    pp > 1; an MoE model's expert buckets over expert-dp."""
    tied = config.model.tie_embeddings and config.parallel.pp > 1
    moe = config.model.moe
    return DataParallel(chunks, groups.dp_cp, config.parallel, TIED_KEYS if tied else frozenset(),
                        shard_group=groups.shard_group, replicate_group=groups.zero_replicate,
                        expert_group=groups.expert_dp if moe else None,
                        expert_shard_group=groups.expert_shard_group if moe else None,
                        expert_replicate_group=groups.expert_zero_replicate if moe else None)
