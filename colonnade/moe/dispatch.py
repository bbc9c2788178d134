"""Token dispatch and combine of a mixture-of-experts layer, and the capacity decision.

Notation: a rank holds t = s_l x b token rows x [t, h] (the [s_l, b] flattening, s major, b
minor), each routed to k experts: ``routing.expert`` [t, k] (global expert ids in [0, E)) with
combine weights ``routing.weight`` [t, k]. The ep group has n ranks; rank r holds the
E_l = E / n experts [r E_l, (r + 1) E_l).

Slots. Slot j = i k + c is token i's c-th choice; ``keep`` [t, k] (capacity, None = all)
removes dropped slots, leaving m kept slots. The dispatch order of the kept slots is a stable
sort by global expert id, ties by slot id, i.e. by token index then c::

    slots = kept slot ids sorted by (expert[slot], slot)          # [m]
    rows  = x[slots // k]                                          # [m, h]

so ``rows`` is expert-major and, since rank r's experts are contiguous, rank-major too.

Combine is the adjoint gather with the weights::

    out[i] = sum_{c: slot i k + c kept} weight[i, c] y[slot i k + c]     # [t, h]

(dropped slots add 0: the token keeps only its residual). It is computed by copying the
weighted rows w y into a zero [t k, h] buffer at their slot ids and summing over k, so every
token's sum runs over c in order (deterministic, no atomic adds). Both directions are plain
autograd (index_select / index_copy with distinct indices, see :func:`slot_rows`, so the
backward is deterministic too): gradients reach x, y and ``routing.weight``.

Dispatchers (:func:`make_dispatcher`), both exact and differentiable, giving the same rows in
the same order (expert-major, then source rank, then slot):

* 'all_to_all': the m rows are cut by destination rank (rank r gets the rows of its experts);
  the per-(rank, local expert) counts [n, E_l] are exchanged first (one small all-to-all of
  int64, 8 (n-1) E_l wire bytes) giving both split lists; the rows travel in one
  differentiable all-to-all (wire: rows sent to other ranks x h x itemsize, forward and again
  backward), and arrive source-major, each source's block expert-sorted: a stable sort by
  local expert turns them expert-major. Combine reverses it: un-sort, all-to-all back
  (splits swapped), weighted sum.
* 'all_gather': every rank all-gathers x (padded to T = max t over ep after an all-gather of
  the n sizes), the kept expert ids (dropped = -1) and the weights, keeps the slots of its own
  experts, and after the experts forms the weighted per-token sums of its experts' outputs for
  all n T gathered tokens; a reduce-scatter over ep adds the n ranks' contributions and hands
  each rank its own T rows. Wire bytes per rank (i_x, i_w the itemsizes of x and of the
  weights): forward gathers (n-1) (8 + T h i_x + T k i_w + 8 T k), reduce-scatter
  (n-1) T h i_x; backward the adjoint collectives (reduce-scatters of dx, dw: (n-1) T h i_x,
  (n-1) T k i_w; all-gather of dout: (n-1) T h i_x). Bytes grow with n: for small ep.

Capacity (:func:`capacity_keep`, ``model.moe_capacity_factor`` = c): each sequence (length s)
gives each expert C = ceil(c s k / E) slots, taken by its slots in order of token position,
then c; the rest are dropped. A sequence's rows are spread over the sequence group (tp under
sp, times cp), so the [t, k] expert ids are all-gathered over it (tp first, then cp; int64,
small) and every rank takes the same decision for the whole sequence, then reads its rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from colonnade.config.choices import MOE_DISPATCHERS
from colonnade.config.sections import ModelConfig
from colonnade.context_parallel.layout import zigzag_index, zigzag_order
from colonnade.parallel.all_to_all import all_to_all
from colonnade.parallel.comm import CommGroup
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.mappings import gather_seq, reduce_scatter_seq, seq_all_gather


class RoutedSlots(Protocol):
    """What dispatch reads of a routing (:class:`colonnade.moe.router.Routing`)."""

    expert: torch.Tensor
    """[t, k] int64 global expert ids."""
    weight: torch.Tensor
    """[t, k] combine weights."""


@dataclass
class DispatchHandle:
    """What :meth:`Dispatcher.combine` needs to undo a dispatch, plus the dispatch's counts."""

    slots: torch.Tensor
    """[m] int64 slot ids (row i k + c of the weight matrix the combine uses) of the rows this
    rank computes or sent, in dispatch order."""
    weight: torch.Tensor
    """[rows, k] combine weights indexed by ``slots`` (the local [t, k], or the gathered
    [n T, k] for 'all_gather')."""
    num_tokens: int
    """t: rows of the dispatched x."""
    dtype: torch.dtype
    """dtype of x (the combine's output dtype)."""
    counts_host: list[int]
    """Rows per local expert, [E_l] on the host (the grouped GEMM's row ranges)."""
    loads: torch.Tensor
    """[E] int64: this rank's kept slots per global expert (its share of the step's loads)."""
    routed: int
    """Slots routed by this rank (t k)."""
    dropped: int
    """Of those, dropped by the capacity (t k - kept)."""
    send_splits: list[int] = field(default_factory=list)
    """'all_to_all': rows sent to each ep rank."""
    recv_splits: list[int] = field(default_factory=list)
    """'all_to_all': rows received from each ep rank."""
    unsort: torch.Tensor | None = None
    """'all_to_all': [t_e] position in the expert-major rows of each received row."""
    padded: int = 0
    """'all_gather': T, the rows every rank contributes (max t over ep)."""


