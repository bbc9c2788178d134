"""The token router of a mixture-of-experts layer, its auxiliary losses and the bias update.

Router (t tokens, h hidden, E experts, k per token; x [t, h] in the contract's row order, the
[s_l, b] flattening, s major):

* logits ``z = x W^T (+ c)`` [t, E] in fp32 (fp64 when the model is fp64), W [E, h]
  replicated, c [E] the learned ``bias`` with ``model.moe_router_bias`` (gpt-oss);
* 'softmax': ``p = softmax(z)`` [t, E]; the k largest ``p`` are chosen, their values are the
  weights, divided by their sum when ``moe_norm_topk_prob``; ``probs = p``;
* 'sigmoid' (DeepSeek-V3): scores ``g = sigmoid(z)`` [t, E]; the k largest ``g + b`` are
  chosen (b [E] the selection bias ``expert_bias``, never a weight), among the experts of the
  ``moe_topk_group`` best of ``moe_n_group`` groups when n_group > 1 (:func:`group_limit`);
  weights = chosen ``g``, divided by their sum when ``moe_norm_topk_prob``, times
  ``moe_routed_scaling_factor``; ``probs = g / sum_e g_e`` (per token) for the balancing loss.

Ties are broken towards the lower expert id (a stable descending sort), so the choice is
deterministic and identical in every layout.

Auxiliary losses (already multiplied by their coefficients):

* load balance (Switch / GShard): ``L_b = c_b E sum_i f_i P_i`` with f_i = (slots routed to
  i) / (T k) (counts: no gradient) and P_i = (1/T) sum_t probs[t, i] (differentiable), over
  a token set of T tokens: each sequence ('seq', then the mean over sequences) or the
  micro-batch of every dp x cp x tp(sp) rank ('global');
* z-loss (ST-MoE): ``L_z = c_z (1/T) sum_t logsumexp(z_t)^2`` over the 'global' token set.

Sums over other ranks' tokens are all-reduced (CommGroup, name 'moe_aux') by
:class:`SumOver`, whose backward sends the gradient of the sums back to this rank's own
tokens unchanged (x dp over the dp axis, see :func:`aux_losses`): summed over the ranks the
local gradients are those of the one-process loss over all tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.moe.state import MoEState
from colonnade.parallel.comm import CommGroup
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.sharding import Sharding, make_param, tp_coords


@dataclass
class Routing:
    """The router's decision for t tokens (E experts, k per token)."""

    expert: torch.Tensor
    """[t, k] int64 global expert ids, in descending order of the selection score."""
    weight: torch.Tensor
    """[t, k] fp32 (fp64 for fp64 models) combine weights of the chosen experts."""
    probs: torch.Tensor
    """[t, E] fp32 softmax probabilities, or sigmoid scores normalised per token (aux loss)."""
    logits: torch.Tensor
    """[t, E] fp32 router logits (z-loss)."""


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """The router's compute dtype: fp32, or the model's dtype when wider (fp64 parity)."""
    return torch.promote_types(dtype, torch.float32)


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[t, E] -> [t, k] int64 indices of the k largest scores per row, descending; equal
    scores keep the lower index first (stable sort), unlike ``torch.topk``."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


