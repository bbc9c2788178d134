"""Mixture-of-experts terms of the planner: parameters, active parameters, expert memory per
rank, MoE activations, dispatch bytes, FLOPs.

Notation: h hidden, E routed experts, k top-k, f_e routed expert width, f_s shared expert width
(0: none), f the dense MLP width, c the MLP's h x f matrices (3 gated SwiGLU, 2 plain GELU),
n_moe the MoE layers (``ModelConfig.is_moe_layer``), t tp, ep expert-parallel degree,
n the expert tp degree (``parallel.expert_tp``), edp = t cp dp / (ep n), e bytes per
activation element, T the tokens of one micro-batch one rank routes (s/cp b, / t under sp).

Parameters of one MoE layer's MLP (it replaces the dense MLP; attention and norms unchanged):
    router      E h (+ E for the sigmoid router's selection bias: a parameter without gradient)
    routed      E (c h f_e (+ (c - 1) f_e + h with biases))
    shared      c h f_s (+ (c - 1) f_s + h with biases) when f_s > 0, + h for its gate
Dense MLP: c h f (+ (c - 1) f + h).  The model's total is the dense model's with every MoE
layer's MLP replaced; the ACTIVE parameters per token count k of the E routed experts
(total - n_moe routed (1 - k/E)).
Forward FLOPs per token of an MoE layer's MLP: 2 (E h + k c h f_e + c h f_s (+ h gate)),
against the dense 2 c h f; backward 2x (the :mod:`colonnade.models.counts` convention).

Per rank (fullest pipeline stage, L_moe of its MoE layers): routed experts E/ep per layer,
each split over expert tp n (gate / up rows, down columns, their biases; the down bias h
replicated), so L_moe E/ep (c h f_e / n ...) routed-expert parameters, with their own
model-state bytes: W + G + O/S_e, S_e = edp at ZeRO stage 1 (the expert optimizer states are
sharded over expert_dp), 1 at stage 0; router and shared gate replicated, the shared expert
tp-split like the dense MLP.

Activations an MoE layer keeps per micro-batch (recompute none / selective) in place of the
dense MLP's column input E s b h and its 2 (c - 1) E s b f / t (A = max(E, 4)): the layer
input E T h, the router's fp32 copy of it 4 T h (16-bit models only) and its probabilities
A T E, the routing (int64 ids and slot ids 16 T k, top-k weights A T k, their sum A T when
renormalised, the weights in slot order E T k), the dispatched token copies E T k h (uniform
routing: T k rows reach each rank on average), the experts' hidden 2 (c - 1) E T k f_e, their
outputs E T k h and the weighted rows E T k h of the combine; with the z-loss the logits and
log-sum-exp A T (E + 1), with the balancing loss 2 A E; the shared expert 2 (c - 1) E T f_s / t
(its input is the layer input) plus its all-gathered input E s b h under sp.  Measured
(tests/analysis/test_moe.py: saved-tensor hooks on the steady layer, llama / gpt2, with a
shared expert) within 1%.  Full recompute keeps only the layer input, as for a dense layer.

Dispatch bytes one rank sends per MoE layer and micro-batch (CommGroup's wire bytes; e the
model's element bytes, w = max(e, 4) the routing weights', R the rank's kept slots routed to
experts of other ranks, E_l = E/ep):
    all_to_all  the split counts 8 (ep - 1) E_l (int64), then the rows: forward the
                dispatch R h e and the combine R' h e (R' the rows it computed for other
                ranks), backward the same: 2 (R + R') h e + 8 (ep - 1) E_l; under uniform
                routing R = R' = T k (ep - 1)/ep.
    all_gather  forward the sizes 8 (ep - 1), the tokens (ep - 1) T h e, their weights
                (ep - 1) T k w and ids (ep - 1) T k 8, the outputs' reduce-scatter
                (ep - 1) T h e; backward the transposes of the tokens', weights' and outputs'
                collectives: (ep - 1) (4 T h e + 2 T k w + 8 T k + 8), independent of routing.
Both are 0 at ep = 1.  Expert tp n > 1 adds, per layer and micro-batch, the counts' all-gather 8 (n
- 1) E_l and the rows' all-gather and reduce-scatter over the expert tp group, forward and backward:
4 (n - 1) T k h e (:func:`expert_tp_bytes`), and keeps the gathered rows, n T k h e, as the experts'
input.  Nothing here is measured yet: the layer and dispatchers are checked against these formulas
by tests/analysis/test_moe*.py as they land.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from colonnade.config.sections import ModelConfig
from colonnade.models.counts import (
    LayerShape,
    active_param_count,
    mtp_moe_layers,
    param_count,
)


def dense_model(model: ModelConfig) -> ModelConfig:
    """``model`` with every MLP dense (num_experts = 0): the shape of its non-MoE parts."""
    return dataclasses.replace(model, num_experts=0) if model.moe else model


@dataclass(frozen=True)
class MoEShape:
    """The numbers of a model's MoE layers the formulas need (module docstring notation)."""

    hidden: int
    """h."""
    experts: int
    """E, routed experts per MoE layer (0: a dense model)."""
    top_k: int
    """k, experts per token."""
    expert_ffn: int
    """f_e, routed expert width."""
    shared_ffn: int
    """f_s, shared expert width (0: none)."""
    shared_gate: bool
    """The shared expert's output is gated (a [1, h] weight)."""
    sigmoid: bool
    """Sigmoid router: an [E] selection bias parameter (no gradient)."""
    dense_ffn: int
    """f, the dense MLP width (first dense layers, and what an MoE layer replaces)."""
    matrices: int
    """c, h x f matrices of one MLP (3 gated, 2 plain)."""
    bias: bool
    """Linear layers have biases."""
    moe_layers: tuple[int, ...]
    """Global indices of the MoE layers."""
    layers: int
    """All layers, l."""
    z_loss: bool = False
    """The router z-loss is on (keeps the logits and their log-sum-exp for backward)."""
    aux_loss: bool = False
    """The load-balancing loss is on."""
    norm_topk: bool = True
    """The k kept weights are renormalised (keeps their sum)."""
    router_bias: bool = False
    """The router's logits have a learned bias [E] (model.moe_router_bias, gpt-oss)."""
    clamped_swiglu: bool = False
    """gpt-oss's experts: their activation keeps only gate and up (moe.experts.ClampedSwiGLU),
    one [T k, f] tensor less than SwiGLU's gate, silu(gate), up."""
    mtp_moe: int = 0
    """MoE layers of the multi-token-prediction modules (global indices l ..), held by the
    last virtual stage beside its own layers."""

    @classmethod
    def of(cls, model: ModelConfig) -> MoEShape:
        """Resolve ``model``'s MoE facts (the MLP kind from its dense architecture); cached
        per model (the planner asks for it once per stage of every layout it searches)."""
        return _moe_shape(cls, model)

    @classmethod
    def _resolve(cls, model: ModelConfig) -> MoEShape:
        dense = LayerShape.of(dense_model(model))
        return cls(hidden=model.hidden_size, experts=model.num_experts,
                   top_k=model.moe_top_k if model.moe else 0,
                   expert_ffn=model.expert_ffn_size if model.moe else 0,
                   shared_ffn=model.moe_shared_expert_ffn_hidden_size if model.moe else 0,
                   shared_gate=model.moe and model.moe_shared_expert_gate,
                   sigmoid=model.moe and model.moe_router == "sigmoid",
                   dense_ffn=dense.ffn, matrices=dense.mlp_matrices, bias=model.bias,
                   moe_layers=tuple(i for i in range(model.num_layers)
                                    if model.is_moe_layer(i)),
                   layers=model.num_layers, z_loss=model.moe_z_loss_coeff > 0,
                   aux_loss=model.moe_aux_loss_coeff > 0,
                   norm_topk=model.moe_norm_topk_prob,
                   router_bias=model.moe and model.moe_router_bias,
                   clamped_swiglu=bool(model.traits and model.traits.clamped_swiglu),
                   mtp_moe=mtp_moe_layers(model))

    @property
    def moe(self) -> bool:
        """Any MoE layer."""
        return bool(self.moe_layers)

    def mlp_params(self, width: int) -> int:
        """Parameters of one MLP of ``width``: c h f (+ (c - 1) f + h with biases)."""
        if width == 0:
            return 0
        return self.matrices * self.hidden * width + (
            (self.matrices - 1) * width + self.hidden if self.bias else 0)

    @property
    def expert_params(self) -> int:
        """One routed expert's parameters."""
        return self.mlp_params(self.expert_ffn)

    @property
    def routed_params(self) -> int:
        """Routed experts of one MoE layer: E x one expert."""
        return self.experts * self.expert_params

    @property
    def router_params(self) -> int:
        """Router weight E h (+ the sigmoid router's E selection biases, + the E logit
        biases of model.moe_router_bias)."""
        biases = int(self.sigmoid) + int(self.router_bias)
        return self.experts * self.hidden + biases * self.experts

    @property
    def shared_params(self) -> int:
        """Shared expert (+ its gate h)."""
        return self.mlp_params(self.shared_ffn) + (self.hidden if self.shared_gate else 0)

    @property
    def moe_mlp_params(self) -> int:
        """One MoE layer's MLP: router + routed + shared."""
        return self.router_params + self.routed_params + self.shared_params

    def moe_layers_in(self, first: int, count: int) -> int:
        """MoE layers among global layers [first, first + count)."""
        return sum(1 for i in self.moe_layers if first <= i < first + count)

    def moe_layers_of(self, layers: tuple[int, ...], head: bool) -> int:
        """MoE layers among global ``layers``, plus the MTP modules' when ``head`` (the stage
        holding the head): a stage of uneven stages."""
        return sum(1 for i in layers if i in self.moe_layers) + (self.mtp_moe if head else 0)

    def max_stage_moe_layers(self, pp: int, placement: str = "loop") -> int:
        """MoE layers of the pipeline stage holding the most: contiguous l/pp blocks (the
        interleaved schedule's chunks are not told apart), or with the "v" placement (ZB-V)
        stage j's two chunks of l/(2 pp) layers, virtual stages j and 2 pp - 1 - j."""
        if placement == "v":
            return max(self.chunk_moe_layers(pp, 2, j)
                       + self.chunk_moe_layers(pp, 2, 2 * pp - 1 - j) for j in range(pp))
        per = self.layers // pp
        return max(self.moe_layers_in(j * per, per) + (self.mtp_moe if j == pp - 1 else 0)
                   for j in range(pp))

    def chunk_moe_layers(self, pp: int, vp: int, v: int) -> int:
        """MoE layers of virtual stage ``v`` of pp x vp (layers [v c, (v + 1) c), c = l/(pp vp))."""
        per = self.layers // (pp * vp)
        return self.moe_layers_in(v * per, per) + (self.mtp_moe if v == pp * vp - 1 else 0)

    def stage_moe_layers(self, pp: int, stage: str, placement: str = "loop") -> int:
        """MoE layers of pipeline ``stage``: 'only' / 'first' (layers [0, l/pp)), 'last'
        (the last l/pp), 'ends' (ZB-V's stage 0: the first and the last l/(2 pp)), 'max'
        (the stage holding the most, in ``placement``)."""
        per = self.layers // pp
        if stage == "max":
            return self.max_stage_moe_layers(pp, placement)
        if stage == "ends":
            return self.chunk_moe_layers(pp, 2, 0) + self.chunk_moe_layers(pp, 2, 2 * pp - 1)
        mtp = self.mtp_moe if stage in ("last", "only") else 0  # the MTP modules' layers
        return self.moe_layers_in((pp - 1) * per if stage == "last" else 0, per) + mtp


