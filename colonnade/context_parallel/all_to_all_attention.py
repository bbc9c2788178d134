"""All-to-all ("Ulysses") context-parallel attention: trade the sequence split for a head split.

Each of the cp ranks of a cp group holds its zigzag rows (:mod:`~colonnade.context_parallel.
layout`) of every tp-local head: q [b, a_l, s_l, d], k/v [b, kv_l, s_l, d] with s_l = s / cp.
Attention mixes rows but not heads, so one all-to-all over cp gives every rank the WHOLE
sequence of a_l / cp query heads (and the kv heads they read); the rank runs an ordinary
full-sequence attention ``attend`` on them, and a second all-to-all returns the output to the
sequence split. With Q_h, K_h, V_h the full-sequence heads and M the mask::

    out_h = softmax(Q_h K_{g(h)}^T * scale + M) V_{g(h)},   g(h) = h // (a_l / kv_l)  (GQA)

computed exactly as without cp, on cp rank j for heads h in [j a_q, (j + 1) a_q), a_q = a_l/cp.

Head assignment (rank j of cp):
  query heads  [j a_q, (j + 1) a_q)
  kv heads     kv_l % cp == 0: [j kv_l/cp, (j + 1) kv_l/cp) (split like q; they are exactly
               the kv heads of those query heads since a_l/kv_l query heads share one);
               cp % kv_l == 0: the ONE head j // (cp / kv_l): rank j's a_q query heads all lie
               in the group of a_l / kv_l = a_q (cp / kv_l) heads reading it. Every kv head is
               then sent to cp / kv_l ranks (replicated by an ``index_select`` of the heads);
               the adjoint of ``index_select`` is ``index_add``, so the backward SUMS the
               replicas' gradients dK_g = sum over ranks j with g(j) = g of dK^(j), which is
               the full gradient since dK_g = sum_h dK_g^(h) over the query heads h reading g,
               and each h lives on exactly one rank.
  otherwise    ValueError (parallel.cp / model.num_kv_heads).

Communication (one PACKED all-to-all for q, k and v: one collective instead of three, the same
bytes; the latency term, paid cp - 1 times per all-to-all, is what three calls would triple).
Per layer and per rank, with E the element size, h_kv = max(kv_l / cp, 1) kv heads per rank:

  forward   a2a(cp_qkv)        payload B_qkv = (a_l + 2 cp h_kv) b s_l d E
            a2a(cp_out)        payload B_o   = a_l b s_l d E
  backward  a2a(cp_out_grad)   B_o   (the output gradient, inverse exchange)
            a2a(cp_qkv_grad)   B_qkv (dq, dk, dv packed the same way)

4 all-to-alls, each putting (cp - 1) / cp of its payload on the wire (what leaves the rank), so
wire bytes per rank per layer = 2 (cp - 1) / cp (B_qkv + B_o); with MHA (kv_l = a_l) that is
8 (cp - 1) / cp x the q bytes, independent of cp for large cp (unlike ring attention's
2 (cp - 1) / cp x the full k/v of the sequence).

Data movement without extra copies: the local rows are the two zigzag chunks of n = s / (2 cp)
rows; the sender packs [cp (destination), 2 (chunk slot), heads, b, n, d] (one ``cat``), so the
received tensor [cp (source), 2, heads, b, n, d] is a list of the 2 cp chunks in gathered
(zigzag) order, which one ``index_select`` of chunks by ``zigzag_order(2 cp, cp).argsort()``
on the permuted view [b, heads, 2 cp, n, d] puts in natural order and in the [b, heads, s, d]
layout at once; the way back mirrors it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from colonnade.context_parallel.layout import check_divisible, zigzag_order
from colonnade.parallel.all_to_all import all_to_all
from colonnade.parallel.comm import CommGroup

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``attend(q [b, a_q, s, d], k [b, h_kv, s, d], v, head_offset) -> [b, a_q, s, d]`` on the
natural-order full sequence; ``head_offset`` is the index of q's first head among the a_l
tp-local query heads."""


def kv_heads_per_rank(heads: int, kv_heads: int, cp: int) -> int:
    """kv heads each cp rank receives (h_kv): kv_l / cp when cp divides kv_l, else 1 (one
    replicated head, when kv_l divides cp). Raises ValueError for head counts the head split
    cannot serve."""
    if heads % cp:
        raise ValueError(f"all_to_all context parallelism splits the {heads} tp-local query "
                         f"heads over parallel.cp = {cp} ranks: the count must be divisible "
                         "by cp; change parallel.cp (or model.num_heads / parallel.tp), or use "
                         "parallel.cp_attention='ring'")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} kv heads evenly; "
                         "model.num_heads must be a multiple of model.num_kv_heads")
    if kv_heads % cp == 0:
        return kv_heads // cp
    if cp % kv_heads == 0:
        return 1
    raise ValueError(f"all_to_all context parallelism needs the {kv_heads} tp-local kv heads "
                     f"and parallel.cp = {cp} to divide one another (kv % cp == 0: split, or "
                     "cp % kv == 0: replicated); change parallel.cp or model.num_kv_heads, or "
                     "use parallel.cp_attention='ring'")