class Router(nn.Module):
    """x [t, h] -> :class:`Routing`. Parameters ``{key}.weight`` [E, h] (replicated; under sp
    its gradient is a partial sum over tp) and, for the sigmoid router, ``{key}.expert_bias``
    [E] (zeros, requires_grad False, kept in at least fp32; moved by
    :func:`update_expert_bias`). ``model.moe_router`` is checked by config/validate.py."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str) -> None:
        super().__init__()
        e, h = cfg.num_experts, cfg.hidden_size
        self.num_experts, self.k, self.kind = e, cfg.moe_top_k, cfg.moe_router
        self.norm_topk = cfg.moe_norm_topk_prob
        self.groups, self.topk_group = cfg.moe_n_group, cfg.moe_topk_group
        self.scale = cfg.moe_routed_scaling_factor
        self.weight = ctx.param(Sharding(f"{key}.weight", (e, h), sp_partial_grad=ctx.sp),
                                cfg.init_std)
        self.bias = (ctx.param(Sharding(f"{key}.bias", (e,), sp_partial_grad=ctx.sp), 0.0,
                               "zeros") if cfg.moe_router_bias else None)
        """[E] added to the logits (gpt-oss's linear router), a partial gradient under sp."""
        self.expert_bias: nn.Parameter | None = None
        if self.kind == "sigmoid":
            # never deferred to the meta device (ZeRO-3): not a trained weight, so no
            # data-parallel buffer materialises it
            bias = make_param(Sharding(f"{key}.expert_bias", (e,)), tp_coords(ctx.tp_rank, ctx.tp),
                              ctx.seed, 0.0, "zeros", router_dtype(ctx.dtype), ctx.device,
                              ctx.device)
            bias.requires_grad_(False)
            self.expert_bias = bias

    def forward(self, x: torch.Tensor) -> Routing:
        """x [t, h] -> Routing (module docstring for the formulas)."""
        dtype = router_dtype(x.dtype)
        bias = self.bias.to(dtype) if self.bias is not None else None
        logits = F.linear(x.to(dtype), self.weight.to(dtype), bias)  # [t, E]
        if self.kind == "softmax":
            probs = torch.softmax(logits, dim=-1)  # [t, E]
            expert = top_k(probs.detach(), self.k)  # [t, k]
            weight = probs.gather(1, expert)  # [t, k]
            if self.norm_topk:
                weight = weight / weight.sum(dim=-1, keepdim=True)
            return Routing(expert, weight, probs, logits)
        scores = torch.sigmoid(logits)  # [t, E]
        select = scores.detach()
        if self.expert_bias is not None:
            select = select + self.expert_bias.to(dtype)
        if self.groups > 1:
            select = group_limit(select, self.groups, self.topk_group)
        expert = top_k(select, self.k)  # [t, k]
        weight = scores.gather(1, expert)  # [t, k]
        if self.norm_topk:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weight = weight * self.scale
        probs = scores / scores.sum(dim=-1, keepdim=True)  # [t, E]
        return Routing(expert, weight, probs, logits)


def group_limit(select: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3): the E experts form ``groups`` equal groups of
    consecutive ids; a group scores the sum of its two largest ``select`` values, the
    ``keep`` best groups stay eligible (ties: the lower group id) and every other expert's
    selection score becomes -inf. select [t, E] -> [t, E]."""
    t, e = select.shape
    grouped = select.view(t, groups, e // groups)  # [t, G, E/G]
    score = grouped.topk(min(2, e // groups), dim=-1).values.sum(dim=-1)  # [t, G]
    best = top_k(score, keep)  # [t, keep]
    allowed = torch.zeros(t, groups, dtype=torch.bool, device=select.device)
    allowed.scatter_(1, best, True)  # [t, G]
    allowed = allowed.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)  # [t, E]
    return select.masked_fill(~allowed, float("-inf"))


class SumOver(torch.autograd.Function):
    """Forward: ``x`` summed over every group (all-reduce, name 'moe_aux'; a new tensor).
    Backward: the gradient times ``scale``, no communication (every rank holds the same
    loss of the sums; each back-propagates it into its own tokens only)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: list[CommGroup],
                scale: float) -> torch.Tensor:
        ctx.scale = scale
        out = x.clone()
        for group in groups:
            if group.size > 1:
                group.all_reduce(out, name="moe_aux")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.scale if ctx.scale != 1.0 else grad, None, None


def sequence_groups(ctx: ParallelContext) -> list[CommGroup]:
    """The groups holding other rows of this rank's sequences: tp under sp, and cp."""
    groups = [ctx.group] if ctx.sp and ctx.tp > 1 else []
    if ctx.cp is not None and ctx.cp.size > 1:
        groups.append(ctx.cp)
    return groups