@functools.lru_cache(maxsize=64)
def _moe_shape(cls: type[MoEShape], model: ModelConfig) -> MoEShape:
    """:meth:`MoEShape.of`, once per model."""
    return cls._resolve(model)


def moe_param_counts(model: ModelConfig) -> dict[str, int]:
    """``total`` and ``active`` (per token) parameters, the multi-token-prediction modules
    included (the one counter, :func:`colonnade.models.counts.param_count` and
    :func:`~colonnade.models.counts.active_param_count`), ``routed`` (all routed experts of
    the main layers), ``router``, ``shared``, per ``expert`` and ``moe_layers`` (module
    docstring)."""
    x = MoEShape.of(model)
    n = len(x.moe_layers)
    return {"total": param_count(model)["total"], "active": active_param_count(model),
            "routed": n * x.routed_params,
            "router": n * x.router_params, "shared": n * x.shared_params,
            "expert": x.expert_params, "moe_layers": n}


def mlp_forward_flops_per_token(x: MoEShape) -> tuple[float, float]:
    """(MoE layer MLP, dense MLP) forward FLOPs per token: 2 (E h + k c h f_e + c h f_s
    (+ h)) and 2 c h f."""
    moe = 2.0 * (x.experts * x.hidden + x.top_k * x.matrices * x.hidden * x.expert_ffn
                 + x.matrices * x.hidden * x.shared_ffn + (x.hidden if x.shared_gate else 0))
    return moe, 2.0 * x.matrices * x.hidden * x.dense_ffn


