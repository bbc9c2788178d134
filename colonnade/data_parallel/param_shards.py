"""ZeRO-3 parameter sharding: each rank keeps 1/n of every bucket; a bucket's full values exist
only while a module that reads them runs (forward, backward, recomputation).

Storage (:class:`~colonnade.data_parallel.buffer.FlatBuffers` with ``shard_params``): bucket i
has a full storage [numel_i] that its parameters view, allocated by a gather and released by a
free (``untyped_storage().resize_(0)``), and rank r's persistent shard [L_i] of it, L_i =
numel_i / n. A gather all-gathers the n shards over the bucket's shard group into the full
storage::

    full_i[k L_i : (k + 1) L_i] = shard_i(rank k),   k = 0 .. n - 1

The shard group of a dense bucket is dp x cp (or hybrid sharding's shard group), that of an
expert bucket the expert-dp group (or its hybrid shard group): n and r differ per kind
(:class:`~colonnade.data_parallel.shard_groups.ShardGroups`).

The optimizer writes the shards (:meth:`ParamShards.owned`); the next gather sees the writes.

Hooks (one set per module that owns parameters, as DataParallel's ZeRO-1 pre-forward hooks: a
module listing ``direct_children`` covers its children's weights, a layer compiled by
training.compile covers all its descendants, which get none):

* forward-pre: gather the module's buckets (wait for them) and launch the gather of the next
  ``prefetch`` buckets in forward order (lower bucket indices: buckets are laid out in backward
  order) of the same chunk and kind, asynchronously (not inside a recomputation: the modules
  after it in forward order have finished their backward). A chunk of an MoE model is two
  regions, its dense buckets then its expert buckets, each in backward order, so the next
  buckets in use order are found within the region: a dense bucket prefetches dense ones, an
  expert bucket expert ones (stepping across the boundary would gather the other region's
  bucket at the wrong end of the pass, e.g. the last layer's experts after the embedding's
  backward).
* forward-post: register the pre-backward hook on the module's outputs that require grad, and
  (``reshard_after_forward``) free the buckets whose last user in the chunk's module order this
  module is. A chunk's root frees every bucket of the chunk after its forward, so an evaluation
  forward leaves nothing gathered. Inside backward (activation recomputation re-running a
  forward: non-reentrant checkpointing recomputes a whole block when the backward of its last
  node unpacks a saved tensor) the buckets the backward has gathered and not finished (the
  *live* ones, which the node that triggered the recomputation reads next) are kept; the rest
  are freed as in forward, and re-gathered by their module's pre-backward hook.
* pre-backward: a hook on each output tensor's gradient (``Tensor.register_hook``), which fires
  before any backward node of the module that consumes that gradient runs (so before any node
  that reads the module's saved weights): gather the module's buckets and prefetch the next
  ``prefetch`` in backward order (higher indices) of the same chunk. A tensor hook rather than
  ``register_multi_grad_hook``: one output's gradient is enough to need the weights, and the
  gather is idempotent, so the first output hook to fire gathers (prefetch within the region
  as in forward).

A bucket gathered for backward is freed (``reshard_after_forward``) once every one of its
parameters has accumulated its gradient in the same backward pass (autograd graph task): a
post-accumulate-grad hook per parameter counts the arrivals. Accumulation of p runs after every
node that reads p's value for a gradient (the node computing p's gradient is the one that reads
it), so nothing in that pass reads the bucket again. Counting per graph task (not per call of
the gradient path) keeps a bucket whose parameters complete across two micro-batches' passes
(one unused in a micro-batch) from being freed while the current pass still reads it; such a
bucket is freed at end_step. Otherwise (the micro-batch-window policy, the pp > 1 default)
buckets stay gathered from their first use in the step until :meth:`ParamShards.end_step`.
:meth:`ParamShards.bucket_backward_done` (the gradient path's report) frees a bucket only when
no backward has gathered it for reading and not finished it.

Autograd: a parameter's version counter is its own (``.data`` assignment does not share the
storage's counter), and the gathers write the bucket tensor, never the parameters, so a
re-gather never trips the "modified by an inplace operation" check of a tensor saved for
backward; the saved tensor views the same storage object and reads the re-gathered values.

Collective order (NCCL needs every rank of the shard group to issue the same collectives in
the same order): every rank of the shard group holds the same model chunks and runs the same
schedule, so the same modules' hooks fire in the same order on every rank; the buckets a hook
gathers and prefetches are a function of the module and of which buckets are gathered, and the
gathered set evolves identically on every rank (same hooks, same frees, same
bucket_backward_done order, since the buckets complete in the same backward order). So every
rank issues the same all-gathers in the same order. A module called or skipped depending on
the data would break this; Colonnade's models have none. In particular the routed experts of a
layer are one module (:class:`~colonnade.moe.experts.GroupedExperts`, stacked weights) called
every micro-batch, with zero rows when no token reached this rank: an expert that received no
token is gathered, computes an empty product, gets a zero gradient (so its bucket's arrival
count completes) and joins every all-gather of its expert-dp group in the same order as the
ranks whose experts did receive tokens (``tests/moe/test_parity_moe_zero23.py`` starves one).

Weights read outside any hooked module's forward (not through a module call, nor listed in
``direct_children``) are not gathered by the hooks: code doing that (export, checkpoint,
generation from a training chunk) calls :meth:`ParamShards.gather` / :meth:`gather_all` first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from colonnade.data_parallel.buffer import FlatBuffers, bucket_users
from colonnade.data_parallel.shard_groups import ShardGroups, bucket_name
from colonnade.parallel.comm import Handle


@dataclass
class _Site:
    """One hooked module: the buckets it reads and the ones it frees after its forward."""

    module: nn.Module
    chunk: int
    needed: list[int]
    user: bool
    """Whether the module runs its own forward (a ``direct_children`` child does not)."""
    frees: list[int] = field(default_factory=list)


class ParamShards:
    """Gathers and frees the ZeRO-3 buckets of ``buffers`` around the forward and backward of
    ``chunks`` (see the module docstring). ``groups``: each bucket's shard group (this rank's
    index in it is the shard it keeps); ``prefetch``: buckets gathered ahead of the one in
    use."""

    def __init__(self, buffers: FlatBuffers, groups: ShardGroups, chunks: Sequence[nn.Module],
                 *, reshard_after_forward: bool, prefetch: int) -> None:
        if not buffers.shard_params:
            raise ValueError("ParamShards needs FlatBuffers(shard_params=True)")
        for bucket in buffers.buckets:
            if buffers.count_of(bucket) != groups.shard(bucket).size:
                raise ValueError(f"buffers cut bucket {bucket.index} into "
                                 f"{buffers.count_of(bucket)} shards, its shard group has "
                                 f"{groups.shard(bucket).size} ranks")
        if prefetch < 0:
            raise ValueError(f"parallel.zero_prefetch={prefetch} must be >= 0")
        self.buffers, self.groups = buffers, groups
        self.rank, self.expert_rank = max(groups.dense.rank, 0), groups.expert_rank
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        buffers.keep_shard(self.rank, self.expert_rank)
        self._handles: list[Handle | None] = [None] * len(buffers.buckets)
        self._bytes = [b.numel * buffers.bucket_data[0].element_size() for b in buffers.buckets]
        self._region_of = [(b.chunk, b.expert) for b in buffers.buckets]
        self.gathered_bytes = 0
        """Bytes of full bucket storage allocated now."""
        self.peak_gathered_bytes = 0
        """Most bytes of full bucket storage allocated at once since construction."""
        self._live: set[int] = set()  # gathered for a backward that has not finished them
        self._arrived: list[set[int]] = [set() for _ in buffers.buckets]
        self._task = [-1] * len(buffers.buckets)  # graph task the arrivals belong to
        buffers.hook_grads(self._on_grad)
        self.gathers = 0
        """Bucket all-gathers issued since construction (tests and the pp policy count them)."""
        self.sites = self._install(chunks)

    # ------------------------------------------------------------------ storage

    def owned(self) -> list[torch.Tensor]:
        """The persistent shard as 1-D param-dtype views aligned with
        ``buffers.owned_ranges(rank)`` (the optimizer writes its updates there, after
        :meth:`end_step`; a bucket still gathered keeps its old full values until freed)."""
        out, offset = [], 0
        data = self.buffers.shard_data
        assert data is not None
        for lo, hi in self.buffers.owned_ranges(self.rank, self.expert_rank):
            out.append(data[offset:offset + hi - lo])
            offset += hi - lo
        return out

    def is_gathered(self, index: int) -> bool:
        """Whether bucket ``index``'s full storage is allocated (gathered or in flight)."""
        return self.buffers.is_gathered(index)

    def _launch(self, index: int) -> None:
        """Start the all-gather of bucket ``index`` unless it is gathered or in flight."""
        if self.buffers.is_gathered(index):
            return
        full = self.buffers.alloc_bucket(index)  # [numel_i]
        self.gathered_bytes += self._bytes[index]
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        bucket = self.buffers.buckets[index]
        with torch.no_grad():
            self._handles[index] = self.groups.shard(bucket).all_gather_into(
                full, self.buffers.shard_view(index), name=bucket_name(bucket, "param_shard"),
                async_op=True)
        self.gathers += 1

    def _wait(self, index: int) -> None:
        handle = self._handles[index]
        if handle is not None:
            handle.wait()
            self._handles[index] = None

    def gather(self, buckets: Sequence[int]) -> None:
        """All-gather ``buckets`` (those not gathered yet) and wait for them."""
        for index in buckets:
            self._launch(index)
        for index in buckets:
            self._wait(index)

    def free(self, buckets: Sequence[int]) -> None:
        """Release the full storage of ``buckets`` (waiting for a gather still in flight)."""
        for index in buckets:
            self._live.discard(index)
            if not self.buffers.is_gathered(index):
                continue
            self._wait(index)
            self.buffers.free_bucket(index)
            self.gathered_bytes -= self._bytes[index]

    def abandon(self) -> None:
        """A peer died mid-step (in-process restart; the gathers in flight were abandoned with
        their groups): free every gathered bucket and forget the step's arrivals, so every
        rank, the replacement too, starts the next step with none gathered."""
        self.free_all()
        self._live.clear()
        for arrived in self._arrived:
            arrived.clear()
        self._task = [-1] * len(self._task)

    def gather_all(self) -> None:
        """Gather every bucket (to read full weights outside a forward; prefer :meth:`gather`
        of one bucket at a time where memory matters)."""
        self.gather(range(len(self._handles)))

    def free_all(self) -> None:
        """Free every bucket."""
        self.free(range(len(self._handles)))

    def bucket_backward_done(self, index: int) -> None:
        """The gradient path's report that bucket ``index``'s gradients of a micro-batch are
        complete (or launched partially): freed when ``reshard_after_forward`` unless a
        backward still reads it (else kept until end_step). Complete buckets are already freed
        by the arrival count (:meth:`_on_grad`)."""
        if self.reshard_after_forward and index not in self._live:
            self.free([index])

    def _on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate hook: count the arrival; free a bucket complete in this pass."""
        index = self.buffers.slot(param).bucket  # type: ignore[arg-type]
        task = torch._C._current_graph_task_id()
        arrived = self._arrived[index]
        if self._task[index] != task:
            self._task[index] = task
            arrived.clear()
        arrived.add(id(param))
        if len(arrived) == len(self.buffers.buckets[index].params):
            arrived.clear()
            self._task[index] = -1
            if self.reshard_after_forward:
                self.free([index])

    def in_use_bytes(self) -> int:
        """The most bytes one hooked module needs gathered at once: its buckets and those of
        the hooked modules whose forward it runs inside (an MLP that reads its gate and up
        weights directly holds them while its ``down`` child runs). Peak gathered bytes stay
        within this plus ``prefetch`` buckets, plus one bucket shared by two consecutive
        modules."""
        best = 0
        for site in self.sites:
            using = set(site.needed)
            for outer in self.sites:
                if outer.user and any(m is site.module for m in outer.module.modules()):
                    using.update(outer.needed)
            best = max(best, sum(self._bytes[b] for b in using))
        return best

    def end_step(self) -> None:
        """The step's gradient sync is done: free everything (the window policy's end)."""
        self.free_all()

    # ------------------------------------------------------------------ hooks

    def _prefetch(self, needed: list[int], step: int) -> list[int]:
        """Launch the next ``prefetch`` buckets after ``needed`` in the direction ``step``
        (-1 forward, +1 backward), within each region (chunk and kind, dense or expert) of
        the needed buckets in the chunk of the first one; returns them."""
        out: list[int] = []
        if not needed or self.prefetch == 0:
            return out
        chunk = self._region_of[needed[0]][0]
        for region in sorted({self._region_of[b] for b in needed}):
            if region[0] != chunk:
                continue
            mine = [b for b in needed if self._region_of[b] == region]
            index = min(mine) if step < 0 else max(mine)
            for _ in range(self.prefetch):
                index += step
                if not 0 <= index < len(self._region_of) or self._region_of[index] != region:
                    break
                self._launch(index)
                out.append(index)
        return out

    def _install(self, chunks: Sequence[nn.Module]) -> list[_Site]:
        sites: list[_Site] = []
        for c, chunk in enumerate(chunks):
            mine = self._sites(chunk, c)
            last: dict[int, _Site] = {}
            for site in mine:
                if site.user:
                    last.update({b: site for b in site.needed})
            for b, site in last.items():
                site.frees.append(b)
            for site in mine:
                site.module.register_forward_pre_hook(self._pre_forward(site))
                if site.user:
                    site.module.register_forward_hook(self._post_forward(site))
            chunk_buckets = sorted({b for s in mine for b in s.needed})
            chunk.register_forward_hook(self._chunk_done(chunk_buckets))
            sites += mine
        return sites

    def _sites(self, chunk: nn.Module, c: int) -> list[_Site]:
        """The hooked modules of one chunk, in module (forward) order."""
        return [_Site(module, c, needed, user)
                for module, needed, user in bucket_users(chunk, self.buffers.slots)]

    def _pre_forward(self, site: _Site) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: object) -> None:
            self.gather(site.needed)
            if not _in_backward():  # a recomputation's next modules ran their backward
                self._prefetch(site.needed, -1)

        return hook

    def _post_forward(self, site: _Site) -> Callable[..., None]:
        def pre_backward(grad: torch.Tensor) -> None:
            self.gather(site.needed)
            self._live.update(site.needed)
            self._live.update(self._prefetch(site.needed, +1))

        def hook(_module: nn.Module, _args: object, output: object) -> None:
            if torch.is_grad_enabled():
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(pre_backward)
            if self.reshard_after_forward:
                # a recomputation inside backward keeps what the backward itself still reads
                self.free([b for b in site.frees if b not in self._live])

        return hook

    def _chunk_done(self, buckets: list[int]) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: object, _output: object) -> None:
            if self.reshard_after_forward and not _in_backward():
                self.free(buckets)

        return hook


def _in_backward() -> bool:
    """Whether an autograd engine pass is running on this thread (a recomputation)."""
    return torch._C._current_graph_task_id() != -1