def _kv_index(kv_heads: int, cp: int, device: torch.device) -> torch.Tensor | None:
    """Which kv head goes to each rank when they are replicated: int64 [cp], entry j =
    j // (cp / kv_l); None when kv heads split like q (no selection needed)."""
    if kv_heads % cp == 0:
        return None
    return torch.arange(cp, device=device) // (cp // kv_heads)  # [cp]


def _by_destination(x: torch.Tensor, cp: int) -> torch.Tensor:
    """[b, cp h, 2 n, d] (heads grouped by destination rank, rows = the two local chunks)
    -> view [cp, 2, h, b, n, d]."""
    b, heads, s_l, d = x.shape
    n = s_l // 2
    return x.view(b, cp, heads // cp, 2, n, d).permute(1, 3, 2, 0, 4, 5)


def _to_heads(parts: list[torch.Tensor], group: CommGroup, name: str) -> list[torch.Tensor]:
    """Sequence split -> head split for tensors [b, cp h_i, s_l, d] (zigzag local rows):
    returns [b, h_i, s, d] each, natural order, after ONE all-to-all of their packed heads."""
    cp = group.size
    b, _, s_l, d = parts[0].shape
    n = s_l // 2
    sizes = [p.shape[1] // cp for p in parts]
    send = torch.cat([_by_destination(p, cp) for p in parts], dim=2)  # [cp, 2, H, b, n, d]
    recv = all_to_all(send, group, name=name)  # [cp (source), 2, H, b, n, d]
    natural = zigzag_order(2 * cp, cp, device=recv.device).argsort()  # [2cp] chunk perm
    chunks = recv.view(2 * cp, sum(sizes), b, n, d).permute(2, 1, 0, 3, 4)  # [b, H, 2cp, n, d]
    out = []
    for piece in chunks.split(sizes, dim=1):  # [b, h_i, 2cp, n, d] (gathered chunk order)
        out.append(piece.index_select(2, natural).view(b, piece.shape[1], 2 * cp * n, d))
    return out  # [b, h_i, s, d] each


def _to_sequence(out: torch.Tensor, group: CommGroup, name: str) -> torch.Tensor:
    """Head split -> sequence split: [b, a_q, s, d] natural order -> [b, cp a_q, s_l, d] in
    zigzag local order (ONE all-to-all)."""
    cp = group.size
    b, a_q, s, d = out.shape
    n = s // (2 * cp)
    gathered = zigzag_order(2 * cp, cp, device=out.device)  # [2cp] natural chunk of each slot
    chunks = out.reshape(b, a_q, 2 * cp, n, d).permute(2, 1, 0, 3, 4)  # [2cp, a_q, b, n, d]
    send = chunks.index_select(0, gathered).view(cp, 2, a_q, b, n, d)  # by destination rank
    recv = all_to_all(send, group, name=name)  # [cp (head chunk), 2, a_q, b, n, d]
    return recv.permute(3, 0, 2, 1, 4, 5).reshape(b, cp * a_q, 2 * n, d)  # [b, a_l, s_l, d]


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup,
                         attend: Attend) -> torch.Tensor:
    """Context-parallel attention by a head split (see the module doc for maths and bytes).

    q [b, a_l, s_l, d], k/v [b, kv_l, s_l, d]: this cp rank's zigzag local rows (s = cp s_l).
    ``attend(q [b, a_l/cp, s, d], k/v [b, h_kv, s, d], head_offset)`` runs on the natural-order
    full sequence (h_kv = kv_l / cp, or 1 replicated head when kv_l < cp) and returns
    [b, a_l/cp, s, d]. Returns [b, a_l, s_l, d] in zigzag local order. Differentiable: the
    backward is the two all-to-alls' inverses around ``attend``'s backward. A group of one
    rank calls ``attend(q, k, v, 0)`` directly (local order = natural order there).
    """
    if k.shape != v.shape or q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected q [b, a, s_l, d] and k, v of one shape [b, kv, s_l, d]")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in b, s_l or d")
    cp = group.size
    kv_heads_per_rank(q.shape[1], k.shape[1], cp)
    if cp == 1:
        return attend(q, k, v, 0)
    check_divisible(q.shape[2] * cp, cp)
    index = _kv_index(k.shape[1], cp, k.device)
    if index is not None:  # one kv head per rank, replicated; backward: index_add (sum)
        k, v = k.index_select(1, index), v.index_select(1, index)  # [b, cp, s_l, d]
    q_h, k_h, v_h = _to_heads([q, k, v], group, "cp_qkv")  # [b, a_q | h_kv, s, d]
    out = attend(q_h, k_h, v_h, group.rank * q_h.shape[1])  # [b, a_q, s, d]
    if out.shape != q_h.shape:
        raise ValueError(f"attend returned {tuple(out.shape)}, expected {tuple(q_h.shape)}")
    return _to_sequence(out, group, "cp_out")  # [b, a_l, s_l, d]
