"""Compute an optimizer update in fp32 on states stored in a narrower dtype, chunk by chunk.

Precision-aware optimizer states (``optim.state_dtype='bf16'``, ``optim.master_dtype='bf16'``)
store some of an update's operands (master weights, Adam's m and v, Muon's momentum) in bf16
while the update itself runs in the compute dtype (fp32; the main gradients' dtype). Rather
than keeping fp32 copies of whole states, :class:`ChunkedCompute` walks the aligned flat
tensors in chunks of at most ``chunk`` elements (default :data:`CHUNK_ELEMENTS` = 2^20): for
each chunk it upcasts the narrow operands into fp32 workspaces, runs the update on them (the
fused AdamW kernel or the foreach form: any in-place function of the views), and rounds the
written operands back into their storage (``Tensor.copy_``: round to nearest, ties to even).
Operands already in the compute dtype (fp32 gradients, fp32 masters) are used in place.

Temporary memory is bounded and fixed: one [min(chunk, largest group)] workspace of the
compute dtype per narrow operand, allocated once, e.g. 3 x 4 MiB = 12 MiB for a bf16 master
with bf16 m and v at the default chunk (:attr:`ChunkedCompute.workspace_bytes`).

Shapes: every operand is a list of 1-D tensors, ``columns[k][i]`` of equal numel over k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

CHUNK_ELEMENTS = 1 << 20
"""Elements per chunk: bounds the fp32 workspace at 4 MiB per narrow operand."""

Span = tuple[int, int, int, int]  # (group, tensor index within the group, lo, hi)


def chunk_spans(groups: Sequence[Sequence[int]], chunk: int) -> list[list[Span]]:
    """Batches of spans covering every group's tensors (numels ``groups[g]``) in order; a batch
    holds at most ``chunk`` elements of one group (a tensor longer than that is split)."""
    batches: list[list[Span]] = []
    for g, sizes in enumerate(groups):
        batch: list[Span] = []
        room = chunk
        for i, n in enumerate(sizes):
            lo = 0
            while lo < n:
                take = min(room, n - lo)
                batch.append((g, i, lo, lo + take))
                lo, room = lo + take, room - take
                if room == 0:
                    batches.append(batch)
                    batch, room = [], chunk
        if batch:
            batches.append(batch)
    return batches


UpdateFn = Callable[[int, list[list[torch.Tensor]]], None]
"""``fn(group, views)``: update in place the compute-dtype ``views[k][j]`` (operand k, span j)."""


class ChunkedCompute:
    """Runs an in-place update in ``compute`` dtype over operands stored in other dtypes.

    ``groups[g][k]``: operand k of group g, a list of 1-D tensors (their numels give the plan;
    the tensors themselves are passed to :meth:`run` each time, so views re-cut per step are
    fine). ``dtypes[k]``: operand k's storage dtype (the same in every group).
    """

    def __init__(self, sizes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype],
                 compute: torch.dtype, device: torch.device,
                 chunk: int = CHUNK_ELEMENTS) -> None:
        self.batches = chunk_spans(sizes, chunk)
        self.compute = compute
        cap = max((sum(hi - lo for _, _, lo, hi in b) for b in self.batches), default=0)
        self.space = {k: torch.empty(cap, dtype=compute, device=device)  # [cap]
                      for k, dt in enumerate(dtypes) if dt != compute}
        """Operand index -> its fp32 workspace (narrow operands only)."""

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the fp32 workspaces (the update's only temporary memory beyond the kernel's)."""
        return sum(t.numel() * t.element_size() for t in self.space.values())

    @torch.no_grad()
    def run(self, groups: Sequence[Sequence[Sequence[torch.Tensor]]], written: Sequence[int],
            fn: UpdateFn) -> None:
        """For each chunk: upcast, ``fn(group, views)``, round the ``written`` operands back."""
        for batch in self.batches:
            g = batch[0][0]
            views: list[list[torch.Tensor]] = []
            stored: list[list[torch.Tensor]] = []
            for k, column in enumerate(groups[g]):
                parts = [column[i][lo:hi] for _, i, lo, hi in batch]
                stored.append(parts)
                space = self.space.get(k)
                if space is None:
                    views.append(parts)
                    continue
                temps = list(space[:sum(p.numel() for p in parts)].split(
                    [p.numel() for p in parts]))
                torch._foreach_copy_(temps, parts)
                views.append(temps)
            fn(g, views)
            for k in written:
                if k in self.space:
                    torch._foreach_copy_(stored[k], views[k])  # round to nearest (even)