def global_groups(ctx: ParallelContext, state: MoEState | None) -> tuple[list[CommGroup], int]:
    """The groups spanning the micro-batch of every dp x cp x tp(sp) rank, and dp.

    The dp x cp group comes from ``state.dp_cp`` (set by the trainer); without it the cp group
    stands for it and dp is 1."""
    groups = [ctx.group] if ctx.sp and ctx.tp > 1 else []
    dp_cp = state.dp_cp if state is not None else None
    if dp_cp is not None:
        groups.append(dp_cp)
        return groups, max(dp_cp.size // ctx.cp_size, 1)
    if ctx.cp is not None and ctx.cp.size > 1:
        groups.append(ctx.cp)
    return groups, 1


def group_size(groups: list[CommGroup]) -> int:
    """Product of the groups' sizes (ranks whose tokens a sum over them covers)."""
    n = 1
    for group in groups:
        n *= group.size
    return n


def seq_balance_loss(routing: Routing, ctx: ParallelContext, coeff: float,
                     seq_len_local: int, batch: int) -> torch.Tensor:
    """'seq' balancing loss: ``c E mean_j sum_i f_ji P_ji``, f_ji = C_ji / (s k), P_ji =
    S_ji / s for sequence j of length s = s_l x (tp(sp) x cp ranks); C_ji [b, E] slot counts,
    S_ji [b, E] probability sums, both summed over the sequence group."""
    e, k = routing.probs.shape[1], routing.expert.shape[1]
    sample = torch.arange(routing.expert.shape[0], device=routing.expert.device) % batch  # [t]
    index = (sample[:, None] * e + routing.expert).flatten()  # [t k]
    counts = torch.bincount(index, minlength=batch * e).view(batch, e)  # [b, E]
    psum = routing.probs.view(seq_len_local, batch, e).sum(dim=0)  # [b, E]
    groups = sequence_groups(ctx)
    both = SumOver.apply(torch.stack([counts.to(psum.dtype), psum]), groups, 1.0)  # [2, b, E]
    s = seq_len_local * group_size(groups)
    f, p = both[0] / (s * k), both[1] / s  # [b, E]
    return coeff * e * (f * p).sum(dim=-1).mean()


def aux_losses(routing: Routing, cfg: ModelConfig, ctx: ParallelContext, seq_len_local: int,
               batch: int) -> dict[str, torch.Tensor]:
    """The layer's non-zero auxiliary losses, 0-d, already x coefficients: 'load_balance'
    and 'z_loss' (module docstring). ``routing`` covers t = seq_len_local x batch rows.

    Over the 'global' token set (T = t x ranks of the groups) the sums of counts, probability
    sums and squared logsumexps are all-reduced together, once. Every rank of the dp x cp x
    tp(sp) group then holds the same loss, a function of all T tokens; a sequence-group rank
    back-propagates it into its own tokens (identity backward), so the tp / cp ranks' partial
    gradients sum to the one-process gradient. Along dp each of the dp micro-batches counts
    this loss as its own (the objective is a mean over the global batch's micro-batches, see
    :func:`~colonnade.moe.state.attach_aux_loss`), so the backward multiplies by dp."""
    state: MoEState | None = ctx.moe
    e, k = cfg.num_experts, cfg.moe_top_k
    out: dict[str, torch.Tensor] = {}
    balance = cfg.moe_aux_loss_coeff > 0
    if balance and cfg.moe_aux_loss_type == "seq":
        out["load_balance"] = seq_balance_loss(routing, ctx, cfg.moe_aux_loss_coeff,
                                               seq_len_local, batch)
        balance = False
    z = cfg.moe_z_loss_coeff > 0
    if not (balance or z):
        return out
    parts = []  # sums over the global token set, reduced in one all-reduce
    if balance:
        counts = torch.bincount(routing.expert.flatten(), minlength=e)  # [E]
        parts += [counts.to(routing.probs.dtype), routing.probs.sum(dim=0)]  # [E], [E]
    if z:
        lse = torch.logsumexp(routing.logits, dim=-1)  # [t]
        parts.append((lse * lse).sum().reshape(1))  # [1]
    groups, dp = global_groups(ctx, state)
    sums = SumOver.apply(torch.cat(parts), groups, float(dp))  # [2E (+1)]
    tokens = routing.expert.shape[0] * group_size(groups)
    if balance:
        f, p = sums[:e] / (tokens * k), sums[e:2 * e] / tokens  # [E]
        out["load_balance"] = cfg.moe_aux_loss_coeff * e * (f * p).sum()
    if z:
        out["z_loss"] = cfg.moe_z_loss_coeff * sums[-1] / tokens
    return out


@torch.no_grad()
def update_expert_bias(router: Router, loads: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: ``b_i += rate x sign(mean(loads)
    - loads_i)`` with ``loads`` [E] the step's global token counts per expert (the trainer
    all-reduces them). Overloaded experts are chosen less, idle ones more. No-op for the
    softmax router or rate 0."""
    bias = router.expert_bias
    if bias is None or rate == 0:
        return
    load = loads.to(device=bias.device, dtype=bias.dtype)  # [E]
    bias.add_(rate * torch.sign(load.mean() - load))
