"""Muon: orthogonalised momentum for the hidden matrices, AdamW for the rest.

Which parameters: :func:`muon_matrices` is the one rule. A parameter whose logical shape
(``Sharding.full_shape``) has 2 dims is one Muon matrix [A, B] (attention and MLP projections,
MLA's projections, shared experts, MTP's projection), and a stacked expert weight
[E, A, B] (split over "ep") is E matrices, one per expert; embeddings (word, position, MTP's),
output heads and router weights are AdamW's by name, and so is everything with 1 or 3+ dims
that is not an expert stack (norms, biases, sinks).

Update of a Muon matrix W [A, B] at step t with gradient g = c G (c the unscale-and-clip
coefficient AdamW gets), momentum mu, learning rate lr, weight decay wd:
    M <- mu M + g
    U  = g + mu M            (nesterov; else U = M)
    O  = NS(U)               (:func:`newton_schulz`)
    W <- W (1 - lr wd) - lr s(A, B) O          (s = :func:`muon_scale`)
M is elementwise, so it lives in the optimizer's flat owned ranges like Adam's exp_avg; only
NS needs the whole matrix. An :class:`Orthogonalizer` turns the pieces of U a rank holds
(:class:`MuonPiece`) into the same pieces of s(A, B) NS(U): :class:`LocalOrthogonalizer` when
every piece is a whole, unsplit matrix (one rank, DDP, cp, pp, ep), the distributed one
(:class:`colonnade.optim.muon_exchange.DistributedOrthogonalizer`: one owner rank per
matrix gathers it, orthogonalises it and scatters the result) when tp or ZeRO splits them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from colonnade.config.sections import OptimConfig
from colonnade.data_parallel.buffer import is_expert_param, param_key
from colonnade.data_parallel.ddp import DataParallel
from colonnade.optim.chunked import ChunkedCompute
from colonnade.optim.muon_exchange import DistributedOrthogonalizer, MatrixFn, MuonPiece
from colonnade.parallel.groups import ProcessGroups

NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic Newton-Schulz iteration (Keller Jordan's Muon)."""
NS_EPS = 1e-7
"""Added to ||U||_F before the first iterate is normalised."""
ADAMW_NAMES: frozenset[str] = frozenset({"embedding", "embed", "head", "router"})
"""Key components that make a 2-D parameter AdamW's: word / position / MTP embeddings, the
output heads and the MoE routers."""


@dataclass(frozen=True)
class MuonMatrices:
    """The Muon matrices of one (local) parameter."""

    count: int
    """Matrices in the local parameter: E_local for a stacked expert weight, else 1."""
    shape: tuple[int, int]
    """Logical shape [A, B] of each matrix (unsharded)."""
    stacked: bool
    """Whether dim 0 of the parameter indexes experts (one matrix per expert)."""


def muon_matrices(param: torch.nn.Parameter) -> MuonMatrices | None:
    """The Muon matrices of ``param``, or None when AdamW updates it (module docstring)."""
    sharding = getattr(param, "sharding", None)
    full = tuple(sharding.full_shape) if sharding is not None else tuple(param.shape)
    if ADAMW_NAMES.intersection(param_key(param).split(".")):
        return None
    if is_expert_param(param) and len(full) == 3:
        return MuonMatrices(int(param.shape[0]), (full[1], full[2]), True)
    if len(full) == 2 and not is_expert_param(param):
        return MuonMatrices(1, (full[0], full[1]), False)
    return None


