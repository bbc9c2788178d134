"""Mixed-precision AdamW over the data-parallel flat buffers; ZeRO-1 when they are sharded.

The optimizer works on *ranges* of the flat buffers of a :class:`DataParallel`:
  * DDP:    one range, the whole buffer; every dp rank updates every parameter.
  * ZeRO-1: this dp rank's range of each bucket (1/dp of it); after the update the ranges are
            all-gathered back into the parameter buffer (:meth:`DataParallel.start_param_gather`).
For each range it keeps Adam moments m, v in ``optim.state_dtype`` (fp32, or bf16; fp64 for
fp64 models) and, when the model is bf16/fp16 and ``optim.master_dtype`` is fp32, an fp32 master
copy of the weights. Bytes per owned element (:meth:`DistributedOptimizer.state_bytes`, the
formula of :func:`colonnade.analysis.memory.optimizer_bytes_per_element`):
    master M: 4 for a 16-bit model with fp32 masters, else 0 (the parameters are the masters:
              fp32 / fp64 models, or master_dtype='bf16' on a bf16 model);
    m, v:     2 S, S = 4 fp32 states, 2 bf16 states, 8 for fp64 models (a Muon matrix's
              element: its momentum, S);
    e.g. 12 (bf16 model, fp32 everything), 8 (fp32 model), 8 (bf16 model, bf16 states),
    4 (bf16 model, bf16 states and masters), 16 (fp64).
The update computes in fp32 (fp64) whatever the storage (:mod:`colonnade.optim.chunked`: bf16
operands are upcast 2^20 elements at a time into fixed fp32 workspaces, at most 12 MiB for
AdamW and 8 MiB for Muon (momentum, masters), and rounded to nearest back). With ZeRO-1 the
owned elements are (params + padding) / dp, padding < buckets x dp x ALIGN (see
:mod:`colonnade.data_parallel.buffer`).

Step: global norm of the (scaled) main gradients (:mod:`colonnade.optim.clip`), unscaled by the
loss scale S; inf/NaN anywhere (fp16: any rank of the world) skips the step and backs S off;
otherwise AdamW updates the masters with the scheduled LR from the gradients times
clip_coefficient / S (:class:`colonnade.optim.adamw.FlatAdamW`: with the fused kernel the main
gradients are multiplied by that coefficient in place first when it is not 1), with
optim.qk_clip_threshold > 0 the q/k rows of the masters are clipped
(:mod:`colonnade.optim.qk_clip`), masters are cast into the parameter buffer and (ZeRO-1)
gathered.

Muon (optim.name='muon', :mod:`colonnade.optim.muon`): the owned elements of the Muon matrices
(``muon_matrices``) leave AdamW's lists and get :class:`~colonnade.optim.muon.FlatMuon`'s
update, after AdamW's and with the same coefficient, LR and weight decay. The states are
compact: exp_avg and exp_avg_sq [owned AdamW elements], momentum [owned Muon elements], each in
owned-range order (:class:`_Compact` maps an interval of the owned ranges to its slice), so a
Muon element costs one moment where an AdamW element costs two.

ZeRO-2/3: the gradients are the shard views ``DataParallel.owned_grads`` (already averaged
and complete after the sync) and the parameters ``DataParallel.owned_params``; at stage 3 these
are the persistent parameter shard itself, so an fp32 / fp64 model's master *is* the shard and a
bf16 model's masters are cast into it after the update (written values are seen by the next
gather). The norm is summed over tp, pp and the shard group (not hybrid sharding's replicas).

Mixture of experts (``ddp.expert_group`` given): the owned ranges include this rank's expert
buckets (its expert-dp shard of them under ZeRO, so the expert optimizer state, and at stages
2/3 the expert gradients and parameters, are sharded over expert-dp). The squared norm is two
sums, each counting every element once:
    ||g||^2 = sum_dense g^2 (over tp, pp [, the dense shard group])
            + sum_expert g^2 (over ep, pp [, the expert shard group with ZeRO])
An expert weight is split over ep and replicated over expert-dp (identical reduced gradients),
so without ZeRO each rank counts all its local experts and only ep and pp are summed over.
Both sums are taken on every rank of an MoE model (pipeline stages without expert layers add
0), so the collectives match; the inf/NaN check sees the expert gradients through the norm.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Any

import torch
import torch.distributed as dist

from colonnade.config.sections import OptimConfig
from colonnade.data_parallel.buffer import is_expert_param, param_key
from colonnade.data_parallel.ddp import DataParallel
from colonnade.optim.adamw import AdamWGroup, AdamWHyper, FlatAdamW, decays
from colonnade.optim.clip import clip_coefficient, global_sq, owns_grad
from colonnade.optim.lr import lr_at
from colonnade.optim.muon import (
    FlatMuon,
    MuonHyper,
    MuonSlot,
    describe_split,
    make_orthogonalizer,
    muon_matrices,
    split_matrices,
)
from colonnade.optim.qk_clip import QKClip
from colonnade.optim.scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from colonnade.parallel.comm import CommGroup
from colonnade.parallel.groups import ProcessGroups
from colonnade.tensor_parallel.sharding import Coords, tp_coords

Interval = tuple[int, int, int]  # (range index, lo, hi) relative to the range start


def _merge(intervals: list[Interval]) -> list[Interval]:
    """Join intervals of the same range that touch."""
    out: list[Interval] = []
    for i, lo, hi in intervals:
        if out and out[-1][0] == i and out[-1][2] == lo:
            out[-1] = (i, out[-1][1], hi)
        else:
            out.append((i, lo, hi))
    return out


def _cut(flats: list[torch.Tensor], intervals: list[Interval]) -> list[torch.Tensor]:
    """The views ``flats[i][a:b]`` of ``intervals``; a whole tensor is taken as it is (no view
    op: direct gradients re-cut every parameter's gradient each step)."""
    return [flats[i] if a == 0 and b == flats[i].numel() else flats[i][a:b]
            for i, a, b in intervals]


class _Compact:
    """Intervals of the owned ranges stored back to back in a compact flat tensor (the
    AdamW moments of the AdamW elements only, the Muon momentum of the Muon elements)."""

    def __init__(self, intervals: list[Interval]) -> None:
        self.intervals = intervals
        self.starts = [(i, lo) for i, lo, _ in intervals]
        self.offsets = list(itertools.accumulate((hi - lo for _, lo, hi in intervals),
                                                 initial=0))
        self.numel = self.offsets[-1]

    def views(self, flat: torch.Tensor, intervals: list[Interval] | None = None
              ) -> list[torch.Tensor]:
        """Views of ``flat`` [numel] holding ``intervals`` (default: all), each inside one of
        this index's intervals."""
        if intervals is None:
            return list(flat.split([hi - lo for _, lo, hi in self.intervals]))
        out = []
        for i, a, b in intervals:
            k = bisect.bisect_right(self.starts, (i, a)) - 1
            _, lo, hi = self.intervals[k]
            assert self.intervals[k][0] == i and lo <= a and b <= hi, (i, a, b)
            start = self.offsets[k] + a - lo
            out.append(flat[start:start + b - a])
        return out


def make_scaler(precision: str, cfg: OptimConfig) -> LossScaler:
    """Dynamic scaler for fp16, constant 1 otherwise."""
    if precision == "fp16":
        return DynamicLossScaler(scale=cfg.initial_loss_scale, window=cfg.loss_scale_window,
                                 min_scale=cfg.min_loss_scale)
    return ConstantLossScaler()


class DistributedOptimizer:
    """AdamW (and Muon's matrices with optim.name='muon') on this rank's ranges of the flat
    buffers (all of them unless ZeRO)."""

    def __init__(self, ddp: DataParallel, cfg: OptimConfig, groups: ProcessGroups,
                 total_steps: int, precision: str = "fp32", qk_clip: QKClip | None = None
                 ) -> None:
        self.ddp, self.cfg, self.groups, self.total_steps = ddp, cfg, groups, total_steps
        self.qk_clip = qk_clip
        """q/k logit clipping after each update (optim.qk_clip_threshold > 0), else None."""
        buffers = ddp.buffers
        self.ranges = ddp.owned_ranges()
        dtype = buffers.grad_dtype  # the compute dtype: fp32 (fp64 for fp64 models)
        self.state_dtype = torch.bfloat16 if cfg.state_dtype == "bf16" else dtype
        """Storage of m and v (optim.state_dtype; fp64 runs keep fp64, the validator says)."""
        self.own_masters = buffers.param_dtype != dtype and cfg.master_dtype != "bf16"
        numel = sum(hi - lo for lo, hi in self.ranges)
        self.device = device = buffers.device
        self.params = ddp.owned_params()
        """Parameter-dtype views aligned with ``ranges`` (ZeRO-3: the persistent shard)."""
        self.grads: list[torch.Tensor] = ddp.owned_grads()
        """Main-gradient views aligned with ``ranges``."""
        self.master_flat = (torch.empty(numel, dtype=dtype, device=device)  # [shard]
                            if self.own_masters else None)
        self.masters: list[torch.Tensor] = []
        offset = 0
        for (lo, hi), values in zip(self.ranges, self.params, strict=True):
            n = hi - lo
            if self.master_flat is not None:
                master = self.master_flat[offset:offset + n]
                master.copy_(values)
            else:
                master = values  # fp32 / fp64 models: the parameter storage is the master
            self.masters.append(master)
            offset += n
        self.experts = ddp.expert_group is not None
        """Whether the model has expert parameters (a second, expert norm sum is taken)."""
        expert_coords = {"ep": (max(groups.ep.rank, 0), groups.ep.size)} if (
            groups.ep is not None) else {}
        if groups.expert_tp is not None:
            expert_coords["tp"] = (max(groups.expert_tp.rank, 0), groups.expert_tp.size)
        self.muon_hyper = MuonHyper.of(cfg) if cfg.name == "muon" else None
        """The Muon settings (None: AdamW updates every element)."""
        self._index_segments(tp_coords(groups.tp.rank, groups.tp.size), expert_coords)
        self.adamw_index = _Compact(self.adamw_intervals)
        self.muon_index = _Compact(self.muon_intervals)
        self.exp_avg_flat = torch.zeros(self.adamw_index.numel, dtype=self.state_dtype,
                                        device=device)  # [owned AdamW elements]
        self.exp_avg_sq_flat = torch.zeros_like(self.exp_avg_flat)  # [owned AdamW elements]
        self.momentum_flat = torch.zeros(self.muon_index.numel, dtype=self.state_dtype,
                                         device=device)  # [owned Muon elements]
        self.exp_avgs = self.adamw_index.views(self.exp_avg_flat)
        self.exp_avg_sqs = self.adamw_index.views(self.exp_avg_sq_flat)
        self.adamw = FlatAdamW(_cut(self.masters, self.adamw_intervals),
                               _cut(self.grads, self.adamw_intervals), self.exp_avgs,
                               self.exp_avg_sqs, self.decayed, self._decay_groups(),
                               compute=dtype)
        self.muon: FlatMuon | None = None
        """The Muon update of the Muon elements (None for optim.name='adamw')."""
        if self.muon_hyper is not None:
            muon_iv = [iv for _, iv in self.muon_slots]
            self.muon = FlatMuon([s for s, _ in self.muon_slots], _cut(self.masters, muon_iv),
                                 _cut(self.grads, muon_iv),
                                 self.muon_index.views(self.momentum_flat, muon_iv),
                                 make_orthogonalizer(ddp, groups), self.muon_hyper)
        self.scaler: LossScaler = make_scaler(precision, cfg)
        self.norm_groups = [groups.tp, groups.pp] + ([ddp.group] if ddp.sharded else [])
        """Groups the squared norms are summed over: tp, pp and (ZeRO) the shard group, not
        hybrid sharding's replicate group (the replicas hold the same shard)."""
        self.expert_norm_groups: list[CommGroup] = []
        """Groups the expert squared norm is summed over: ep, expert tp (slices of the same
        experts), pp and (ZeRO) the expert shard group (expert-dp, or its hybrid shard group:
        not the expert replicas)."""
        if self.experts:
            assert groups.ep is not None and ddp.expert_group is not None
            expert_shard = ddp.shard_groups.expert
            assert expert_shard is not None
            etp = [groups.expert_tp] if groups.expert_tp is not None else []
            self.expert_norm_groups = [groups.ep, *etp, groups.pp] + (
                [expert_shard] if ddp.sharded else [])
        self.step_count = 0
        self.rider_values: list[float] = []
        """Host values of the last :meth:`step`'s ``riders`` (read with the gradient norm)."""
        self.state_start = 0
        """``step_count`` when the state started from zero (a resume that switched optimizer,
        ``checkpoint.optimizer_switch='reset'``); AdamW's bias correction counts from it."""

    def _index_segments(self, coords: Coords, expert_coords: Coords) -> None:
        """Intervals of the owned ranges by update (Muon pieces; AdamW: decayed matrices, the
        rest with the padding), views for weight decay, the norm (owned grads: dense, expert)
        and the inf check (rest); an expert parameter's ownership is judged on
        ``expert_coords``."""
        decayed: list[Interval] = []
        plain: list[Interval] = []  # AdamW without decay: vectors and padding
        self.muon_slots: list[tuple[MuonSlot, Interval]] = []
        """Each owned piece of a Muon matrix and its interval of the owned ranges."""
        counted: list[Interval] = []
        expert: list[Interval] = []
        rest: list[Interval] = []
        for i, (lo, hi) in enumerate(self.ranges):
            cursor = lo
            for p, a, b in self.ddp.buffers.segments(lo, hi):
                if a > cursor:
                    plain.append((i, cursor - lo, a - lo))
                cursor = b
                interval = (i, a - lo, b - lo)
                if self.muon_hyper is not None and muon_matrices(p) is not None:
                    self._add_muon_slots(p, i, a - lo, b - lo)
                else:
                    (decayed if decays(p) else plain).append(interval)
                if is_expert_param(p):
                    (expert if owns_grad(p, expert_coords) else rest).append(interval)
                else:
                    (counted if owns_grad(p, coords) else rest).append(interval)
            if hi > cursor:
                plain.append((i, cursor - lo, hi - lo))
        self.decayed_intervals = _merge(decayed)
        """AdamW's decayed intervals (its matrices)."""
        self._plain_intervals = _merge(plain)
        self.adamw_intervals = _merge(sorted(decayed + plain))
        """The intervals AdamW updates (everything but the Muon pieces)."""
        self.muon_intervals = _merge([iv for _, iv in self.muon_slots])
        """The intervals Muon updates."""
        self.decayed = _cut(self.masters, self.decayed_intervals)
        self._norm_intervals = (_merge(counted), _merge(expert), _merge(rest))
        self._grad_views()

    def _add_muon_slots(self, p: torch.nn.Parameter, i: int, a: int, b: int) -> None:
        """The Muon pieces of ``p`` in range ``i``'s interval [a, b) (one per expert matrix
        of a stacked weight)."""
        start = self.ddp.buffers.slot(p).start - self.ranges[i][0]  # p's offset in range i
        for index, lo, hi, base in split_matrices(p, a - start, b - start):
            at = start + base  # the matrix's offset in range i
            self.muon_slots.append((MuonSlot(p, index, lo, hi), (i, at + lo, at + hi)))

    def _grad_views(self) -> None:
        """The gradient views the norm reads (counted, expert, the rest), cut from ``grads``."""
        self.counted, self.expert_counted, self.uncounted = (
            _cut(self.grads, intervals) for intervals in self._norm_intervals)

    def _take_step_grads(self) -> None:
        """Direct gradients (``DataParallel.direct_grads``): point every gradient list at this
        step's ``param.grad`` tensors (autograd makes new ones each step; nothing is copied)."""
        self.grads[:] = self.ddp.step_grads()
        self._grad_views()
        self.adamw.grads[:] = _cut(self.grads, self.adamw_intervals)
        for group, intervals in zip(self.adamw.groups, self._group_intervals, strict=True):
            group.grads[:] = _cut(self.grads, intervals)
        if self.muon is not None:
            self.muon.grads[:] = _cut(self.grads, [iv for _, iv in self.muon_slots])

    def _decay_groups(self) -> list[AdamWGroup]:
        """AdamW's intervals split into decayed pieces and the rest (padding included), as
        aligned views of masters, gradients and moments: the fused kernel's two calls."""
        def group(intervals: list[Interval], decay: bool) -> AdamWGroup:
            return AdamWGroup(_cut(self.masters, intervals), _cut(self.grads, intervals),
                              self.adamw_index.views(self.exp_avg_flat, intervals),
                              self.adamw_index.views(self.exp_avg_sq_flat, intervals), decay)

        pairs = [(self.decayed_intervals, True), (self._plain_intervals, False)]
        self._group_intervals = [iv for iv, _ in pairs if iv]  # FlatAdamW keeps non-empty
        return [group(iv, decay) for iv, decay in pairs]

    def describe(self) -> str:
        """The optimizer and, for Muon, which of this rank's parameters each update takes:
        'adamw for every parameter' or 'muon: M matrices in T tensors (...) use Muon, ...'."""
        if self.muon is None:
            return f"{self.cfg.name} for every parameter"
        return (f"{self.cfg.name}: {describe_split(self.ddp.buffers.params)} on rank "
                f"{self.groups.world.rank}")

    @property
    def loss_scale(self) -> float:
        """The multiplier the step applies to the loss before backward (``StepPlan.loss_scale``)."""
        return float(self.scaler.scale)

    def zero_grad(self) -> None:
        """Zero the main gradients (the flat gradient buffer)."""
        self.ddp.zero_grad()

    def _sum_sq(self, views: list[torch.Tensor]) -> torch.Tensor:
        if not views:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch.stack(torch._foreach_norm(views))  # [len(views)]: one norm per view
        return norms.to(torch.float64).pow(2).sum()

    def grad_norm(self, riders: torch.Tensor | None = None) -> tuple[float, bool, list[float]]:
        """(global L2 norm of the unscaled gradients, whether any rank saw inf/NaN, the host
        values of ``riders``), with ONE device-to-host read for all of them.

        Each rank sums squares over the gradient entries it owns (tp-replicated parameters on
        tp rank 0, the tied head never, ZeRO-1 shards disjoint across dp) and the sums are
        all-reduced over tp, pp (and dp with ZeRO-1); an MoE model adds the expert sum
        (all-reduced over ep, pp and, with ZeRO-1, expert-dp: see the module docstring).
        With fp16's dynamic scaler every rank's verdict (its global norm or its uncounted
        gradients non-finite) is MAX-reduced over the world on the device first. ``riders``
        (a float64 [r] device tensor, e.g. the step's loss reduction) ride on the same read.

        This read is the step's one host synchronisation: the update is skipped (and fp16's
        scale backed off) on the host's decision, and clipping's coefficient is a host float.
        """
        total = global_sq(self._sum_sq(self.counted), self.norm_groups)
        if self.experts:
            total = total + global_sq(self._sum_sq(self.expert_counted),
                                      self.expert_norm_groups)
        parts = [total.sqrt().reshape(1)]  # [1] float64
        dynamic = isinstance(self.scaler, DynamicLossScaler)
        if dynamic:
            bad = ~torch.isfinite(total) | ~torch.isfinite(self._sum_sq(self.uncounted))
            flag = bad.to(torch.float64).reshape(1)  # [1]
            self.groups.world.all_reduce(flag, op=dist.ReduceOp.MAX, name="found_inf")
            parts.append(flag)
        if riders is not None:
            parts.append(riders.to(torch.float64).reshape(-1))
        host = torch.cat(parts).tolist()  # the one read
        norm = host[0] / self.scaler.scale
        if dynamic:
            return norm, host[1] > 0, host[2:]
        return norm, not math.isfinite(norm), host[1:]

    def step(self, riders: torch.Tensor | None = None) -> dict[str, float]:
        """One update (or a skipped one); returns grad_norm, lr, loss_scale, skipped. The host
        values of ``riders`` (float64 [r] on the device) are read with the gradient norm (one
        read) and left in :attr:`rider_values`."""
        if self.ddp.direct_grads:
            self._take_step_grads()
        norm, found_inf, self.rider_values = self.grad_norm(riders)
        lr = lr_at(self.step_count, self.total_steps, self.cfg)
        scale = self.loss_scale
        info = {"grad_norm": norm, "lr": lr, "loss_scale": scale, "skipped": float(found_inf)}
        self.scaler.update(found_inf)
        if found_inf:
            return info
        coef = clip_coefficient(norm, self.cfg.clip_grad) / scale
        hp = AdamWHyper(lr, self.cfg.beta1, self.cfg.beta2, self.cfg.eps, self.cfg.weight_decay)
        self.adamw.update(self.step_count + 1 - self.state_start, hp, grad_scale=coef)
        if self.muon is not None:
            self.muon.update(lr, self.cfg.weight_decay, grad_scale=coef)
        if self.qk_clip is not None:  # MuonClip: scale q/k rows of the masters
            info["qk_clipped"] = self.qk_clip.apply(self.ddp.buffers, self.ranges, self.masters)
        if self.own_masters:
            self._copy_masters()
        self.ddp.start_param_gather()
        self.step_count += 1
        return info

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: moments (AdamW's two per AdamW element,
        Muon's momentum per Muon element) plus master copies (when separate); the chunked
        update's fixed workspace (``adamw.chunked``) is not state."""
        tensors = [self.exp_avg_flat, self.exp_avg_sq_flat, self.momentum_flat]
        if self.master_flat is not None:
            tensors.append(self.master_flat)
        return sum(t.numel() * t.element_size() for t in tensors)

    def shard_state(self) -> list[tuple[str, int, int, dict[str, torch.Tensor]]]:
        """(param key, lo, hi, views) per owned piece: elements [lo, hi) of the flattened local
        (tp-shard) parameter, with views of its master and its moments: exp_avg and exp_avg_sq
        for an AdamW parameter, momentum for a Muon one (resharding)."""
        out = []
        buffers = self.ddp.buffers
        muon = set(map(id, (s.param for s, _ in self.muon_slots)))
        for i, (lo, hi) in enumerate(self.ranges):
            for p, a, b in buffers.segments(lo, hi):
                start = buffers.slot(p).start
                iv = [(i, a - lo, b - lo)]
                views = {"master": self.masters[i][a - lo:b - lo]}
                if id(p) in muon:
                    (views["momentum"],) = self.muon_index.views(self.momentum_flat, iv)
                else:
                    (views["exp_avg"],) = self.adamw_index.views(self.exp_avg_flat, iv)
                    (views["exp_avg_sq"],) = self.adamw_index.views(self.exp_avg_sq_flat, iv)
                out.append((param_key(p), a - start, b - start, views))
        return out

    def state_dict(self) -> dict[str, Any]:
        """Flat shard tensors, the layout they follow, the step counter and the scaler."""
        state: dict[str, Any] = {
            "step_count": self.step_count, "scaler": self.scaler.state_dict(),
            "ranges": list(self.ranges), "exp_avg": self.exp_avg_flat,
            "exp_avg_sq": self.exp_avg_sq_flat,
        }
        if self.muon is not None:
            state["momentum"] = self.momentum_flat
        if self.master_flat is not None:
            state["master"] = self.master_flat
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same layout (same buffers, same dp rank)."""
        if [tuple(r) for r in state["ranges"]] != self.ranges:
            raise ValueError("optimizer state was saved with a different bucket layout or dp "
                             "rank; reshard it through shard_state() instead")
        self.step_count = int(state["step_count"])
        self.scaler.load_state_dict(state["scaler"])
        with torch.no_grad():
            self.exp_avg_flat.copy_(state["exp_avg"])
            self.exp_avg_sq_flat.copy_(state["exp_avg_sq"])
            if self.muon is not None:
                self.momentum_flat.copy_(state["momentum"])
            if self.master_flat is not None:
                self.master_flat.copy_(state["master"])
                self._copy_masters()
                self.ddp.start_param_gather()

    @torch.no_grad()
    def _copy_masters(self) -> None:
        """Cast the fp32 masters into the owned parameter storage (param_data or the ZeRO-3
        shard; the next gather spreads them)."""
        for values, master in zip(self.params, self.masters, strict=True):
            values.copy_(master)

