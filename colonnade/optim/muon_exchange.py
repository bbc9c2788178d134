"""Distributed Muon: every matrix orthogonalised whole, on one owner rank, in every layout.

Muon's update of a hidden matrix W (logical shape [A, B]) needs the whole momentum-mixed
gradient U [A, B] for Newton-Schulz, but a rank holds only *pieces* of it: the flattened local
tp shard (column-parallel: rows, row-parallel: columns, an expert's slice of a stacked weight)
cut again by the ZeRO shard of its bucket (any sub-range, possibly empty). The ranks that hold
pieces of one matrix form a block of three axes, per kind of matrix:

    axis        dense matrices                       expert matrices (this ep rank's)
    T  (tp)     tp                                   expert_tp
    S  (shard)  ZeRO shard group (dp x cp, or the    expert shard group (expert-dp, or its
                hybrid shard group); one rank        hybrid shard group); one rank
                without ZeRO                         without ZeRO
    R  (copies) DDP: dp x cp; hybrid: replicate      DDP: expert-dp; hybrid: expert
                group; else one rank                 replicate group; else one rank

Rank (rho, sigma, tau) holds the pieces ``P[tau][sigma][m]`` (ranges [lo, hi) of the flattened
local shard tau of matrix m, L_m elements), the same on every replica rho. pp stages and ep
ranks hold different matrices and exchange nothing. Each matrix gets one owner (rho_o, sigma_o,
tau_o) among the ranks holding a non-empty piece, spread over the block (least loaded first,
at most one per rank per round while the round has room). Five all-to-alls with variable
splits (:meth:`CommGroup.all_to_all`) move it, each of them one call per round on every rank
of its group:

    G1 (S)  (rho_o, sigma, tau) -> (rho_o, sigma_o, tau): the pieces; (rho_o, sigma_o, tau) now
            holds the whole local shard tau [L_m]  (a tp-replicated matrix: only tau = tau_o)
    G2 (T)  (rho_o, sigma_o, tau) -> owner: the local shard (tp-split matrices only); the
            owner assembles the logical [A, B] with ``Sharding.unshard`` and computes
            O = fn(U, name)
    S2 (T)  owner -> (rho_o, sigma_o, tau): shard tau of O (``Sharding.shard``; replicated: O)
    S1 (S)  (rho_o, sigma_o, tau) -> (rho_o, sigma, tau): each piece of O, written in place
    S0 (R)  (rho_o, sigma, tau) -> (rho, sigma, tau), rho != rho_o: the pieces of O again

Elements each rank sends per step (x element size = the all-to-alls' wire bytes in
:class:`~colonnade.parallel.comm_stats.CommStats`; :func:`exchange_elements` computes it from
these formulas alone), with n = |P[tau][sigma][m]|, t = |T|, r = |R|:
    G1: n for each (sigma != sigma_o, tau in tp-split ? T : {tau_o}) in replica rho_o
    G2: L_m from each tau != tau_o at (rho_o, sigma_o)           (tp-split only)
    S2: L_m from the owner to each tau != tau_o                   (replicated: L_m = A B)
    S1: n from (rho_o, sigma_o, tau) to each sigma != sigma_o, every tau
    S0: (r - 1) n from every (rho_o, sigma, tau)
So a matrix of N elements, unsplit and unsharded on DDP's r replicas, costs its owner
(r - 1) N sent; ZeRO over s ranks without tp moves (N - n_owner) each way.

Overlap: the rounds (one matrix per block rank, in buffer order) are pipelined: while round
k's matrices are orthogonalised, round k+1's G2 and round k+2's G1 are in flight (posted
async before, waited after); the scatters of round k follow. Every rank of a group issues
the same collectives in the same order (NCCL): the plan is built once from every rank's
piece list (two ``all_gather_object`` calls over S and T, control plane), identical on
every rank.

Load: owners are holders, so each rank's Newton-Schulz work follows the Muon elements its
ZeRO shard holds (a shard mostly made of the embedding owns few matrices). Layouts that split
nothing (one rank, DDP, cp, pp, ep alone) never come here:
:func:`colonnade.optim.muon.make_orthogonalizer` gives them the local orthogonalizer, every
replica computing NS itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from colonnade.parallel.comm import CommGroup, Handle
from colonnade.tensor_parallel.sharding import Sharding

if TYPE_CHECKING:
    from colonnade.data_parallel.ddp import DataParallel
    from colonnade.parallel.groups import ProcessGroups


@dataclass
class MuonPiece:
    """Elements [lo, hi) of one local Muon matrix that this rank holds (what an
    :class:`~colonnade.optim.muon.Orthogonalizer` takes; defined here, below muon.py, so the
    exchange and the local path share one type)."""

    param: torch.nn.Parameter
    """The local (tp-shard) parameter."""
    index: int | None
    """Expert index into a stacked [E_local, ...] weight, else None."""
    lo: int
    """Start of the piece in the flattened local matrix."""
    hi: int
    """End (exclusive) of the piece in the flattened local matrix."""
    values: torch.Tensor
    """1-D view [hi - lo] of U; overwritten in place with s(A, B) NS(U)."""


MatrixFn = Callable[[torch.Tensor, str], torch.Tensor]
"""``fn(full, key)``: s(A, B) NS(full) for a logical matrix [A, B] named ``key`` (the
parameter's sharding key, the same for every expert of a stack)."""

MatrixId = tuple[str, int | None]
"""(parameter key, local expert index or None): one matrix, the same on every rank of a block."""
Ranges = tuple[tuple[int, int], ...]
"""The [lo, hi) ranges of the flattened local shard one rank holds, in its piece order."""
Position = tuple[int, int, int]
"""(rho, sigma, tau): a rank's place in the block (replica, shard, tp)."""


@dataclass(frozen=True)
class Matrix:
    """One Muon matrix as the whole block sees it."""

    mid: MatrixId
    name: str
    """What ``fn`` is told: the parameter's sharding key (every expert of a stack shares it,
    as :class:`~colonnade.optim.muon.LocalOrthogonalizer` tells it)."""
    sharding: Sharding
    """Its 2-D logical layout: ``full_shape`` [A, B], split over "tp" (T) or not at all."""
    local_numel: int
    """L: elements of one rank's local shard (A B when not split)."""

    @property
    def split(self) -> bool:
        """Whether T splits it (else every tp rank holds the whole matrix)."""
        return self.sharding.dim is not None


@dataclass
class Plan:
    """Who holds what and who owns what: identical on every rank of a block."""

    matrices: list[Matrix]
    pieces: dict[tuple[int, int, int], Ranges]
    """(m, sigma, tau) -> the ranges rank (*, sigma, tau) holds of matrix m (absent: none)."""
    owners: list[Position]
    rounds: list[list[int]]
    sizes: tuple[int, int, int]
    """(r, s, t): the block's extent along R, S, T."""

    def held(self, m: int, sigma: int, tau: int) -> Ranges:
        """The ranges (*, sigma, tau) holds of matrix m."""
        return self.pieces.get((m, sigma, tau), ())


def piece_count(ranges: Ranges) -> int:
    """Elements in ``ranges``."""
    return sum(hi - lo for lo, hi in ranges)


def matrix_of(piece: MuonPiece) -> tuple[MatrixId, str, Sharding, int]:
    """(id, name, 2-D sharding, local numel) of the matrix ``piece`` belongs to: the
    parameter's own sharding, or for expert ``index`` of a stacked [E_local, ...] weight the
    per-expert one (the ep split dropped, the tp split moved one dim in)."""
    param, index = piece.param, piece.index
    sharding: Sharding = param.sharding
    if index is None:
        return (sharding.key, None), sharding.key, sharding, param.numel()
    splits = tuple((axis, d - 1) for axis, d in sharding.splits if axis != "ep")
    per = Sharding(sharding.key, sharding.full_shape[1:], splits=splits)
    # the shape, not param[index]: a ZeRO-3 parameter's storage is freed between gathers
    return (sharding.key, index), sharding.key, per, math.prod(param.shape[1:])


def build_plan(tables: Sequence[Sequence[list[tuple[MatrixId, int, int]]]],
               meta: dict[MatrixId, Matrix], r: int) -> Plan:
    """The plan from ``tables[tau][sigma]`` (every rank's (id, lo, hi) list, in its piece
    order) and the matrices' facts: matrices in buffer order (first appearance along sigma),
    owners least-loaded among the holders (ties: fewest owned in this round, then block
    order), rounds of one matrix per block rank."""
    t, s = len(tables), len(tables[0])
    order: dict[MatrixId, int] = {}
    grouped: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for tau in range(t):
        for sigma in range(s):
            for mid, lo, hi in tables[tau][sigma]:
                m = order.setdefault(mid, len(order))
                grouped.setdefault((m, sigma, tau), []).append((lo, hi))
    matrices = [meta[mid] for mid in order]
    pieces = {k: tuple(v) for k, v in grouped.items()}
    block = r * s * t
    load = [0] * block
    owners: list[Position] = []
    rounds: list[list[int]] = []
    for m, mat in enumerate(matrices):
        if m % block == 0:
            rounds.append([])
            in_round = [0] * block
        holders = [(rho, sigma, tau) for rho in range(r) for sigma in range(s)
                   for tau in range(t) if piece_count(pieces.get((m, sigma, tau), ()))]
        if not holders:  # only empty pieces: any rank of replica 0 assembles zeros
            holders = [(0, 0, 0)]
        flat = [(rho * s + sigma) * t + tau for rho, sigma, tau in holders]
        best = min(range(len(holders)), key=lambda i: (in_round[flat[i]], load[flat[i]], i))
        owners.append(holders[best])
        in_round[flat[best]] += 1
        load[flat[best]] += mat.sharding.full_shape[0] * mat.sharding.full_shape[1]
        rounds[-1].append(m)
    return Plan(matrices, pieces, owners, rounds, (r, s, t))


def exchange_elements(plan: Plan, at: Position) -> dict[str, tuple[int, int]]:
    """Per stage ('G1', 'G2', 'S2', 'S1', 'S0'): (elements rank ``at`` sends to other ranks,
    elements it receives from them) in one step, from the module docstring's formulas."""
    r, s, t = plan.sizes
    rho, sigma, tau = at
    out = {k: [0, 0] for k in ("G1", "G2", "S2", "S1", "S0")}
    for m, mat in enumerate(plan.matrices):
        ro, so, to = plan.owners[m]
        mine = piece_count(plan.held(m, sigma, tau))
        taus = range(t) if mat.split else [to]
        if rho == ro:
            if sigma != so and tau in taus:
                out["G1"][0] += mine
            if sigma == so and tau in taus:
                out["G1"][1] += sum(piece_count(plan.held(m, x, tau)) for x in range(s)
                                    if x != so)
            if sigma != so:
                out["S1"][1] += mine
            else:
                out["S1"][0] += sum(piece_count(plan.held(m, x, tau)) for x in range(s)
                                    if x != so)
            if sigma == so and mat.split and t > 1:
                out["G2"][0 if tau != to else 1] += mat.local_numel * (1 if tau != to else t - 1)
            if sigma == so and t > 1:
                out["S2"][1 if tau != to else 0] += mat.local_numel * (1 if tau != to else t - 1)
            out["S0"][0] += (r - 1) * mine
        else:
            out["S0"][1] += mine
    return {k: (v[0], v[1]) for k, v in out.items()}


@dataclass(frozen=True)
class BlockGroups:
    """The three axes of one kind of matrices (see the module docstring); a size-1 group
    communicates nothing."""

    tp: CommGroup
    shard: CommGroup
    replicate: CommGroup

    @property
    def position(self) -> Position:
        """This rank's (rho, sigma, tau)."""
        return (max(self.replicate.rank, 0), max(self.shard.rank, 0), max(self.tp.rank, 0))


@dataclass
class _Posted:
    """An all-to-all in flight: its handle, receive buffer and per-source sizes."""

    handle: Handle | None
    out: torch.Tensor
    sizes: list[int]

    def parts(self) -> list[torch.Tensor]:
        """Wait, then the received block of every source rank, in rank order."""
        if self.handle is not None:
            self.handle.wait()
        return list(torch.split(self.out, self.sizes))


def _post(group: CommGroup, sends: list[list[torch.Tensor]], recv: list[int],
          like: torch.Tensor, name: str) -> _Posted:
    """Post one variable-split all-to-all: ``sends[j]`` (1-D tensors, concatenated) to rank
    j, ``recv[j]`` elements from rank j (async)."""
    in_splits = [sum(x.numel() for x in parts) for parts in sends]
    flat = [x.reshape(-1).to(like.dtype) for parts in sends for x in parts]
    send = torch.cat(flat) if flat else like.new_empty(0)  # [sum in_splits]
    out = like.new_empty(sum(recv))  # [sum recv]
    handle = group.all_to_all(out, send, in_splits=in_splits, out_splits=list(recv),
                              name=name, async_op=True)
    return _Posted(handle, out, list(recv))


@dataclass
class _Round:
    """One round's data on this rank: local shards gathered (G1), tp shards (G2), results."""

    matrices: list[int]
    local: dict[int, torch.Tensor] = field(default_factory=dict)
    """m -> [L_m] the whole local shard (at sigma_o)."""
    shards: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """m -> the t local shards (owner of a tp-split matrix)."""
    result: dict[int, torch.Tensor] = field(default_factory=dict)
    """m -> [L_m] this tp rank's shard of O (at sigma_o)."""
    g1: _Posted | None = None
    g2: _Posted | None = None


class BlockExchange:
    """The gathers, Newton-Schulz calls and scatters of one kind of matrices (dense or
    expert) over its :class:`BlockGroups`."""

    def __init__(self, groups: BlockGroups, name: str, device: torch.device) -> None:
        self.groups, self.name = groups, name
        self.dtype = torch.float32
        """The dtype U travels in: the first holder's (every rank of the block agrees)."""
        self.device = device
        self.plan: Plan | None = None
        self._signature: list[tuple[MatrixId, int, int]] | None = None
        self.pieces: dict[int, list[MuonPiece]] = {}
        """m -> this rank's pieces of matrix m, in the plan's range order."""

    def prepare(self, pieces: Sequence[MuonPiece]) -> Plan:
        """The plan (built by the first call: collectives over S and T on every rank); later
        calls check that the pieces still describe the same layout."""
        table, meta = [], {}
        for piece in pieces:
            mid, name, sharding, numel = matrix_of(piece)
            table.append((mid, int(piece.lo), int(piece.hi)))
            meta[mid] = Matrix(mid, name, sharding, numel)
        if self.plan is None:
            g = self.groups
            dtype = pieces[0].values.dtype if pieces else None
            tables = g.tp.all_gather_object(g.shard.all_gather_object(table))
            metas = g.tp.all_gather_object(g.shard.all_gather_object((meta, dtype)))
            merged = {k: v for per_tp in metas for per_shard, _ in per_tp
                      for k, v in per_shard.items()}
            dtypes = [d for per_tp in metas for _, d in per_tp if d is not None]
            self.dtype = dtypes[0] if dtypes else self.dtype
            self.plan, self._signature = build_plan(tables, merged, g.replicate.size), table
        elif table != self._signature:
            raise ValueError(f"Muon exchange ({self.name}): the pieces changed since the plan "
                             "was built; build a new optimizer for a new layout")
        index = {m.mid: i for i, m in enumerate(self.plan.matrices)}
        self.pieces = {}
        for piece, (mid, _, _) in zip(pieces, table, strict=True):
            self.pieces.setdefault(index[mid], []).append(piece)
        return self.plan

    def _gathers(self, m: int) -> bool:
        """Whether this rank's S group takes part in G1 of matrix m: the owner's replica, and
        a tp rank whose shard is gathered (every tau when tp splits m, else tau_o)."""
        assert self.plan is not None
        rho, _, tau = self.groups.position
        ro, _, to = self.plan.owners[m]
        return rho == ro and (self.plan.matrices[m].split or tau == to)

    def _post_g1(self, rnd: _Round, like: torch.Tensor) -> None:
        """G1 over S: my pieces of the round's matrices to their sigma_o."""
        plan, g = self.plan, self.groups
        assert plan is not None
        _, sigma, tau = g.position
        sends: list[list[torch.Tensor]] = [[] for _ in range(g.shard.size)]
        recv = [0] * g.shard.size
        for m in rnd.matrices:
            if not self._gathers(m):
                continue
            so = plan.owners[m][1]
            sends[so] += [p.values for p in self.pieces.get(m, [])]
            if sigma == so:
                for x in range(g.shard.size):
                    recv[x] += piece_count(plan.held(m, x, tau))
        rnd.g1 = _post(g.shard, sends, recv, like, f"muon_{self.name}_gather")

    def _take_g1(self, rnd: _Round, like: torch.Tensor) -> None:
        """Place G1's pieces into the whole local shards (at sigma_o)."""
        plan, g = self.plan, self.groups
        assert plan is not None and rnd.g1 is not None
        _, sigma, tau = g.position
        parts = rnd.g1.parts()
        offsets = [0] * g.shard.size
        for m in rnd.matrices:
            if not self._gathers(m) or plan.owners[m][1] != sigma:
                continue
            local = like.new_zeros(plan.matrices[m].local_numel)  # [L_m]
            for x in range(g.shard.size):
                for lo, hi in plan.held(m, x, tau):
                    local[lo:hi] = parts[x][offsets[x]:offsets[x] + hi - lo]
                    offsets[x] += hi - lo
            rnd.local[m] = local
        rnd.g1 = None

    def _post_g2(self, rnd: _Round, like: torch.Tensor) -> None:
        """G2 over T: the whole local shard of each tp-split matrix to its owner."""
        plan, g = self.plan, self.groups
        assert plan is not None
        rho, sigma, tau = g.position
        sends: list[list[torch.Tensor]] = [[] for _ in range(g.tp.size)]
        recv = [0] * g.tp.size
        for m in rnd.matrices:
            ro, so, to = plan.owners[m]
            if (ro, so) != (rho, sigma) or not plan.matrices[m].split:
                continue
            sends[to].append(rnd.local[m])
            if tau == to:
                for x in range(g.tp.size):
                    recv[x] += plan.matrices[m].local_numel
        rnd.g2 = _post(g.tp, sends, recv, like, f"muon_{self.name}_gather")

    def _orthogonalize(self, rnd: _Round, fn: MatrixFn) -> dict[int, torch.Tensor]:
        """Wait for G2, assemble every matrix this rank owns and return m -> O [A, B]."""
        plan, g = self.plan, self.groups
        assert plan is not None and rnd.g2 is not None
        parts = rnd.g2.parts()
        offsets = [0] * g.tp.size
        out = {}
        for m in rnd.matrices:
            mat = plan.matrices[m]
            if plan.owners[m] != g.position:
                continue
            if mat.split:
                degrees = {"tp": g.tp.size}
                shards = []
                for x, coords in enumerate(mat.sharding.layout(degrees)):
                    shards.append(parts[x][offsets[x]:offsets[x] + mat.local_numel]
                                  .view(mat.sharding.local_shape(coords)))
                    offsets[x] += mat.local_numel
                full = mat.sharding.unshard(shards, degrees)  # [A, B]
            else:
                full = rnd.local[m].view(mat.sharding.full_shape)  # [A, B]
            out[m] = fn(full, mat.name)
        rnd.g2 = None
        return out

    def _scatter_tp(self, rnd: _Round, results: dict[int, torch.Tensor],
                    like: torch.Tensor) -> None:
        """S2 over T: shard tau of each O to tp rank tau (a replicated matrix: O itself)."""
        plan, g = self.plan, self.groups
        assert plan is not None
        rho, sigma, _ = g.position
        sends: list[list[torch.Tensor]] = [[] for _ in range(g.tp.size)]
        recv = [0] * g.tp.size
        lines = [m for m in rnd.matrices if plan.owners[m][:2] == (rho, sigma)]
        for m in lines:
            mat, to = plan.matrices[m], plan.owners[m][2]
            recv[to] += mat.local_numel
            if m in results:
                for x in range(g.tp.size):
                    coords = {"tp": (x, g.tp.size)}
                    sends[x].append(mat.sharding.shard(results[m], coords) if mat.split
                                    else results[m])
        parts = _post(g.tp, sends, recv, like, f"muon_{self.name}_scatter").parts()
        offsets = [0] * g.tp.size
        for m in lines:
            to, n = plan.owners[m][2], plan.matrices[m].local_numel
            rnd.result[m] = parts[to][offsets[to]:offsets[to] + n]  # [L_m]
            offsets[to] += n

    def _scatter_shard(self, rnd: _Round, like: torch.Tensor) -> None:
        """S1 over S: each piece of O from sigma_o to its holder, written into the piece."""
        plan, g = self.plan, self.groups
        assert plan is not None
        rho, sigma, tau = g.position
        sends: list[list[torch.Tensor]] = [[] for _ in range(g.shard.size)]
        recv = [0] * g.shard.size
        for m in rnd.matrices:
            ro, so, _ = plan.owners[m]
            if ro != rho:
                continue
            recv[so] += piece_count(plan.held(m, sigma, tau))
            if so == sigma:
                for x in range(g.shard.size):
                    sends[x] += [rnd.result[m][lo:hi] for lo, hi in plan.held(m, x, tau)]
        parts = _post(g.shard, sends, recv, like, f"muon_{self.name}_scatter").parts()
        offsets = [0] * g.shard.size
        for m in rnd.matrices:
            ro, so, _ = plan.owners[m]
            if ro == rho:
                offsets[so] = self._write(m, parts[so], offsets[so])

    def _scatter_replicas(self, rnd: _Round, like: torch.Tensor) -> None:
        """S0 over R: the replica that owns each matrix sends its pieces of O to the others."""
        plan, g = self.plan, self.groups
        assert plan is not None
        if g.replicate.size == 1:
            return
        rho, sigma, tau = g.position
        sends: list[list[torch.Tensor]] = [[] for _ in range(g.replicate.size)]
        recv = [0] * g.replicate.size
        for m in rnd.matrices:
            ro = plan.owners[m][0]
            if ro == rho:
                for x in range(g.replicate.size):
                    if x != rho:
                        sends[x] += [p.values for p in self.pieces.get(m, [])]
            else:
                recv[ro] += piece_count(plan.held(m, sigma, tau))
        parts = _post(g.replicate, sends, recv, like, f"muon_{self.name}_scatter").parts()
        offsets = [0] * g.replicate.size
        for m in rnd.matrices:
            ro = plan.owners[m][0]
            if ro != rho:
                offsets[ro] = self._write(m, parts[ro], offsets[ro])

    def _write(self, m: int, data: torch.Tensor, offset: int) -> int:
        """Copy this rank's pieces of matrix m from ``data[offset:]``; returns the end."""
        for piece in self.pieces.get(m, []):
            n = piece.values.numel()
            piece.values.copy_(data[offset:offset + n])
            offset += n
        return offset

    def run(self, pieces: Sequence[MuonPiece], fn: MatrixFn) -> None:
        """Overwrite every piece's U with its piece of fn(U), round after round, pipelined:
        while round k's matrices are orthogonalised, round k+1's G2 and round k+2's G1 are
        in flight (posted before, waited after)."""
        plan = self.prepare(pieces)
        like = torch.empty(0, dtype=self.dtype, device=self.device)
        rounds = [_Round(ms) for ms in plan.rounds]
        if not rounds:
            return
        self._post_g1(rounds[0], like)
        self._take_g1(rounds[0], like)
        self._post_g2(rounds[0], like)
        if len(rounds) > 1:
            self._post_g1(rounds[1], like)
        for k, rnd in enumerate(rounds):
            if k + 1 < len(rounds):
                self._take_g1(rounds[k + 1], like)
                self._post_g2(rounds[k + 1], like)
            if k + 2 < len(rounds):
                self._post_g1(rounds[k + 2], like)
            results = self._orthogonalize(rnd, fn)
            self._scatter_tp(rnd, results, like)
            self._scatter_shard(rnd, like)
            self._scatter_replicas(rnd, like)


def _trivial(groups: ProcessGroups) -> CommGroup:
    """A group of this rank alone (communicates nothing)."""
    return CommGroup("muon_self", [groups.rank], None, groups.stats, groups.rank)


def block_groups(ddp: DataParallel, groups: ProcessGroups, expert: bool) -> BlockGroups:
    """T, S and R of dense (``expert`` False) or expert matrices (module docstring)."""
    one = _trivial(groups)
    shard_groups = ddp.shard_groups
    if expert:
        tp = groups.expert_tp if groups.expert_tp is not None else one
        if not ddp.sharded:
            assert ddp.expert_group is not None
            return BlockGroups(tp, one, ddp.expert_group)
        assert shard_groups.expert is not None
        return BlockGroups(tp, shard_groups.expert, shard_groups.expert_replicate or one)
    if not ddp.sharded:
        return BlockGroups(groups.tp, one, ddp.group)
    return BlockGroups(groups.tp, shard_groups.dense, shard_groups.dense_replicate or one)


class DistributedOrthogonalizer:
    """The :class:`~colonnade.optim.muon.Orthogonalizer` of every distributed layout: dense
    matrices exchanged over (tp, ZeRO shard group, dp replicas), each ep rank's expert
    matrices over (expert tp, expert shard group, expert replicas); see the module
    docstring."""

    def __init__(self, ddp: DataParallel, groups: ProcessGroups) -> None:
        device = ddp.buffers.device
        self.dense = BlockExchange(block_groups(ddp, groups, False), "dense", device)
        self.expert: BlockExchange | None = None
        if ddp.expert_group is not None:
            self.expert = BlockExchange(block_groups(ddp, groups, True), "expert", device)

    def apply(self, pieces: list[MuonPiece], fn: MatrixFn) -> None:
        """Overwrite each piece's ``values`` (U) with its piece of ``fn(U_full, name)``."""
        dense = [p for p in pieces if p.index is None]
        self.dense.run(dense, fn)
        if self.expert is not None:
            self.expert.run([p for p in pieces if p.index is not None], fn)
        elif len(dense) != len(pieces):
            raise ValueError("expert pieces given, but the model has no expert groups")

    def exchange_elements(self) -> dict[str, tuple[int, int]]:
        """Elements this rank sends and receives per step, per stage, dense and expert
        summed (:func:`exchange_elements`; available after the first :meth:`apply`)."""
        total: dict[str, tuple[int, int]] = {}
        for block in (self.dense, self.expert):
            if block is None or block.plan is None:
                continue
            for k, (a, b) in exchange_elements(block.plan, block.groups.position).items():
                x, y = total.get(k, (0, 0))
                total[k] = (x + a, y + b)
        return total
