"""Expert tensor parallelism: the token exchange around the grouped GEMMs of split experts.

With expert tp degree n (``parallel.expert_tp``, Megatron's MoE parallel folding), the n ranks
of an expert-tp group hold the same E_l experts of their ep rank, each a slice of every
expert's matrices: gate and up column-parallel (rows [r f/n, (r+1) f/n) of G_e, U_e
[f, h]), down row-parallel (columns [r f/n, (r+1) f/n) of D_e [h, f]). After the ep dispatch,
rank r of the group holds its own t_r token rows, sorted by local expert (counts c_r [E_l]);
every slice of expert e must see every row routed to e by any rank of the group, so ::

    gather   rows of all n ranks (each padded to T = max_r t_r)       [n T, h]
             re-sorted by local expert, then source rank               x_g [t_g, h]
    experts  y_g = act(x_g G_r^T, x_g U_r^T) D_r^T  per expert     partial sums [t_g, h]
    scatter  y_g back to the padded [n T, h] layout, reduce-scatter over the group:
             rank r receives the sum over slices of its own T rows      [T, h] -> [t_r, h]

(t_g = sum_r t_r; the activation is elementwise over f, so the slices' down products sum to
the whole expert's output). Both collectives are the differentiable g / g-bar of sequence
parallelism: backward reduce-scatters the partial input gradients (each slice's dx) and
all-gathers the output gradient. Every expert weight slice's gradient is then complete (its
rows cover every token of the group); a bias added after the reduce-scatter (down) sees only
this rank's rows, so its gradient is a partial sum over the group (``tp_partial_grad`` of an
expert weight: summed over expert tp, see :mod:`colonnade.data_parallel.finalize`).

Wire bytes per rank (i the itemsize): one all-gather of the n E_l int64 counts, the rows'
all-gather (n-1) T h i and reduce-scatter (n-1) T h i forward, the same two backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from colonnade.parallel.comm import CommGroup
from colonnade.tensor_parallel.mappings import gather_seq, reduce_scatter_seq, seq_all_gather


@dataclass
class ExpertTPExchange:
    """What :func:`scatter_partial_rows` needs to undo :func:`gather_rows`."""

    group: CommGroup
    """The expert tp group."""
    index: torch.Tensor
    """[t_g] int64: the padded [n T] row of each gathered row, in expert-major order."""
    padded: int
    """T: rows each rank contributes to the gather."""
    rows: int
    """t_r: this rank's own rows."""


def gather_rows(tokens: torch.Tensor, sizes: list[int], group: CommGroup | None
                ) -> tuple[torch.Tensor, list[int], ExpertTPExchange | None]:
    """tokens [t_r, h] sorted by local expert (``sizes`` [E_l] rows each) -> (x_g [t_g, h]
    every group rank's rows, sorted by local expert then source rank; rows per local expert
    [E_l]; the exchange, None for a group of one: then ``tokens`` and ``sizes`` themselves)."""
    if group is None or group.size == 1:
        return tokens, sizes, None
    n, e_l = group.size, len(sizes)
    counts = torch.tensor(sizes, dtype=torch.int64, device=tokens.device)  # [E_l]
    every = seq_all_gather(counts, group, "moe_etp_counts").view(n, e_l)  # [n, E_l]
    host = every.tolist()  # one sync: the row counts of every rank
    padded = max(1, max(sum(row) for row in host))
    pad = F.pad(tokens, (0, 0, 0, padded - tokens.shape[0]))  # [T, h]
    gathered = gather_seq(pad, group, "moe_etp_gather", "moe_etp_gather_grad")  # [n T, h]
    rows_of = every.sum(1, keepdim=True)  # [n, 1]
    valid = torch.arange(padded, device=tokens.device) < rows_of  # [n, T]
    where = torch.nonzero(valid.reshape(-1)).squeeze(1)  # [t_g] padded rows, source-major
    local = torch.arange(e_l, device=tokens.device).repeat(n)  # [n E_l]
    row_expert = local.repeat_interleave(every.reshape(-1), output_size=where.numel())
    idx = where[torch.sort(row_expert, stable=True).indices]  # [t_g] expert-major
    per_expert = [sum(host[r][e] for r in range(n)) for e in range(e_l)]
    exchange = ExpertTPExchange(group, idx, padded, tokens.shape[0])
    return gathered.index_select(0, idx), per_expert, exchange  # [t_g, h]


def scatter_partial_rows(y: torch.Tensor, exchange: ExpertTPExchange | None) -> torch.Tensor:
    """y [t_g, h] (this slice's partial sums of the gathered rows) -> [t_r, h]: the sum over
    the group's slices of this rank's own rows (``y`` itself without an exchange)."""
    if exchange is None:
        return y
    n = exchange.group.size
    buf = y.new_zeros((n * exchange.padded, y.shape[1])).index_copy(
        0, exchange.index, y)  # [n T, h]
    out = reduce_scatter_seq(buf, exchange.group, "moe_etp_reduce_scatter",
                             "moe_etp_reduce_scatter_grad")  # [T, h]
    return out[:exchange.rows]