def moe_flops_delta_per_token(model: ModelConfig) -> float:
    """Forward FLOPs per token the MoE layers add over the dense model (negative when the
    active experts are narrower than the dense MLP): n_moe (MoE MLP - dense MLP)."""
    x = MoEShape.of(model)
    moe, dense = mlp_forward_flops_per_token(x)
    return len(x.moe_layers) * (moe - dense)


def active_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token with only the active experts counted (3 x forward):
    the dense model's :func:`~colonnade.models.counts.flops_per_token` + 3 x the MoE delta."""
    from colonnade.models.counts import flops_per_token

    return flops_per_token(dense_model(model), seq_len) + 3.0 * moe_flops_delta_per_token(model)


def expert_params_per_rank(x: MoEShape, pp: int, ep: int, stage: str = "max", *,
                           moe_layers: int | None = None, etp: int = 1) -> float:
    """Routed-expert parameters held by one rank of ``stage``: L_moe E/ep experts, each
    split over expert tp ``etp`` but for its replicated down bias h:
    (c h f_e (+ (c - 1) f_e)) / etp (+ h) (``moe_layers``: L_moe when known, as under uneven
    stages; None: the even split's)."""
    if not x.moe:
        return 0.0
    if x.experts % ep:
        raise ValueError(f"parallel.ep={ep} must divide model.num_experts={x.experts}.")
    down_bias = x.hidden if x.bias else 0
    per_expert = (x.expert_params - down_bias) / etp + down_bias
    count = x.stage_moe_layers(pp, stage) if moe_layers is None else moe_layers
    return float(count * (x.experts // ep) * per_expert)


def moe_nonexpert_delta_per_rank(x: MoEShape, pp: int, tp: int, stage: str = "max",
                                 moe_layers: int | None = None) -> float:
    """Non-expert parameters one rank of ``stage`` holds beyond the dense model, per its MoE
    layers (``moe_layers`` when known, as under uneven stages): router (+ gate) replicated,
    shared expert / t, minus the dense MLP / t (its row bias h replicated in both)."""
    def local(width: int) -> float:
        if width == 0:
            return 0.0
        sharded = x.matrices * x.hidden * width + ((x.matrices - 1) * width if x.bias else 0)
        return sharded / tp + (x.hidden if x.bias else 0)

    per = x.router_params + (x.hidden if x.shared_gate else 0) + local(x.shared_ffn)
    count = x.stage_moe_layers(pp, stage) if moe_layers is None else moe_layers
    return count * (per - local(x.dense_ffn))


def moe_activation_terms(x: MoEShape, tokens: float, full_rows: float, elem: int, tp: int,
                         sp: bool, etp: int = 1) -> dict[str, float]:
    """Bytes one MoE layer's MLP keeps for backward beyond the layer's attention half, per
    micro-batch on one rank (module docstring): ``tokens`` T routed by the rank,
    ``full_rows`` s_l b (the all-gathered rows under sp); A = max(E, 4). Under expert tp
    ``etp`` the experts' input is the group's rows, etp T k h, and their hidden the same
    bytes (etp x the rows, 1/etp of the width)."""
    k, h, e, a = x.top_k, x.hidden, elem, max(elem, 4)
    terms = {"moe_input": e * tokens * h,
             "router_fp32_input": (4.0 * tokens * h) if e < 4 else 0.0,
             "router_probs": a * tokens * x.experts,
             # int64 expert ids [T, k] and kept slot ids [T k], the top-k weights [T, k]
             # (+ their sum when renormalised), the weights in slot order [T k, 1]
             "routing": 16.0 * tokens * k + a * tokens * k + (a * tokens if x.norm_topk else 0)
             + e * tokens * k,
             "dispatched": e * tokens * k * h * etp,
             "expert_hidden": (2.0 * (x.matrices - 1) - x.clamped_swiglu) * e * tokens * k
             * x.expert_ffn,
             "expert_out": e * tokens * k * h,
             "combine_rows": e * tokens * k * h}
    if x.z_loss:
        terms["z_loss"] = a * tokens * (x.experts + 1)  # fp32 logits [T, E], logsumexp [T]
    if x.aux_loss:
        terms["aux_loss"] = 2.0 * a * x.experts  # f_i and P_i
    if x.shared_ffn:
        terms["shared_hidden"] = 2.0 * (x.matrices - 1) * e * full_rows * x.shared_ffn / tp
        if sp and tp > 1:
            terms["shared_input"] = e * full_rows * h
    return terms


def dense_mlp_activation_bytes(x: MoEShape, full_rows: float, elem: int, tp: int) -> float:
    """What the activation model counts for a dense MLP: its column input E s b h and
    2 (c - 1) E s b f / t (:mod:`colonnade.analysis.activations`)."""
    return elem * full_rows * x.hidden + 2.0 * (x.matrices - 1) * elem * full_rows \
        * x.dense_ffn / tp


def all_to_all_bytes(remote: float, hidden: int, elem: int, ep: int, local_experts: int,
                     received: float | None = None) -> float:
    """'all_to_all' wire bytes of one rank, one layer, forward + backward: the rows it sends
    to other ranks' experts (``remote``, R) go out in the dispatch and in the combine's
    backward, the rows it computed for other ranks (``received``, R'; None: = R, as under
    uniform routing) in the combine and the dispatch's backward: 2 (R + R') h e +
    8 (ep - 1) E_l."""
    if ep == 1:
        return 0.0
    back = remote if received is None else received
    return 2.0 * (remote + back) * hidden * elem + 8.0 * (ep - 1) * local_experts


def all_gather_bytes(tokens: float, top_k: int, hidden: int, elem: int, ep: int) -> float:
    """'all_gather' wire bytes of one rank, one layer, forward + backward (``tokens`` T, the
    largest of the ep group's): (ep - 1) (4 T h e + 2 T k w + 8 T k + 8), w = max(e, 4)."""
    w = max(elem, 4)
    return (ep - 1) * (4.0 * tokens * hidden * elem + 2.0 * tokens * top_k * w
                       + 8.0 * tokens * top_k + 8.0)


def expert_tp_bytes(rows: float, hidden: int, elem: int, etp: int, local_experts: int
                    ) -> float:
    """Expert tp wire bytes of one rank, one layer, forward + backward: the all-gather of the
    group's counts 8 (etp - 1) E_l, then the rows' all-gather and the partial sums'
    reduce-scatter, forward and (transposed) backward: 4 (etp - 1) R h e, ``rows`` R the
    rows each rank of the group received (T k under uniform routing); 0 at etp = 1."""
    if etp == 1:
        return 0.0
    return 4.0 * (etp - 1) * rows * hidden * elem + 8.0 * (etp - 1) * local_experts


def dispatch_bytes(x: MoEShape, tokens: float, elem: int, ep: int, kind: str,
                   etp: int = 1) -> float:
    """Bytes one rank sends per MoE layer per micro-batch, forward + backward, for
    ``kind`` 'all_to_all' (uniform routing) or 'all_gather' (module docstring), plus the
    expert tp exchange (:func:`expert_tp_bytes`); 0 at ep = etp = 1."""
    if not x.moe:
        return 0.0
    etp_part = expert_tp_bytes(tokens * x.top_k, x.hidden, elem, etp, x.experts // ep)
    if ep == 1:
        return etp_part
    return etp_part + _ep_bytes(x, tokens, elem, ep, kind)


def _ep_bytes(x: MoEShape, tokens: float, elem: int, ep: int, kind: str) -> float:
    """The dispatcher's bytes of :func:`dispatch_bytes` (ep > 1)."""
    if kind == "all_to_all":
        remote = tokens * x.top_k * (ep - 1) / ep
        return all_to_all_bytes(remote, x.hidden, elem, ep, x.experts // ep)
    if kind == "all_gather":
        return all_gather_bytes(tokens, x.top_k, x.hidden, elem, ep)
    raise ValueError(f"parallel.moe_dispatcher='{kind}' is unknown; use all_to_all or "
                     "all_gather.")


def step_dispatch_bytes(model: ModelConfig, tokens: float, microbatches: int, pp: int,
                        elem: int, ep: int, kind: str, etp: int = 1) -> float:
    """Dispatch bytes one rank of the fullest stage sends per step: its MoE layers x
    micro-batches x :func:`dispatch_bytes`."""
    x = MoEShape.of(model)
    if not x.moe:
        return 0.0
    return x.max_stage_moe_layers(pp) * microbatches * dispatch_bytes(x, tokens, elem, ep, kind,
                                                                      etp)


def capacity_slots(capacity_factor: float, seq_len: int, top_k: int, experts: int) -> int:
    """Slots per sequence and expert: C = ceil(c s k / E)."""
    return math.ceil(capacity_factor * seq_len * top_k / experts)
