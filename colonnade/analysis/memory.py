"""Memory per device: model states (ZeRO accounting), activations (Korthikanti et al.), buffers.

Model states, bytes per parameter held by the device (P_dev = the stage's parameters / tp):
    mixed precision (bf16/fp16):  weights 2 + fp32 gradient buffer 4 + Adam states 12
                                  (fp32 master, m, v); ZeRO-1 divides the 12 by dp: 6 + 12/dp.
    fp32 / fp64 (element E):      weights E + gradients E + Adam m, v 2E; ZeRO-1: 2E + 2E/dp.
The ZeRO paper's own accounting (fp16 gradients, K = 12) is :func:`zero_paper_bytes`.

Activations of one layer for one micro-batch: :mod:`colonnade.analysis.activations` (the one
model, Korthikanti et al. 2022 per term for this code's layers, checked against measurement;
``Workload.attention='eager'`` gives the paper's GPT exactly, plus LayerNorm statistics and,
under sp, the full column inputs).  Full recompute keeps each layer's input E sbh (/t with sp)
plus one layer's full activations while it is recomputed.

Micro-batches in flight on the first stage (which holds the most): 1 without pp, m for GPipe,
min(p, m) for 1F1B and ZB-H1 (layers per stage x p = all l layers), and for the interleaved
schedule p (1 + (p-1)/(p v)) stage-equivalents (capped at m).
The last stage also keeps the output logits and fp32 softmax, (E + 4) sbV/t.
Buffers: pipeline send/receive 2 E sbh, the sp all-gather output E sbh.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from colonnade.analysis.activations import ActivationShape, layer_bytes
from colonnade.analysis.hardware import GIB
from colonnade.analysis.layout import Layout, Workload
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


def state_bytes_per_param(w: Workload, layout: Layout) -> tuple[float, float, float]:
    """(weight, gradient, optimizer-state) bytes per parameter held on one device."""
    shard = layout.dp if layout.zero1 else 1
    if w.mixed:
        return 2.0, 4.0, 12.0 / shard
    e = float(w.elem)
    return e, e, 2 * e / shard


def stage_params(m: LayerShape, layout: Layout, stage: str) -> float:
    """Parameters held by one device of ``stage`` ('first', 'last' or 'only')."""
    h, t = m.hidden, layout.tp
    replicated = layer_norm_params(m) + (2 * h if m.bias else 0)  # norms, row-parallel biases
    sharded = layer_params(m) - replicated
    per_layer = sharded / t + replicated
    total = per_layer * m.layers / layout.pp
    positions = position_params(m)
    embed = (embedding_params(m) - positions) / t + positions
    norm = head_params(m) - (0 if m.tied else m.vocab * h)
    head_local = norm + (0 if m.tied else m.vocab * h / t)
    if stage in ("first", "only"):
        total += embed
    if stage in ("last", "only"):
        total += head_local
        if stage == "last" and m.tied:
            total += m.vocab * h / t  # the tied head's copy of the embedding on the last stage
    return total


def activation_shape(w: Workload, layout: Layout) -> ActivationShape:
    """The activation model's shape of ``w``'s layers for one micro-batch on one device."""
    return ActivationShape.of(w.shape, w.seq_len, layout.micro_batch, tp=layout.tp,
                              sp=layout.sp, elem=w.elem, attention=w.attention)


def in_flight(layout: Layout, microbatches: int) -> float:
    """Micro-batches (in stage-equivalents) whose activations the first stage holds."""
    p, m = layout.pp, microbatches
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved_1f1b":
        return min(p * (1 + (p - 1) / (p * layout.vp)), float(m))
    return float(min(p, m))


@dataclass(frozen=True)
class Memory:
    """Bytes per device on the fullest stage, by kind."""

    stage: str
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        """Sum of all kinds."""
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def gib(self) -> dict[str, float]:
        """Every field in GiB (plus total)."""
        out = {k: v / GIB for k, v in asdict(self).items() if k != "stage"}
        out["total"] = self.total / GIB
        return out


def _stage_memory(m: LayerShape, w: Workload, layout: Layout, stage: str) -> Memory:
    wb, gb, ob = state_bytes_per_param(w, layout)
    n = stage_params(m, layout, stage)
    micro, e, s, t = layout.micro_batch, w.elem, w.seq_len, layout.tp
    mbs = layout.microbatches(w.global_batch)
    layers = m.layers // layout.pp
    sbh = float(s) * micro * m.hidden
    shape = activation_shape(w, layout)
    flight = in_flight(layout, mbs) if stage in ("first", "only") else (
        float(mbs) if layout.schedule == "gpipe" and layout.pp > 1 else 1.0)
    if layout.recompute == "full":
        act = flight * layers * layer_bytes(shape, "full") + layer_bytes(shape, "none")
    else:
        act = flight * layers * layer_bytes(shape, layout.recompute)
    if stage in ("first", "only") and m.hidden_dropout:
        act += flight * sbh / (t if layout.sp else 1)  # embedding dropout mask
    if stage in ("last", "only"):
        act += (e + 4) * float(s) * micro * m.vocab / t  # logits + fp32 softmax
    buffers = (2 * e * sbh if layout.pp > 1 else 0.0) + (e * sbh if layout.sp else 0.0)
    return Memory(stage=stage, params=n * wb, grads=n * gb, optimizer=n * ob, activations=act,
                  buffers=buffers)


def memory_per_device(w: Workload, layout: Layout) -> Memory:
    """Memory of the fullest stage (first or last; the only one without pp)."""
    m = w.shape
    if layout.pp == 1:
        return _stage_memory(m, w, layout, "only")
    first = _stage_memory(m, w, layout, "first")
    last = _stage_memory(m, w, layout, "last")
    return first if first.total >= last.total else last
