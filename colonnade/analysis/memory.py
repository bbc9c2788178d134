"""Memory per device: model states (ZeRO stages 0-3), activations (Korthikanti et al.), buffers.

Model states, derived from what Colonnade keeps per parameter held by the device
(P_dev = the stage's parameters / tp; S = the shard group: dp ranks, or
``parallel.zero_shard_size`` of them with hybrid sharding; E the model's element bytes):
    weights W:    the model dtype, E (2 bf16/fp16, 4 fp32, 8 fp64).
    gradients G:  Megatron's fp32 main-gradient accumulation: 4 for 16-bit models (fp64 for
                  fp64 models: G = E); the ZeRO paper counts fp16 gradients (2) instead.
    optimizer O:  Adam's fp32 master, m and v: 12 for 16-bit models; an fp32/fp64 model's
                  parameters are their own masters, so m and v only: 2E (8 for fp32).
                  Precision-aware states (:func:`optimizer_bytes_per_element`): m and v of
                  ``optim.state_dtype`` (2 bytes each in bf16), and no master with
                  ``optim.master_dtype='bf16'`` on a bf16 model: O = M + 2 S, e.g. bf16 states
                  with fp32 masters 8, bf16 states and masters 4. With optim.name='muon'
                  the hidden matrices' elements keep one momentum instead of m and v: M + S
                  (:func:`layer_muon_params`: attention and dense MLP matrices of each layer,
                  the routed experts; the tests tie it to optim.muon.muon_matrices).
Per stage, bytes per parameter (:func:`model_state_bytes`):
    stage 0 (all-reduce)       W + G + O                  bf16 18,     fp32 16
    stage 1 (optimizer states) W + G + O/S                bf16 6 + 12/S (Megatron's; the
                                                          paper's 4 + 12/Nd), fp32 8 + 8/S
    stage 2 (+ gradients)      W + (G + O)/S              bf16 2 + 16/S (paper 2 + 14/Nd)
    stage 3 (+ parameters)     (W + G + O)/S              bf16 18/S     (paper 16/Nd)
plus the stage's transient buffers (:func:`zero_buffer_bytes`, B = bucket elements =
min(P_dev, max(bucket_size, the largest parameter)): a bucket closes once it holds
``bucket_size`` elements and never splits a parameter, so a bucket of one parameter can be
larger):
    stage 2/3 gradient buckets (data_parallel/grad_shards.py): each micro-batch's backward
        fills a full-size bucket buffer of the reduce dtype (R = 4 fp32, 2 bf16; 8 for fp64
        models), reduce-scattered into a [B/S] output that is added into the fp32 shard,
        both then freed.  With overlap_grad_reduce at most 2 reduce-scatters are outstanding
        when a third is launched (GRAD_BUCKETS_IN_FLIGHT = 3 buffers with their outputs), and
        the next bucket may already be filling (autograd does not produce gradients in the
        buffer's exact order: SwiGLU's gate and up, attention's q, k, v): 4 B R + 3 B R / S,
        at most (P_dev + B) R + P_dev R / S (with 3 buckets or fewer, a bucket still in
        flight from one micro-batch fills again for the next); without overlap every bucket
        fills before the first is launched: P_dev R + 3 B R / S. (Autograd's per-parameter
        ``.grad`` temporaries, freed as each is copied in, are not counted, as at stages 0
        and 1.)
    stage 3 gathered parameters (data_parallel/param_shards.py): with reshard_after_forward
        the buckets of the module in use plus ``zero_prefetch`` gathered ahead.  Buckets are
        cut by size, not at module boundaries, so a module of U parameters (the largest: the
        MLP, attention, or the embedding / head) touches up to ceil(U/B) + 1 buckets:
        (ceil(U/B) + 1 + prefetch) B E (at most P_dev E); without it (the micro-batch-window
        policy, the default with pp > 1) a chunk's parameters stay gathered from its first
        forward until the step's gradient sync: P_dev E.
The ZeRO paper's own accounting (fp16 gradients, K = 12, no buffers) is kept as
:func:`zero_paper_bytes` for comparison.

Activations of one layer for one micro-batch: :mod:`colonnade.analysis.activations` (the one
model, Korthikanti et al. 2022 per term for this code's layers, checked against measurement;
``Workload.attention='eager'`` gives the paper's GPT exactly, plus LayerNorm statistics and,
under sp, the full column inputs).  Full recompute keeps each layer's input E sbh (/t with sp)
plus one layer's full activations while it is recomputed.

Micro-batches in flight on the first stage (which holds the most): 1 without pp, m for GPipe,
min(p, m) for 1F1B and ZB-H1 (layers per stage x p = all l layers), and for the interleaved
schedule p (1 + (p-1)/(p v)) stage-equivalents (capped at m).
The last stage also keeps the output logits and fp32 softmax, (E + 4) sbV/t, and its loss's
backward briefly holds more gradients of that size (``loss_backward``: 6 sbV at tp 1 in bf16,
4 sbV/t at tp > 1; :func:`loss_backward_bytes`): the H200's measured 1.3B peak.
Zero-bubble schedules (ZB-H1, ZB-V) hold a micro-batch's activations until its W, not its B:
B keeps the chunk's autograd graph (retain_graph) for W, plus the output gradient captured at
each weight boundary (pipeline.split_backward).  ZB-H1's stage s holds p - s micro-batches
between F and B and s between B and W, so every stage holds min(p, m), the last one too, with
as many heads' logits and softmax plus their captured logit gradients, (2E + 4) sbV/t each.
ZB-V (vp = 2, "v" placement, pipeline.zbv) holds at most 2 min(p, m) chunk-activations of
l/(2p) layers on a stage other than 0 (min(p, m) stage-equivalents); its stage 0, 'ends',
holds the embedding and the head (one copy when tied), so it is the fullest: its warm-up
runs min(m, 2p - 1) chunk-0 forwards and every head chunk's F, B and W run back to back, so
it holds min(m, 2p - 1) + 1 chunks ((min(m, 2p - 1) + 1) / 2 stage-equivalents) with as many
embedding dropout masks, and one head's (2E + 4) sbV/t.
Buffers: pipeline send/receive 2 E sbh, the sp all-gather output E sbh.
Context parallelism (cp): the rank holds s/cp rows of every sample, so every activation and
buffer term above is taken at s/cp (activations ~ x 1/cp: no s^2 term, plus the cp
attention's own output and RoPE's gathered cos / sin per layer; see
:mod:`colonnade.analysis.activations`), plus ``cp_buffers``, the peak transient of one layer's
cp attention (ring: 4 kv blocks in flight; all_to_all: dq, dk, dv, dout at full s, heads/cp:
:func:`~colonnade.analysis.activations.cp_buffer_bytes`).  ZeRO shards over dp x cp.
Mixture of experts (:mod:`colonnade.analysis.moe`): each MoE layer of the stage replaces its
dense MLP's parameters by the router, shared expert and E/ep routed experts, the latter with
their own state bytes (ZeRO shards them over edp = tp cp dp / ep, not dp x cp: optimizer
states from stage 1, gradients from stage 2, parameters at stage 3; hybrid sharding over
min(zero_shard_size, edp) of them), and its
MLP activations by the MoE layer's (:func:`~colonnade.analysis.moe.moe_activation_terms`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

from colonnade.analysis.activations import ActivationShape, cp_buffer_bytes, layer_bytes
from colonnade.analysis.hardware import GIB
from colonnade.analysis.layout import ELEMENT_BYTES, ZERO_STAGES, Layout, Workload
from colonnade.analysis.moe import (
    MoEShape,
    dense_mlp_activation_bytes,
    expert_params_per_rank,
    moe_activation_terms,
    moe_nonexpert_delta_per_rank,
)
from colonnade.models.counts import (
    LayerShape,
    embedding_params,
    head_params,
    layer_norm_params,
    layer_params,
    position_params,
)


def zero_paper_bytes(params: float, dp: int, stage: int, k: int = 12) -> float:
    """ZeRO (Rajbhandari et al.) model-state bytes per device, mixed-precision Adam.

    stage 0 (plain dp): (2 + 2 + K) Psi; 1 (P_os): 4 Psi + K Psi/Nd; 2 (P_os+g):
    2 Psi + (2 + K) Psi/Nd; 3 (P_os+g+p): (4 + K) Psi/Nd.
    """
    psi = float(params)
    if stage == 0:
        return (4 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / dp
    if stage == 2:
        return 2 * psi + (2 + k) * psi / dp
    if stage == 3:
        return (4 + k) * psi / dp
    raise ValueError(f"ZeRO stage {stage} is unknown; use 0, 1, 2 or 3.")


GRAD_BUCKETS_IN_FLIGHT = 3
"""Stage 2/3 gradient bucket buffers (each with its reduce-scatter output) alive at once with
overlap: GradShards' 2 outstanding reduce-scatters and the one being launched, after which the
oldest is waited and freed; one more bucket may be filling meanwhile (its input only)."""


def optimizer_bytes_per_element(precision: str, state_dtype: str = "fp32",
                                master_dtype: str = "fp32", muon: bool = False) -> float:
    """O, the optimizer's bytes per owned element (``DistributedOptimizer.state_bytes`` /
    owned elements): M + 2 S (AdamW's m and v; ``muon``: M + S, one momentum) with M = 4 for
    a 16-bit model with fp32 masters (else 0: the parameters are the masters) and S = bytes of
    ``state_dtype`` (8 for fp64 models)."""
    master = 4.0 if precision in ("bf16", "fp16") and master_dtype == "fp32" else 0.0
    state = 8.0 if precision == "fp64" else float(ELEMENT_BYTES[state_dtype])
    return master + (1 if muon else 2) * state


def element_state_bytes(precision: str, state_dtype: str = "fp32", master_dtype: str = "fp32",
                        muon: bool = False) -> tuple[float, float, float]:
    """Unsharded (weight W, gradient G, optimizer O) bytes per parameter for a precision:
    16-bit 2, 4, 12 (fp32 main grads; fp32 master, m, v); fp32/fp64 E, E, 2E (m, v); O from
    :func:`optimizer_bytes_per_element` (bf16 states / masters, a Muon matrix's element)."""
    e = float(ELEMENT_BYTES[precision])
    o = optimizer_bytes_per_element(precision, state_dtype, master_dtype, muon)
    return e, (4.0 if precision in ("bf16", "fp16") else e), o


def stage_state_bytes(precision: str, stage: int, shard: int, state_dtype: str = "fp32",
                      master_dtype: str = "fp32", muon: bool = False
                      ) -> tuple[float, float, float]:
    """(W, G, O) bytes per parameter at ZeRO ``stage`` sharded over ``shard`` ranks:
    stage >= 1 divides O, >= 2 also G, 3 also W by ``shard``."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage {stage} is unknown; use 0, 1, 2 or 3.")
    wb, gb, ob = element_state_bytes(precision, state_dtype, master_dtype, muon)
    return (wb / shard if stage >= 3 else wb, gb / shard if stage >= 2 else gb,
            ob / shard if stage >= 1 else ob)


def model_state_bytes(params: float, shard: int, stage: int, precision: str = "bf16") -> float:
    """Colonnade's persistent model-state bytes per device (no buffers): params x (W+G+O)."""
    return float(params) * sum(stage_state_bytes(precision, stage, shard))


def state_bytes_per_param(w: Workload, layout: Layout, muon: bool = False
                          ) -> tuple[float, float, float]:
    """(weight, gradient, optimizer-state) bytes per parameter held on one device (``muon``:
    of a Muon matrix's element, when ``w.optimizer`` is 'muon')."""
    return stage_state_bytes(w.states_precision, layout.zero, layout.shard, w.state_dtype,
                             w.master_dtype, muon and w.optimizer == "muon")


def layer_muon_params(m: LayerShape, tp: int, dense_mlp: bool = True) -> float:
    """Elements of one layer's Muon matrices (optim.muon.muon_matrices) a tp rank holds:
    attention's q, k, v, o (MLA: its projections, the down projections whole on every rank)
    and, with ``dense_mlp``, the MLP's matrices (an MoE layer's routed experts are counted by
    :func:`_with_moe`); norms and biases are AdamW's."""
    h = m.hidden
    mlp = m.mlp_matrices * h * m.ffn / tp if dense_mlp else 0.0
    if m.mla is not None:
        return mlp + sum(m.mla.local_matrices(h, m.heads, tp))
    return mlp + (2 * h * m.q_hidden + 2 * h * m.kv_hidden) / tp


def stage_optimizer_bytes(w: Workload, layout: Layout, stage: str, params: float) -> float:
    """Optimizer-state bytes of ``params`` parameters of ``stage``: O each, and with Muon its
    layers' hidden matrices at the Muon O (one momentum); MTP modules are counted as AdamW."""
    ob = state_bytes_per_param(w, layout)[2]
    if w.optimizer != "muon":
        return params * ob
    muon = layer_muon_params(w.shape, layout.tp) * stage_layers(w.shape.layers, layout, stage)
    return (params - muon) * ob + muon * state_bytes_per_param(w, layout, muon=True)[2]


def largest_param(m: LayerShape, layout: Layout, stage: str) -> float:
    """Elements of the largest single parameter held by ``stage``: the embedding / head
    (V h / t) on the first and last stages, else a layer's largest matrix."""
    h, t = m.hidden, layout.tp
    biggest = max(h * m.q_hidden, h * m.kv_hidden, h * m.ffn) / t
    if m.mla is not None:  # MLA's matrices (its down projections whole on every tp rank)
        biggest = max(h * m.ffn / t, *m.mla.local_matrices(h, m.heads, t))
    if stage in ("first", "last", "only", "ends"):
        biggest = max(biggest, m.vocab * h / t)
    return biggest


def largest_module(m: LayerShape, layout: Layout, stage: str) -> float:
    """U: parameters of the largest module whose weights one ZeRO-3 gather serves: the MLP
    (its matrices), the attention (q, k, v, o) or, on the first / last stage, the embedding
    or head (V h / t)."""
    h, t = m.hidden, layout.tp
    biggest = max(m.mlp_matrices * h * m.ffn, 2 * h * m.q_hidden + 2 * h * m.kv_hidden) / t
    if m.mla is not None:  # MLA: its matrices and latent norms, the down projections whole
        attention = sum(m.mla.local_matrices(h, m.heads, t)) + m.mla.norm_params
        biggest = max(m.mlp_matrices * h * m.ffn / t, attention)
    if stage in ("first", "last", "only", "ends"):
        biggest = max(biggest, m.vocab * h / t)
    return biggest


def bucket_elements(w: Workload, layout: Layout, stage: str, params: float) -> float:
    """B: elements of one bucket, min(P_dev, max(bucket_size, largest parameter))."""
    return min(params, max(float(w.bucket_size), largest_param(w.shape, layout, stage)))


def zero_buffer_bytes(w: Workload, layout: Layout, stage: str, params: float,
                      module: float = 0.0) -> tuple[float, float]:
    """(gradient bucket bytes, gathered parameter bytes) of stage 2/3 (module docstring);
    ``module``: a module larger than :func:`largest_module` may say (an MoE layer's E/ep
    stacked routed experts, one module)."""
    if layout.zero < 2:
        return 0.0, 0.0
    b = bucket_elements(w, layout, stage, params)
    r, s = w.reduce_bytes, layout.shard
    outputs = min(params, GRAD_BUCKETS_IN_FLIGHT * b) * r / s
    inputs = min(params + b, (GRAD_BUCKETS_IN_FLIGHT + 1) * b) if w.overlap_grad_reduce \
        else params
    grad = inputs * r + outputs
    if layout.zero < 3:
        return grad, 0.0
    if not layout.reshard:
        return grad, params * w.elem
    touched = math.ceil(max(largest_module(w.shape, layout, stage), module) / b) + 1
    return grad, min(params, (touched + w.zero_prefetch) * b) * w.elem


def stage_layers(num_layers: int, layout: Layout, stage: str) -> float:
    """Layers held by one device of ``stage``: l / pp with even stages; with uneven ones
    (``layout.pipeline_layout``) the stage's own count, 'middle' the fullest middle stage."""
    if layout.pipeline_layout is None:
        return num_layers / layout.pp
    return float(layout.stage_layer_count(stage, num_layers))


def stage_moe_count(w: Workload, layout: Layout, stage: str | int) -> int | None:
    """MoE layers of ``stage`` (a kind or a stage index) under uneven stages, the MTP
    modules' with the head; None with the even split (each MoE helper's own count)."""
    if layout.pipeline_layout is None or not w.model.moe:
        return None
    j = layout.stage_index(stage, w.shape.layers)
    held = layout.stage_layers(w.shape.layers)[j]
    return MoEShape.of(w.model).moe_layers_of(held, j == layout.head_stage)


def stage_params(m: LayerShape, layout: Layout, stage: str) -> float:
    """Parameters held by one device of ``stage`` ('first', 'last', 'only', or ZB-V's
    'ends': stage 0 with the embedding and the head, one shared copy when tied; a 'middle'
    stage holds the layers only)."""
    h, t = m.hidden, layout.tp
    replicated = layer_norm_params(m) + (2 * h if m.bias else 0)  # norms, row-parallel biases
    if m.mla is not None:  # MLA's down projections (its latent norms are among the norms)
        replicated += m.mla.replicated_params(h) - m.mla.norm_params
    sharded = layer_params(m) - replicated
    per_layer = sharded / t + replicated
    total = per_layer * stage_layers(m.layers, layout, stage)
    positions = position_params(m)
    embed = (embedding_params(m) - positions) / t + positions
    norm = head_params(m) - (0 if m.tied else m.vocab * h)
    head_local = norm + (0 if m.tied else m.vocab * h / t)
    if stage in ("first", "only", "ends"):
        total += embed
    if stage in ("last", "only", "ends"):
        total += head_local
        if stage == "last" and m.tied:
            total += m.vocab * h / t  # the tied head's copy of the embedding on the last stage
        # multi-token prediction: a layer (its MoE part: analysis.moe), W_eh 2 h^2 and three
        # norms replicated, its own embedding and head split over tp
        total += m.mtp_layers * (per_layer + 2 * h * h + 3 * m.facts.norm_params * h
                                 + 2 * m.vocab * h / t)
    return total


def activation_shape(w: Workload, layout: Layout) -> ActivationShape:
    """The activation model's shape of ``w``'s layers for one micro-batch on one device."""
    return ActivationShape.of(w.shape, w.seq_len, layout.micro_batch, tp=layout.tp,
                              sp=layout.sp, elem=w.elem, attention=w.attention, cp=layout.cp,
                              cp_attention=layout.cp_attention,
                              cp_a2a_size=layout.cp_a2a_size, kernels=w.kernels,
                              sp_regather=w.sp_regather)


def in_flight(layout: Layout, microbatches: int) -> float:
    """Micro-batches (in stage-equivalents) whose activations the first stage holds (ZB-V's
    stage 0: min(m, 2p - 1) + 1 chunks of half a stage, held until their W)."""
    p, m = layout.pp, microbatches
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "zbv":
        return (min(m, 2 * p - 1) + 1) / 2
    if layout.schedule == "interleaved_1f1b":
        return min(p * (1 + (p - 1) / (p * layout.vp)), float(m))
    return float(min(p, m))


SPLIT_SCHEDULES = ("zb_h1", "zbv")
"""Schedules that split the backward into B and W, holding activations until W."""


def stage_flight(layout: Layout, microbatches: int, stage: str) -> float:
    """Micro-batches (stage-equivalents) whose activations ``stage`` holds: the first / only /
    ends stage :func:`in_flight`; another stage all m under GPipe, min(p, m) under the
    zero-bubble schedules (held until W), else 1 (the last stage's B follows its F)."""
    if stage in ("first", "only", "ends"):
        return in_flight(layout, microbatches)
    if layout.pp > 1 and layout.schedule == "gpipe":
        return float(microbatches)
    if layout.pp > 1 and layout.schedule in SPLIT_SCHEDULES:
        return float(min(layout.pp, microbatches))
    return 1.0


def head_bytes(w: Workload, layout: Layout, microbatches: int) -> float:
    """Bytes of the output logits and fp32 softmax, (E + 4) sbV/t for one micro-batch; under
    a zero-bubble schedule the heads held until W (min(p, m) under ZB-H1, one under ZB-V, whose
    head chunk runs F, B, W back to back), each with its captured logit gradient
    (2E + 4) sbV/t."""
    s, e = w.seq_len / layout.cp, w.elem
    if layout.pp > 1 and layout.schedule in SPLIT_SCHEDULES:
        held = 1 if layout.schedule == "zbv" else min(layout.pp, microbatches)
        return held * (2 * e + 4) * float(s) * layout.micro_batch * w.shape.vocab / layout.tp
    return (e + 4) * float(s) * layout.micro_batch * w.shape.vocab / layout.tp


def loss_backward_bytes(w: Workload, layout: Layout) -> float:
    """Peak bytes the loss's backward allocates beyond :func:`head_bytes`, on the stage with
    the head, for one micro-batch (A = max(E, 4), the loss's dtype; sbV/t its [s, b, V/t]
    elements); all activations are still alive when it runs, so it is the stage's peak:
      tp 1 (``F.cross_entropy`` on the fp32 logits): the kept log-softmax A sbV; its backward
        holds the nll gradient and the log-softmax gradient with it: 3 A sbV in all;
      tp > 1 (the vocab-parallel cross entropy): the kept softmax A sbV/t; its backward the
        gradient A sbV/t and its E copy (16-bit logits): (2 A + E [E < A]) sbV/t.
    ``head_bytes`` charges (E + 4) sbV/t, so this is the difference.  One micro-batch's loss
    runs at a time (the zero-bubble schedules' held heads are in ``head_bytes``); a fused loss
    kernel (``Workload.fused_loss``) adds none."""
    if w.fused_loss:
        return 0.0
    e, acc = w.elem, max(w.elem, 4)
    elems = float(w.seq_len) / layout.cp * layout.micro_batch * w.shape.vocab / layout.tp
    peak = 3 * acc if layout.tp == 1 else 2 * acc + (e if e < acc else 0)
    return max(peak - (e + 4), 0.0) * elems


def stage_label(stage: str) -> str:
    """A stage kind for reports ('ends' is ZB-V's stage 0 with the embedding and the head)."""
    return "ends (embedding + head)" if stage == "ends" else stage


@dataclass(frozen=True)
class Memory:
    """Bytes per device on the fullest stage, by kind."""

    stage: str
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    grad_buckets: float = 0.0
    """Stage 2/3: gradient bucket buffers (reduce dtype) alive at once."""
    gathered: float = 0.0
    """Stage 3: full (gathered) parameter buckets alive at once."""
    cp_buffers: float = 0.0
    """cp > 1: peak transient buffers of one layer's cp attention (ring kv/dkv blocks in
    flight, or all_to_all's full-sequence gradients)."""
    loss_backward: float = 0.0
    """On the stage with the head: the loss backward's transient gradients beyond the kept
    logits and softmax (:func:`loss_backward_bytes`)."""

    @property
    def total(self) -> float:
        """Sum of all kinds."""
        return (self.params + self.grads + self.optimizer + self.activations + self.buffers
                + self.grad_buckets + self.gathered + self.cp_buffers + self.loss_backward)

    def gib(self) -> dict[str, float]:
        """Every field in GiB (plus total)."""
        out = {k: v / GIB for k, v in asdict(self).items() if k != "stage"}
        out["total"] = self.total / GIB
        return out


def stage_memory(w: Workload, layout: Layout, stage: str) -> Memory:
    """Memory of one device of pipeline ``stage`` ('first', 'last', 'only', ZB-V's 'ends'; a
    middle stage holds no more than these)."""
    m = w.shape
    wb, gb, _ = state_bytes_per_param(w, layout)
    n = stage_params(m, layout, stage)
    micro, e, t = layout.micro_batch, w.elem, layout.tp
    s = w.seq_len / layout.cp  # rows of each sample on this cp rank
    mbs = layout.microbatches(w.global_batch)
    layers = int(stage_layers(m.layers, layout, stage))
    sbh = float(s) * micro * m.hidden
    shape = activation_shape(w, layout)
    flight = stage_flight(layout, mbs, stage)
    if layout.recompute == "full":
        act = flight * layers * layer_bytes(shape, "full") + layer_bytes(shape, "none")
    else:
        act = flight * layers * layer_bytes(shape, layout.recompute)
    if stage in ("first", "only", "ends") and m.hidden_dropout:
        act += flight * sbh / (t if layout.sp else 1)  # embedding dropout mask
    if stage in ("last", "only", "ends"):
        act += head_bytes(w, layout, mbs)  # logits + fp32 softmax (+ held until W)
        if m.mtp_layers:  # each MTP module: its layer (not under full recompute) and head
            mode = "none" if layout.recompute == "full" else layout.recompute
            act += m.mtp_layers * (flight * layer_bytes(shape, mode)
                                   + head_bytes(w, layout, mbs))
    buffers = (2 * e * sbh if layout.pp > 1 else 0.0) + (e * sbh if layout.sp else 0.0)
    grad_buckets, gathered = zero_buffer_bytes(w, layout, stage, n)
    mem = Memory(stage=stage, params=n * wb, grads=n * gb,
                 optimizer=stage_optimizer_bytes(w, layout, stage, n), activations=act,
                 buffers=buffers, grad_buckets=grad_buckets, gathered=gathered,
                 cp_buffers=cp_buffer_bytes(shape),
                 loss_backward=(loss_backward_bytes(w, layout)
                                if stage in ("last", "only", "ends") else 0.0))
    return mem if not w.model.moe else _with_moe(mem, w, layout, flight, n)


def moe_stage_params(w: Workload, layout: Layout, stage: str) -> tuple[float, float]:
    """(non-expert parameter change, routed-expert parameters) of one rank of ``stage`` from
    its MoE layers (:mod:`colonnade.analysis.moe`)."""
    x, count = MoEShape.of(w.model), stage_moe_count(w, layout, stage)
    return (moe_nonexpert_delta_per_rank(x, layout.pp, layout.tp, stage, moe_layers=count),
            expert_params_per_rank(x, layout.pp, layout.ep, stage, moe_layers=count,
                                   etp=layout.expert_tp))


def moe_layer_activation_delta(w: Workload, layout: Layout) -> float:
    """Bytes one MoE layer keeps for one micro-batch beyond a dense layer (the MoE MLP's
    terms minus the dense MLP's), recompute none / selective."""
    x = MoEShape.of(w.model)
    full_rows = layout.local_tokens(w.seq_len)  # s/cp b, the all-gathered rows under sp
    tokens = full_rows / (layout.tp if layout.sp else 1)
    moe = sum(moe_activation_terms(x, tokens, full_rows, w.elem, layout.tp, layout.sp,
                                   layout.expert_tp).values())
    return moe - dense_mlp_activation_bytes(x, full_rows, w.elem, layout.tp)


def _with_moe(mem: Memory, w: Workload, layout: Layout, flight: float, n: float) -> Memory:
    """``mem`` of a dense stage of ``n`` parameters corrected for its MoE layers: parameters
    and states (the routed experts' sharded over their own shard group, edp or its hybrid
    groups: optimizer states from stage 1, gradients from 2, parameters at 3; with Muon the
    routed experts at Muon's O, router and shared experts at AdamW's), the stage-2/3
    buffers over all ``n + delta + experts`` parameters (a layer's E/ep routed experts are one
    module a ZeRO-3 gather serves), activations."""
    delta, experts = moe_stage_params(w, layout, mem.stage)
    wb, gb, ob = state_bytes_per_param(w, layout)
    muon = w.optimizer == "muon"
    ewb, egb, eob = stage_state_bytes(w.states_precision, layout.zero, layout.expert_shard,
                                      w.state_dtype, w.master_dtype, muon)
    x = MoEShape.of(w.model)
    act = mem.activations
    layers = stage_moe_count(w, layout, mem.stage)
    if layers is None:
        layers = x.stage_moe_layers(layout.pp, mem.stage)
    if layout.recompute != "full":
        act += flight * layers * moe_layer_activation_delta(w, layout)
    optimizer = mem.optimizer + delta * ob + experts * eob
    if muon:  # each MoE layer's dense MLP was counted at Muon's O; delta removes it at ob
        dense_mlp = (layer_muon_params(w.shape, layout.tp)
                     - layer_muon_params(w.shape, layout.tp, dense_mlp=False))
        optimizer += layers * dense_mlp * (ob - state_bytes_per_param(w, layout, True)[2])
    grad_buckets, gathered = zero_buffer_bytes(w, layout, mem.stage, n + delta + experts,
                                               x.experts // layout.ep * x.expert_params)
    return dataclasses.replace(
        mem, params=mem.params + delta * wb + experts * ewb,
        grads=mem.grads + delta * gb + experts * egb,
        optimizer=optimizer, activations=act,
        grad_buckets=grad_buckets, gathered=gathered)


def memory_per_device(w: Workload, layout: Layout) -> Memory:
    """Memory of the fullest stage (first or last; the only one without pp; ZB-V's stage 0,
    'ends', whose layers hold as much as any other stage's and which adds the embedding and
    the head). With uneven stages the fullest middle stage competes too: it may hold more
    layers than the ends."""
    if layout.pp == 1:
        return stage_memory(w, layout, "only")
    kinds = ["ends"] if layout.schedule == "zbv" else ["first", "last"]
    if layout.pipeline_layout is not None and (layout.pp > 2 or layout.schedule == "zbv"):
        kinds.append("middle")
    return max((stage_memory(w, layout, k) for k in kinds), key=lambda mem: mem.total)
