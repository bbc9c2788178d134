"""Contiguous parameter and gradient buffers, in backward order, cut into buckets.

Every parameter of a rank's model chunks becomes a view into one flat parameter buffer
``param_data`` [N] (model dtype) and its gradient a view ``param.main_grad`` into one flat
gradient buffer ``grad_data`` [N] (fp32, or fp64 for fp64 models). Parameters are laid out in
*backward* order (last layer first), so the gradients backward produces first are contiguous at
the start of the buffer.

The buffer is cut into buckets (tensor fusion): parameters are appended to the open bucket
until it holds at least ``bucket_size`` elements; then it is closed. A bucket never spans two
model chunks (virtual pipeline stages finish backward at different times), and a parameter named
in ``isolate`` gets a bucket of its own (tied embedding/head weights with pp > 1, so the first
and last stage lay them out identically and their ZeRO shards coincide).

Sharding (ZeRO-1): with ``shard_count = n`` every bucket is padded with zeros to a multiple of
``n * ALIGN`` elements, so dp rank r owns the equal, aligned range
``[start + r L, start + (r + 1) L)``, ``L = size / n`` of each bucket. The padding is below
``n * ALIGN`` elements per bucket: at most ``buckets * n * ALIGN`` elements in all. Without
sharding (``shard_count = 1``) nothing is padded.

Storage modes (ZeRO-2 / ZeRO-3):

* ``full_grads=False``: no ``grad_data`` and no ``main_grad`` (the sharded-gradient path owns
  the fp32 shard storage).
* ``shard_params=True``: there is no ``param_data``. Bucket i has its own full-size storage
  ``bucket_data[i]`` [numel_i] and its parameters are views into it; the storage holds values
  only while *gathered*: freeing does ``untyped_storage().resize_(0)``, gathering resizes it
  back and writes every element, so the parameter views (and every tensor autograd saved that
  views them) keep the same storage object and see the re-gathered values. The persistent
  values are this rank's shard ``shard_data`` [sum_i L_i]: the concatenation, in bucket order,
  of every bucket's owned range ``[start_i + r L_i, start_i + (r + 1) L_i)``
  (:meth:`shard_view`). A parameter's autograd version counter is its own (``.data``
  assignment does not share the storage's), so the writes of a re-gather never invalidate
  tensors saved for backward.
* ``initial_values``: each parameter's value comes from ``initial_values(p)`` (one tensor at
  a time) instead of ``p.data``; parameters may then be on the meta device: such a parameter is
  swapped in place (:func:`torch.utils.swap_tensors`, same Python object, its attributes kept)
  for a view of the buffer.

Expert parameters (mixture of experts: a :class:`Sharding` splitting over "ep",
:func:`is_expert_param`) never share a bucket with dense ones: each chunk's dense parameters
are laid out first, then its expert parameters (both in backward order). Expert buckets are
reduced and (ZeRO) sharded over the expert-dp group (or its hybrid shard group), so they are
padded to a multiple of ``expert_shard_count * ALIGN`` and split ``expert_shard_count`` ways
(:attr:`Bucket.expert`, :meth:`FlatBuffers.count_of`); dense buckets use ``shard_count``. With
``shard_params`` an expert bucket's persistent shard is shard ``expert_shard_rank`` of it (this
rank's index in the expert shard group), a dense bucket's shard ``shard_rank``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from colonnade.models.compile import is_compiled
from colonnade.tensor_parallel.sharding import initial_value

ALIGN = 64
"""Each dp rank's range starts at a multiple of ALIGN elements (256 bytes in fp32)."""


@dataclass
class Bucket:
    """A contiguous range [start, end) of the buffers and the parameters inside it."""

    index: int
    start: int
    end: int
    chunk: int
    params: list[nn.Parameter] = field(default_factory=list)
    expert: bool = False
    """Whether the bucket holds expert parameters (reduced over expert-dp, not dp x cp)."""
    first: int = 0
    """Forward position (in its chunk) of the bucket's first parameter in forward order."""

    @property
    def numel(self) -> int:
        """Elements in the bucket, padding included."""
        return self.end - self.start


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives: [start, end) of the flat buffers, and its bucket."""

    start: int
    end: int
    bucket: int


def grad_dtype_for(param_dtype: torch.dtype) -> torch.dtype:
    """Main-gradient dtype: fp64 for fp64 models, fp32 otherwise."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def _own_value(param: nn.Parameter) -> torch.Tensor:
    """The default initial value: the parameter's own data, or for a meta parameter (ZeRO-3's
    deferred init, :func:`~colonnade.models.build.defers_init`) its value built from its init
    recipe (:func:`~colonnade.tensor_parallel.sharding.initial_value`)."""
    return initial_value(param) if param.is_meta else param.data