def sort_slots(expert: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """expert [t, k], keep [t, k] bool | None -> (slots [m] int64, their experts [m]):
    the kept slot ids i k + c stably sorted by expert id (ties: token, then c)."""
    flat = expert.reshape(-1)  # [t k]
    ids = torch.arange(flat.numel(), device=flat.device)  # [t k]
    if keep is not None:
        ids = ids[keep.reshape(-1)]  # [m]
        flat = flat[ids]
    sorted_expert, order = torch.sort(flat, stable=True)  # [m]
    return ids[order], sorted_expert


def slot_rows(x: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
    """x [t, h], slots [m] (ids i k + c, distinct) -> rows x[slot // k] [m, h].

    Read through the slot-expanded [t k, h] copy of x so that every index is distinct: the
    backward is then a collision-free index_add followed by a sum over k, deterministic on
    every device (gathering x[slot // k] directly would accumulate a token's k copies with
    atomic adds on CUDA).
    """
    t, h = x.shape
    return x.unsqueeze(1).expand(t, k, h).reshape(t * k, h).index_select(0, slots)  # [m, h]


def weighted_sum(y: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """out[i] = sum_c weight[i, c] y[row of slot i k + c] (0 for slots absent from ``slots``).

    y [m, h] rows of ``slots`` [m], weight [t, k] -> [t, h] in ``dtype``; the products and the
    sum run in the promoted dtype of y and weight (fp32 weights keep a bf16 sum accurate).
    """
    t, k = weight.shape
    w = weight.reshape(-1).index_select(0, slots)  # [m]
    dt = torch.promote_types(y.dtype, w.dtype)
    contrib = y.to(dt) * w.to(dt).unsqueeze(1)  # [m, h]
    buf = contrib.new_zeros((t * k, y.shape[1])).index_copy(0, slots, contrib)  # [t k, h]
    return buf.view(t, k, -1).sum(dim=1).to(dtype)  # [t, h]


class Dispatcher:
    """Moves token rows to the ranks of their experts and back (see the module docstring)."""

    kind = ""

    def __init__(self, ep: CommGroup, num_experts: int) -> None:
        if num_experts % ep.size:
            raise ValueError(f"model.num_experts={num_experts} must be divisible by "
                             f"parallel.ep={ep.size}; change either")
        self.ep, self.num_experts = ep, num_experts
        self.local_experts = num_experts // ep.size
        """E_l: experts on this rank, [ep_rank E_l, (ep_rank + 1) E_l)."""

    def dispatch(self, x: torch.Tensor, routing: RoutedSlots, keep: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """x [t, h] -> (tokens [t_e, h] sorted by local expert, counts [E_l] int64, handle)."""
        raise NotImplementedError

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y [t_e, h] (expert outputs of the dispatched tokens) -> [t, h] weighted sums."""
        raise NotImplementedError


class AllToAllDispatcher(Dispatcher):
    """'all_to_all': each slot's row goes to its expert's rank only (bytes ~ t k h)."""

    kind = "all_to_all"

    def dispatch(self, x: torch.Tensor, routing: RoutedSlots, keep: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """x [t, h] -> (tokens [t_e, h] expert-major, counts [E_l], handle)."""
        t, k = routing.expert.shape
        n, e_l = self.ep.size, self.local_experts
        slots, sorted_expert = sort_slots(routing.expert, keep)  # [m]
        loads = torch.bincount(sorted_expert, minlength=self.num_experts)  # [E]
        rows = slot_rows(x, slots, k)  # [m, h]
        handle = DispatchHandle(slots, routing.weight, t, x.dtype, [], loads, t * k,
                                t * k - slots.numel())
        if n == 1:
            handle.counts_host = [int(v) for v in loads.tolist()]
            return rows, loads, handle
        send_counts = loads.view(n, e_l).contiguous()  # [n, E_l]: block j -> rank j
        recv_counts = torch.empty_like(send_counts)  # [n, E_l]: from rank j, per local expert
        self.ep.all_to_all(recv_counts, send_counts, name="moe_counts")
        host = torch.cat([send_counts.sum(1), recv_counts.reshape(-1)]).tolist()  # one sync
        handle.send_splits = [int(v) for v in host[:n]]
        recv_host = [[int(v) for v in host[n + j * e_l:n + (j + 1) * e_l]] for j in range(n)]
        handle.recv_splits = [sum(row) for row in recv_host]
        handle.counts_host = [sum(row[i] for row in recv_host) for i in range(e_l)]
        recv = all_to_all(rows, self.ep, handle.send_splits, handle.recv_splits,
                          name="moe_dispatch")  # [t_e, h] source-major
        local = torch.arange(e_l, device=x.device).repeat(n)  # [n E_l]
        row_expert = local.repeat_interleave(recv_counts.reshape(-1),
                                             output_size=recv.shape[0])  # [t_e]
        order = torch.sort(row_expert, stable=True).indices  # [t_e] expert-major -> received
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        handle.unsort = unsort
        counts = recv_counts.sum(0)  # [E_l]
        return recv.index_select(0, order), counts, handle

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y [t_e, h] expert-major -> [t, h]: un-sort, all-to-all back, weighted sum."""
        if self.ep.size > 1:
            assert handle.unsort is not None
            y = y.index_select(0, handle.unsort)  # [t_e, h] source-major
            y = all_to_all(y, self.ep, handle.recv_splits, handle.send_splits,
                           name="moe_combine")  # [m, h] in dispatch order
        return weighted_sum(y, handle.slots, handle.weight, handle.dtype)


def _gather(x: torch.Tensor, group: CommGroup, name: str) -> torch.Tensor:
    """Differentiable all-gather along dim 0 (x itself for a group of one)."""
    return gather_seq(x, group, name, f"{name}_grad")


def _pad_rows(x: torch.Tensor, rows: int, value: float = 0.0) -> torch.Tensor:
    """[t, c] -> [rows, c] (appended rows = ``value``; differentiable)."""
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, rows - x.shape[0]), value=value)


class AllGatherDispatcher(Dispatcher):
    """'all_gather': every rank sees every token of the ep group (bytes ~ n t h)."""

    kind = "all_gather"

    def _padded_rows(self, t: int, device: torch.device) -> int:
        """T = max t over the ep group (one all-gather of n int64)."""
        sizes = seq_all_gather(torch.tensor([t], dtype=torch.int64, device=device), self.ep,
                               "moe_sizes")  # [n]
        return int(sizes.max())

    def dispatch(self, x: torch.Tensor, routing: RoutedSlots, keep: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """x [t, h] -> (tokens [t_e, h] expert-major, counts [E_l], handle)."""
        t, k = routing.expert.shape
        e_l, lo = self.local_experts, self.ep.rank * self.local_experts
        ids = routing.expert if keep is None else routing.expert.masked_fill(~keep, -1)
        kept = ids[ids >= 0]
        loads = torch.bincount(kept, minlength=self.num_experts)  # [E]
        big_t = self._padded_rows(t, x.device) if self.ep.size > 1 else t
        gx = _gather(_pad_rows(x, big_t), self.ep, "moe_gather_x")  # [n T, h]
        gw = _gather(_pad_rows(routing.weight, big_t), self.ep, "moe_gather_w")  # [n T, k]
        gids = seq_all_gather(_pad_rows(ids, big_t, -1), self.ep, "moe_gather_ids")  # [n T, k]
        flat = gids.reshape(-1)  # [n T k]
        cand = torch.nonzero((flat >= lo) & (flat < lo + e_l)).squeeze(1)  # [t_e]
        sorted_local, order = torch.sort(flat[cand] - lo, stable=True)
        slots = cand[order]  # [t_e] gathered slot ids, expert-major
        counts = torch.bincount(sorted_local, minlength=e_l)  # [E_l]
        handle = DispatchHandle(slots, gw, t, x.dtype, [int(v) for v in counts.tolist()],
                                loads, t * k, t * k - kept.numel(), padded=big_t)
        tokens = slot_rows(gx, slots, k)  # [t_e, h]
        return tokens, counts, handle

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y [t_e, h] -> [t, h]: this rank's weighted sums for all n T gathered tokens, summed
        over ep by a reduce-scatter that returns each rank its own T rows."""
        full = weighted_sum(y, handle.slots, handle.weight, handle.dtype)  # [n T, h]
        if self.ep.size == 1:
            return full
        out = reduce_scatter_seq(full, self.ep, "moe_combine", "moe_combine_grad")  # [T, h]
        return out[: handle.num_tokens]


def make_dispatcher(kind: str, ep: CommGroup, num_experts: int) -> Dispatcher:
    """The dispatcher named by ``parallel.moe_dispatcher`` over the ep group."""
    classes: dict[str, type[Dispatcher]] = {"all_to_all": AllToAllDispatcher,
                                            "all_gather": AllGatherDispatcher}
    if kind not in MOE_DISPATCHERS or kind not in classes:
        raise ValueError(f"parallel.moe_dispatcher={kind!r} is not one of {MOE_DISPATCHERS}")
    return classes[kind](ep, num_experts)


def capacity_slots(cfg: ModelConfig, seq_len: int) -> int:
    """C = ceil(c s k / E): slots each expert takes of one sequence of ``seq_len`` tokens."""
    assert cfg.moe_capacity_factor is not None
    return math.ceil(cfg.moe_capacity_factor * seq_len * cfg.moe_top_k / cfg.num_experts)


def capacity_decision(ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """ids [s, b, k] (whole sequences, natural order) -> keep [s, b, k] bool.

    Per sequence and expert the slots are ranked in (position, c) order; rank < capacity is
    kept. Ranks come from one stable sort of key = sequence E + expert over the slots in
    (sequence, position, c) order: rank = sorted index - start of the key's group.
    """
    s, b, k = ids.shape
    seq = ids.permute(1, 0, 2).reshape(b, s * k)  # [b, s k] (position, c) order
    key = (torch.arange(b, device=ids.device).unsqueeze(1) * num_experts + seq).reshape(-1)
    sorted_key, order = torch.sort(key, stable=True)  # [b s k]
    sizes = torch.bincount(key, minlength=b * num_experts)  # [b E]
    starts = torch.cumsum(sizes, 0) - sizes  # [b E]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=ids.device) - starts[sorted_key]
    return (rank < capacity).view(b, s, k).permute(1, 0, 2)  # [s, b, k]


def capacity_keep(routing: RoutedSlots, cfg: ModelConfig, ctx: ParallelContext, s_local: int,
                  b: int) -> torch.Tensor | None:
    """keep [t, k] bool (t = s_local b) by the capacity rule; None when dropless.

    The expert ids [s_l, b, k] are all-gathered over tp under sp (giving the cp rank's
    s / cp rows in local order) and over cp (the zigzag chunks of every cp rank, put back in
    natural order by :func:`~colonnade.context_parallel.layout.zigzag_order`); every rank
    decides the whole sequences (:func:`capacity_decision`) and keeps its own rows.
    """
    if cfg.moe_capacity_factor is None:
        return None
    k = routing.expert.shape[1]
    ids = routing.expert.reshape(s_local, b, k)  # [s_l, b, k]
    sp_tp = ctx.sp and ctx.tp > 1
    if sp_tp:
        ids = seq_all_gather(ids, ctx.group, "moe_capacity_ids")  # [s/cp, b, k]
    cp, cp_rank = ctx.cp_size, ctx.cp_rank
    if cp > 1:
        assert ctx.cp is not None
        ids = seq_all_gather(ids, ctx.cp, "moe_capacity_ids")  # [s, b, k] zigzag chunks
    s = ids.shape[0]
    natural = ids
    positions = torch.arange(s, device=ids.device)  # [s/cp] global position of local rows
    if cp > 1:
        natural = torch.empty_like(ids)
        natural[zigzag_order(s, cp, ids.device)] = ids  # [s, b, k] natural order
        positions = zigzag_index(s, cp, cp_rank, ids.device)
    keep = capacity_decision(natural, cfg.num_experts, capacity_slots(cfg, s))  # [s, b, k]
    if sp_tp:
        positions = positions[ctx.tp_rank * s_local:(ctx.tp_rank + 1) * s_local]  # [s_l]
    return keep[positions].reshape(s_local * b, k)  # [t, k]
