"""Memory per device: model states (ZeRO accounting), activations (Korthikanti et al.), buffers.

Model states, bytes per parameter held by the device (P_dev = the stage's parameters / tp):
    mixed precision (bf16/fp16):  weights 2 + fp32 gradient buffer 4 + Adam states 12
                                  (fp32 master, m, v); ZeRO-1 divides the 12 by dp: 6 + 12/dp.
    fp32 / fp64 (element E):      weights E + gradients E + Adam m, v 2E; ZeRO-1: 2E + 2E/dp.
The ZeRO paper's own accounting (fp16 gradients, K = 12) is :func:`zero_paper_bytes`.

Activations of one layer for one micro-batch of b samples (Korthikanti et al. 2022, eq. 1-2,
written per term so that it also covers llama; E = element bytes, masks 1 byte):
    kept on every tp rank unless sp:  two norm inputs 2E sbh, QKV input E sbh, MLP input E sbh,
                                      two hidden-dropout masks 2 sbh (if dropout)
    sharded by tp:                    Q, K, V  E sb (h + 2 h_kv), out-proj input E sbh,
                                      MLP: gpt2 GeLU in/out 2E sbf; llama gate, up, product 3E sbf
    core attention (sharded):         eager: softmax E as^2b (+ dropout output E as^2b and mask
                                      as^2b if attention dropout); flash: output E sbh + lse 4 sba
For gpt2, f = 4h, E = 2, eager, dropout: sbh (10 + 24/t + 5as/(ht)) without sp and
sbh/t (34 + 5as/h) with sp, exactly the paper.  Selective recompute drops the core-attention
s^2 terms; full recompute keeps only each layer's input E sbh (/t with sp) plus one layer's
full activations while it is recomputed.

Micro-batches in flight on the first stage (which holds the most): 1 without pp, m for GPipe,
min(p, m) for 1F1B and ZB-H1 (layers per stage x p = all l layers), and for the interleaved
schedule p (1 + (p-1)/(p v)) stage-equivalents (capped at m).
The last stage also keeps the output logits and fp32 softmax, (E + 4) sbV/t.
Buffers: pipeline send/receive 2 E sbh, the sp all-gather output E sbh.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from colonnade.analysis.hardware import GIB
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.model_math import (
    LayerShape,
    embedding_params,
    head_params,
    layer_params,
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
    norms = 2 * (2 * h if m.arch == "gpt2" else h)
    replicated = norms + (2 * h if m.bias else 0)  # norms, row-parallel biases
    sharded = layer_params(m) - replicated
    per_layer = sharded / t + replicated
    total = per_layer * m.layers / layout.pp
    positions = m.max_seq_len * h if m.arch == "gpt2" else 0
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


def layer_activation_bytes(m: LayerShape, w: Workload, layout: Layout, micro: int,
                           keep_core: bool) -> float:
    """Stored activations of one layer and one micro-batch without full recompute (bytes).

    ``keep_core=False`` drops the core-attention terms (selective recompute).
    """
    s, b, h, t, e = w.seq_len, micro, m.hidden, layout.tp, w.elem
    sbh = float(s) * b * h
    rep = 2 * e * sbh + 2 * e * sbh  # two norm inputs, QKV input and MLP input
    if m.hidden_dropout:
        rep += 2 * sbh
    shard = e * float(s) * b * (h + 2 * m.kv_hidden) + e * sbh
    shard += (3 if m.swiglu else 2) * e * float(s) * b * m.ffn
    core = 0.0
    if w.attention == "eager":
        scores = float(m.heads) * s * s * b
        core = e * scores
        if m.attention_dropout:
            core += (e + 1) * scores
    else:
        core = e * sbh + 4.0 * s * b * m.heads
    if not keep_core and w.attention == "eager":
        core = 0.0
    return rep / (t if layout.sp else 1) + (shard + core) / t


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
    full_layer = layer_activation_bytes(m, w, layout, micro, layout.recompute == "none")
    flight = in_flight(layout, mbs) if stage in ("first", "only") else (
        float(mbs) if layout.schedule == "gpipe" and layout.pp > 1 else 1.0)
    if layout.recompute == "full":
        per_layer = e * sbh / (t if layout.sp else 1)
        act = flight * layers * per_layer + layer_activation_bytes(m, w, layout, micro, True)
    else:
        act = flight * layers * full_layer
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


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool,
                            recompute: str) -> float:
    """The paper's closed forms per layer (GPT, 16-bit, eager attention, dropout)."""
    if recompute == "full":
        return 2.0 * s * b * h / (t if sp else 1)
    core = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if sp:
        return s * b * h / t * (34 + core)
    return s * b * h * (10 + 24 / t + core / t)