def is_expert_param(param: nn.Parameter) -> bool:
    """Whether ``param`` is a routed expert's weight: its Sharding splits over "ep"."""
    sharding = getattr(param, "sharding", None)
    return sharding is not None and "ep" in sharding.split_axes


def param_key(param: nn.Parameter) -> str:
    """The layout-independent name of a parameter (its sharding key) or a placeholder."""
    sharding = getattr(param, "sharding", None)
    return sharding.key if sharding is not None else f"<param {tuple(param.shape)}>"


class FlatBuffers:
    """Flat parameter and gradient buffers of a rank's chunks, with buckets and dp ranges.

    ``chunk_params[c]`` lists chunk c's parameters in forward order, each parameter once over
    all chunks. After construction each parameter's ``.data`` is a view of ``param_data`` (its
    values copied) and ``param.main_grad`` a view of ``grad_data`` (unless ``full_grads`` is
    False; with ``shard_params`` a view of its bucket's storage: see the module docstring).
    ``shard_rank`` (with ``shard_params``): keep that rank's shard at once, one bucket gathered
    at a time (else every bucket stays full until :meth:`keep_shard`). ``device``: where the
    buffers live (default: the parameters' device; the first initial value's when they are on
    the meta device). ``expert_shard_count``: the shard count of expert buckets (ZeRO over
    expert-dp; default ``shard_count``); ``expert_shard_rank``: the shard of them kept with
    ``shard_params`` (default ``shard_rank``).
    """

    def __init__(self, chunk_params: Sequence[Sequence[nn.Parameter]], bucket_size: int,
                 shard_count: int = 1, isolate: frozenset[str] = frozenset(), *,
                 full_grads: bool = True, shard_params: bool = False,
                 initial_values: Callable[[nn.Parameter], torch.Tensor] | None = None,
                 shard_rank: int | None = None, device: torch.device | None = None,
                 expert_shard_count: int | None = None,
                 expert_shard_rank: int | None = None) -> None:
        if bucket_size < 1:
            raise ValueError(f"parallel.bucket_size={bucket_size} must be >= 1 element")
        if shard_count < 1:
            raise ValueError(f"shard_count={shard_count} must be >= 1")
        params = [p for group in chunk_params for p in group]
        if not params:
            raise ValueError("no parameters to put into data-parallel buffers")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters have several dtypes {sorted(map(str, dtypes))}; "
                             "the buffers hold one model dtype")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter is listed twice; pass each parameter once")
        self.shard_count, self.bucket_size, self.isolate = shard_count, bucket_size, isolate
        self.expert_shard_count = (expert_shard_count if expert_shard_count is not None
                                   else shard_count)
        if self.expert_shard_count < 1:
            raise ValueError(f"expert_shard_count={self.expert_shard_count} must be >= 1")
        self.full_grads, self.shard_params = full_grads, shard_params
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype_for(self.param_dtype)
        self.params = params
        self.num_params = sum(p.numel() for p in params)
        self.buckets, self.slots = self._layout(chunk_params)
        self.numel = self.buckets[-1].end
        self._values = initial_values if initial_values is not None else _own_value
        self._first: tuple[int, torch.Tensor] | None = None
        if device is None and params[0].is_meta:  # the first value, computed once, says where
            first = self._values(params[0])
            self._first, device = (id(params[0]), first), first.device
        self.device = device if device is not None else params[0].device
        self.param_data: torch.Tensor | None = None
        """[N] model dtype (None with ``shard_params``)."""
        self.grad_data: torch.Tensor | None = None
        """[N] main-gradient dtype (None without ``full_grads``)."""
        self.bucket_data: list[torch.Tensor] = []
        """``shard_params``: bucket i's full storage [numel_i] (empty while freed)."""
        self.shard_data: torch.Tensor | None = None
        """``shard_params``: the persistent shard [sum_i L_i] of rank ``shard_rank``."""
        self.shard_rank = shard_rank
        self.expert_shard_rank = expert_shard_rank if expert_shard_rank is not None else shard_rank
        if full_grads:
            self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=self.device)
        if shard_params:
            self._attach_sharded(shard_rank)
        else:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype,
                                          device=self.device)  # [N]
            self._attach()

    def count_of(self, bucket: Bucket) -> int:
        """How many ways ``bucket`` is sharded: ``expert_shard_count`` for an expert bucket,
        ``shard_count`` otherwise."""
        return self.expert_shard_count if bucket.expert else self.shard_count

    def _pad(self, size: int, expert: bool = False) -> int:
        count = self.expert_shard_count if expert else self.shard_count
        unit = count * ALIGN if count > 1 else 1
        return -(-size // unit) * unit

    def _layout(self, chunk_params: Sequence[Sequence[nn.Parameter]]
                ) -> tuple[list[Bucket], dict[int, Slot]]:
        """Backward order: chunks last to first, parameters last to first within a chunk.
        Each chunk is two regions, its dense parameters then its expert parameters (Megatron's
        separate expert buffer, per chunk), so buckets of either kind fill up to
        ``bucket_size`` across layers (a dense model has one region per chunk)."""
        buckets: list[Bucket] = []
        slots: dict[int, Slot] = {}
        offset = 0
        for chunk in reversed(range(len(chunk_params))):
            forward = list(chunk_params[chunk])
            index = {id(p): i for i, p in enumerate(forward)}
            for expert in (False, True):
                region = [p for p in reversed(forward) if is_expert_param(p) == expert]
                offset = self._region(region, chunk, expert, index, offset, buckets, slots)
        return buckets, slots

    def _region(self, params: list[nn.Parameter], chunk: int, expert: bool,
                index: dict[int, int], offset: int, buckets: list[Bucket],
                slots: dict[int, Slot]) -> int:
        """Lay ``params`` (backward order, one kind) out from ``offset`` into new buckets;
        returns the offset after them. ``index``: forward position of each parameter."""
        open_bucket: Bucket | None = None
        for p in params:
            alone = param_key(p) in self.isolate
            if open_bucket is not None and alone:
                offset = self._close(open_bucket, buckets)
                open_bucket = None
            if open_bucket is None:
                open_bucket = Bucket(len(buckets), offset, offset, chunk, expert=expert)
            slots[id(p)] = Slot(offset, offset + p.numel(), open_bucket.index)
            open_bucket.params.append(p)
            open_bucket.first = index[id(p)]  # decreasing: the last one is the smallest
            offset += p.numel()
            open_bucket.end = offset
            if alone or open_bucket.end - open_bucket.start >= self.bucket_size:
                offset = self._close(open_bucket, buckets)
                open_bucket = None
        if open_bucket is not None:
            offset = self._close(open_bucket, buckets)
        return offset

    def _close(self, bucket: Bucket, buckets: list[Bucket]) -> int:
        bucket.end = bucket.start + self._pad(bucket.end - bucket.start, bucket.expert)
        buckets.append(bucket)
        return bucket.end

    @torch.no_grad()
    def _attach(self) -> None:
        assert self.param_data is not None
        for p in self.params:
            slot = self.slots[id(p)]
            self._place(p, self.param_data[slot.start:slot.end])
            if self.grad_data is not None:
                p.main_grad = self.grad_data[slot.start:slot.end].view_as(p)  # type: ignore[attr-defined]

    @torch.no_grad()
    def _place(self, p: nn.Parameter, flat: torch.Tensor) -> None:
        """Copy p's value into ``flat`` [numel(p)] and make p a view of it (same object)."""
        view = flat.view(p.shape)
        if self._first is not None and self._first[0] == id(p):
            value, self._first = self._first[1], None
        else:
            value = self._values(p)
        view.copy_(value)
        if p.is_meta or p.device != view.device:
            new = nn.Parameter(view.new_empty(0), requires_grad=p.requires_grad)
            new.data = view  # its own version counter, not the bucket's (see module doc)
            attrs = dict(p.__dict__)
            torch.utils.swap_tensors(p, new)  # p (same Python object) is now the view
            p.__dict__.update(attrs)
        else:
            p.data = view

    @torch.no_grad()
    def _attach_sharded(self, shard_rank: int | None) -> None:
        """Bucket storages filled with the initial values; kept full, or cut to the shard of
        ``shard_rank`` one bucket at a time (then at most one bucket is ever full)."""
        if shard_rank is not None:
            self._new_shard()
        for bucket in self.buckets:
            data = torch.zeros(bucket.numel, dtype=self.param_dtype, device=self.device)
            self.bucket_data.append(data)  # [numel_i]
            for p in bucket.params:
                slot = self.slots[id(p)]
                self._place(p, data[slot.start - bucket.start:slot.end - bucket.start])
                if self.grad_data is not None:
                    p.main_grad = self.grad_data[slot.start:slot.end].view_as(p)  # type: ignore[attr-defined]
            if shard_rank is not None:
                self._cut(bucket)

    def _new_shard(self) -> None:
        sizes = [b.numel // self.count_of(b) for b in self.buckets]
        self.shard_data = torch.zeros(sum(sizes), dtype=self.param_dtype, device=self.device)
        self._shard_offsets = list(itertools.accumulate(sizes, initial=0))

    def kept_rank(self, bucket: Bucket) -> int:
        """The shard of ``bucket`` kept with ``shard_params`` (expert buckets: the expert
        shard rank)."""
        rank = self.expert_shard_rank if bucket.expert else self.shard_rank
        if rank is None:
            raise ValueError("no shard kept: shard_params=False, or keep_shard not called")
        return rank

    def _cut(self, bucket: Bucket) -> None:
        lo, hi = self.shard(bucket, self.kept_rank(bucket))
        self.shard_view(bucket.index).copy_(
            self.bucket_data[bucket.index][lo - bucket.start:hi - bucket.start])
        self.free_bucket(bucket.index)

    @torch.no_grad()
    def keep_shard(self, rank: int, expert_rank: int | None = None) -> None:
        """``shard_params``: copy shard ``rank`` of every full dense bucket (``expert_rank``,
        default ``rank``, of every expert bucket) into ``shard_data`` and free the buckets
        (no-op when the shard was kept at construction)."""
        if not self.shard_params:
            raise ValueError("keep_shard needs shard_params=True")
        expert_rank = rank if expert_rank is None else expert_rank
        if self.shard_data is not None:
            if (self.shard_rank, self.expert_shard_rank) != (rank, expert_rank):
                raise ValueError(f"the buffers keep rank {self.shard_rank}'s shard (expert "
                                 f"shard {self.expert_shard_rank}), not rank {rank}'s "
                                 f"(expert shard {expert_rank})")
            return
        self.shard_rank, self.expert_shard_rank = rank, expert_rank
        self._new_shard()
        for bucket in self.buckets:
            self._cut(bucket)

    def shard_view(self, index: int) -> torch.Tensor:
        """``shard_params``: bucket ``index``'s persistent shard, a [L_i] view of shard_data."""
        if self.shard_data is None:
            raise ValueError("no persistent shard: shard_params=False, or keep_shard not called")
        lo, hi = self._shard_offsets[index], self._shard_offsets[index + 1]
        return self.shard_data[lo:hi]

    def is_gathered(self, index: int) -> bool:
        """``shard_params``: whether bucket ``index``'s full storage is allocated."""
        return self.bucket_data[index].untyped_storage().nbytes() > 0

    def alloc_bucket(self, index: int) -> torch.Tensor:
        """Allocate bucket ``index``'s full storage (values undefined until written): its
        [numel_i] tensor, the same object and storage its parameters view."""
        data = self.bucket_data[index]
        nbytes = data.numel() * data.element_size()
        storage = data.untyped_storage()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return data

    def free_bucket(self, index: int) -> None:
        """Release bucket ``index``'s full storage (its parameter views stay, empty)."""
        self.bucket_data[index].untyped_storage().resize_(0)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of full bucket storage allocated now (``shard_params``)."""
        return sum(d.untyped_storage().nbytes() for d in self.bucket_data)

    def hook_grads(self, on_grad: Callable[[nn.Parameter], None]) -> None:
        """Call the bound method ``on_grad(param)`` after each parameter's gradient is
        accumulated (``register_post_accumulate_grad_hook``), for as long as its object lives.

        The hook holds the object weakly: a hook is stored in the parameter's C++ state, out of
        Python's sight, so a strong reference would make parameter -> hook -> object ->
        buffers -> parameter a cycle no collection can free, and every wrapper built in a
        process (a test, a notebook, a calibration) would keep its model, buffers and process
        groups alive for good. Once the object is gone the hook does nothing."""
        method = weakref.WeakMethod(on_grad)  # type: ignore[arg-type]

        def hook(param: torch.Tensor) -> None:
            bound = method()
            if bound is not None:
                bound(param)  # type: ignore[arg-type]

        for p in self.params:
            p.register_post_accumulate_grad_hook(hook)

    def slot(self, param: nn.Parameter) -> Slot:
        """The slot of ``param`` (KeyError naming it when it is not in the buffers)."""
        try:
            return self.slots[id(param)]
        except KeyError:
            raise KeyError(f"parameter {param_key(param)} is not in the data-parallel "
                           "buffers") from None

    def shard(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """[lo, hi) of ``bucket`` owned by shard ``rank`` (the whole bucket when unsharded);
        ``rank`` indexes the bucket's own shard group (expert-dp for an expert bucket)."""
        size = bucket.numel // self.count_of(bucket)
        return bucket.start + rank * size, bucket.start + (rank + 1) * size

    def owned_ranges(self, rank: int, expert_rank: int | None = None) -> list[tuple[int, int]]:
        """Ranges of the flat buffers this shard owns, merged where adjacent: shard ``rank`` of
        each dense bucket, shard ``expert_rank`` (default ``rank``) of each expert bucket."""
        out: list[tuple[int, int]] = []
        for bucket in self.buckets:
            own = expert_rank if bucket.expert and expert_rank is not None else rank
            lo, hi = self.shard(bucket, own)
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            elif hi > lo:
                out.append((lo, hi))
        return out

    def segments(self, lo: int, hi: int) -> list[tuple[nn.Parameter, int, int]]:
        """Parameters overlapping [lo, hi), each with the overlap [a, b) in buffer coordinates."""
        out = []
        for p in self.params:
            slot = self.slots[id(p)]
            a, b = max(lo, slot.start), min(hi, slot.end)
            if a < b:
                out.append((p, a, b))
        return sorted(out, key=lambda s: s[1])

    @property
    def padding(self) -> int:
        """Zero elements added so every bucket splits evenly (0 when unsharded)."""
        return self.numel - self.num_params


def bucket_users(chunk: nn.Module, slots: dict[int, Slot]
                 ) -> list[tuple[nn.Module, list[int], bool]]:
    """The modules of ``chunk`` whose forward reads weights held in the buffers (``slots``), in
    module (forward) order: (module, the buckets it reads, whether it runs its own forward).

    A module reads its own parameters and those of its ``direct_children`` (fused sibling
    linears whose weights the parent reads without calling them: such a child never runs its
    own forward). A layer compiled by training.compile reads all its parameters and its
    descendants are left out: a hook inside the compiled graph would be traced, its bucket
    numbers becoming per-layer constants (a recompilation per layer). ZeRO-1's gather waits
    and ZeRO-3's gathers hook exactly these modules."""
    inside: set[int] = set()  # descendants of a compiled layer (its hook covers them)
    children: set[int] = set()  # direct_children: read by their parent, never called
    out: list[tuple[nn.Module, list[int], bool]] = []
    for module in chunk.modules():  # parents before children
        if id(module) in inside:
            continue
        if is_compiled(module):
            inside.update(id(m) for m in module.modules())
        params = list(module.parameters(recurse=is_compiled(module)))
        for name in getattr(module, "direct_children", ()):
            child = getattr(module, name, None)
            if child is not None:
                params += list(child.parameters())
                children.add(id(child))
        needed = sorted({slots[id(p)].bucket for p in params if id(p) in slots})
        if needed:
            out.append((module, needed, id(module) not in children))
    return out