def split_matrices(param: torch.nn.Parameter, lo: int, hi: int
                   ) -> list[tuple[int | None, int, int, int]]:
    """Elements [lo, hi) of the flattened local ``param`` (a Muon parameter) as
    (expert index or None, lo', hi', base) per local matrix: [lo', hi') of that matrix's
    flattening, which starts at element ``base`` of the parameter's (the local expert ``e`` of
    a stacked weight [E_local, a, b] holds elements [e a b, (e + 1) a b))."""
    found = muon_matrices(param)
    assert found is not None, f"{param_key(param)} is not a Muon parameter"
    if not found.stacked:
        return [(None, lo, hi, 0)]
    size = math.prod(param.shape[1:])  # a b: one local expert matrix
    return [(e, max(lo, e * size) - e * size, min(hi, (e + 1) * size) - e * size, e * size)
            for e in range(lo // size, (hi - 1) // size + 1)] if hi > lo else []


def muon_scale(a: int, b: int, mode: str) -> float:
    """The scale s(A, B) of the update of a matrix [A, B] (``optim.muon_scale``)."""
    if mode == "match_adamw":
        return 0.2 * math.sqrt(max(a, b))
    if mode == "spectral":
        return math.sqrt(max(1.0, a / b))
    raise ValueError(f"optim.muon_scale={mode!r} is unknown")


def newton_schulz(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """NS(U) for U [A, B]: the quintic Newton-Schulz iteration towards the orthogonal factor.

    X = U / (||U||_F + 1e-7), transposed to [B, A] when A > B; ``steps`` times
    X <- a X + (b P + c P^2) X with P = X X^T [min, min], (a, b, c) = :data:`NS_COEFFICIENTS`;
    transposed back. Computed in bf16 on CUDA, in U's dtype elsewhere (fp64 runs are exact);
    returned in U's dtype, shape [A, B].
    """
    a, b, c = NS_COEFFICIENTS
    x = u.to(torch.bfloat16) if u.device.type == "cuda" else u
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T  # [B, A]: P is the smaller Gram matrix
    x = x / (torch.linalg.matrix_norm(x) + NS_EPS)
    for _ in range(steps):
        p = x @ x.T  # [min, min]
        x = a * x + (b * p + c * (p @ p)) @ x
    return (x.T if tall else x).to(u.dtype)


class Orthogonalizer(Protocol):
    """Replaces every piece's U by its piece of ``fn`` of the whole logical matrix."""

    def apply(self, pieces: list[MuonPiece], fn: MatrixFn) -> None:
        """``pieces`` are in buffer order, the same order on every rank of a group."""
        ...


def local_shape(piece: MuonPiece) -> torch.Size:
    """Shape of the local matrix the piece belongs to (the parameter, or one expert of it),
    read from the parameter's shape, never its storage (a ZeRO-3 parameter's storage is freed
    between gathers, even when its shard group has one rank)."""
    return piece.param.shape if piece.index is None else piece.param.shape[1:]


class LocalOrthogonalizer:
    """Every piece is a whole matrix that no axis splits: ``fn`` on the view itself."""

    def apply(self, pieces: list[MuonPiece], fn: MatrixFn) -> None:
        for piece in pieces:
            shape = local_shape(piece)
            if (piece.lo, piece.hi) != (0, shape.numel()):
                raise AssertionError(f"{param_key(piece.param)}: piece [{piece.lo}, "
                                     f"{piece.hi}) of a {tuple(shape)} matrix is not "
                                     "whole; the layout needs the distributed orthogonalizer")
            full = piece.values.view(shape)  # [A, B]
            piece.values.copy_(fn(full, param_key(piece.param)).reshape(-1))


def splits_matrices(ddp: DataParallel, groups: ProcessGroups) -> bool:
    """Whether some rank holds only a piece of a Muon matrix: tp or expert tp > 1, or ZeRO
    sharding the buffers over more than one rank."""
    etp = groups.expert_tp.size if groups.expert_tp is not None else 1
    shard = ddp.shard_groups
    sharded = ddp.sharded and any(g is not None and g.size > 1
                                  for g in (shard.dense, shard.expert))
    return groups.tp.size > 1 or etp > 1 or sharded


def make_orthogonalizer(ddp: DataParallel, groups: ProcessGroups) -> Orthogonalizer:
    """The local orthogonalizer when nothing is split (:func:`splits_matrices`), else the
    distributed one."""
    if not splits_matrices(ddp, groups):
        return LocalOrthogonalizer()
    return DistributedOrthogonalizer(ddp, groups)


@dataclass(frozen=True)
class MuonHyper:
    """The Muon settings of a run (``optim.muon_*``)."""

    momentum: float
    nesterov: bool
    ns_steps: int
    scale: str

    @staticmethod
    def of(cfg: OptimConfig) -> MuonHyper:
        """The settings in ``cfg``."""
        return MuonHyper(cfg.muon_momentum, cfg.muon_nesterov, cfg.muon_ns_steps,
                         cfg.muon_scale)

    def matrix_fn(self) -> MatrixFn:
        """``fn(full, key) = s(A, B) NS(full)``."""
        def fn(full: torch.Tensor, key: str) -> torch.Tensor:
            del key
            return muon_scale(full.shape[0], full.shape[1], self.scale) * newton_schulz(
                full, self.ns_steps)
        return fn


@dataclass
class MuonSlot:
    """One owned piece of a local Muon matrix and its aligned flat views (all [hi - lo])."""

    param: torch.nn.Parameter
    """The local (tp-shard) parameter."""
    index: int | None
    """Expert index into a stacked weight, else None."""
    lo: int
    """Start of the piece in the flattened local matrix."""
    hi: int
    """End (exclusive) of the piece in the flattened local matrix."""


class FlatMuon:
    """The Muon update (module docstring) over this rank's owned pieces of Muon matrices.

    ``masters[i]``, ``grads[i]``, ``momenta[i]`` are 1-D views of ``slots[i]``'s piece of the
    master weights, main gradients and momentum M; :meth:`update` builds U in a scratch
    buffer, hands its pieces to the orthogonalizer (every rank calls it, with or without
    pieces, so distributed exchanges match) and applies the decayed step.
    """

    def __init__(self, slots: list[MuonSlot], masters: list[torch.Tensor],
                 grads: list[torch.Tensor], momenta: list[torch.Tensor],
                 orthogonalizer: Orthogonalizer, hyper: MuonHyper) -> None:
        self.slots, self.masters, self.grads, self.momenta = slots, masters, grads, momenta
        self.orthogonalizer, self.hyper = orthogonalizer, hyper
        self.fn = hyper.matrix_fn()
        device = masters[0].device if masters else torch.device("cpu")
        self.compute = grads[0].dtype if grads else torch.float32
        """U and the arithmetic: the gradients' dtype (fp32; fp64 runs fp64)."""
        sizes = [[m.numel() for m in momenta]]
        stored = [momenta[0].dtype, masters[0].dtype] if slots else [self.compute] * 2
        # bf16 momentum (optim.state_dtype) or masters (optim.master_dtype): fp32 chunks
        # (colonnade.optim.chunked); operands already in the compute dtype are used in place
        self._momentum_chunks = ChunkedCompute(sizes, [stored[0], self.compute, self.compute],
                                               self.compute, device)  # M, g, U
        self._apply_chunks = ChunkedCompute(sizes, [stored[1], self.compute], self.compute,
                                            device)  # W, U

    @torch.no_grad()
    def update(self, lr: float, weight_decay: float, grad_scale: float = 1.0) -> None:
        """One step with gradients g = ``grad_scale`` G (G as stored, left unchanged)."""
        mu, nesterov = self.hyper.momentum, self.hyper.nesterov
        sizes = [m.numel() for m in self.momenta]
        device = self.masters[0].device if self.masters else torch.device("cpu")
        u_flat = torch.empty(sum(sizes), dtype=self.compute,
                             device=device)  # [owned Muon elements]
        us = list(u_flat.split(sizes))

        def momentum(_: int, v: list[list[torch.Tensor]]) -> None:
            m, g, u = v
            torch._foreach_mul_(m, mu)
            torch._foreach_add_(m, g, alpha=grad_scale)  # M <- mu M + g
            if nesterov:  # U = g + mu M
                torch._foreach_copy_(u, g)
                if grad_scale != 1.0:
                    torch._foreach_mul_(u, grad_scale)
                torch._foreach_add_(u, m, alpha=mu)
            else:
                torch._foreach_copy_(u, m)

        def apply(_: int, v: list[list[torch.Tensor]]) -> None:
            w, u = v
            if weight_decay:
                torch._foreach_mul_(w, 1.0 - lr * weight_decay)
            torch._foreach_add_(w, u, alpha=-lr)

        self._momentum_chunks.run([[self.momenta, self.grads, us]], (0,), momentum)
        pieces = [MuonPiece(s.param, s.index, s.lo, s.hi, u)
                  for s, u in zip(self.slots, us, strict=True)]
        self.orthogonalizer.apply(pieces, self.fn)  # U <- s(A, B) NS(U), piece by piece
        self._apply_chunks.run([[self.masters, us]], (0,), apply)


def describe_split(params: list[torch.nn.Parameter]) -> str:
    """'M matrices in P tensors (N parameters) use Muon, Q tensors (K parameters) AdamW'."""
    muon = [(p, found) for p in params if (found := muon_matrices(p)) is not None]
    rest = [p for p in params if muon_matrices(p) is None]
    return (f"{sum(f.count for _, f in muon)} matrices in {len(muon)} tensors "
            f"({sum(p.numel() for p, _ in muon):,} parameters) use Muon, {len(rest)} tensors "
            f"({sum(p.numel() for p in rest):,} parameters) AdamW")
