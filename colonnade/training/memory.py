"""Activation memory: measured bytes saved for backward per layer, and the analytic model.

Measurement.  :class:`SavedTensorMeter` installs ``torch.autograd.graph.saved_tensors_hooks``
while a forward pass runs and records every tensor autograd saves for backward, counting each
*storage* once (views of one buffer, e.g. q/k/v sharing a column layer's input, cost once) and
skipping parameters and buffers (weights, RoPE tables).  Forward hooks on the transformer
layers attribute each saved storage to the layer running; a checkpoint's saved input (full
recomputation stores it before the block's first layer starts) goes to the layer it feeds.
Saves inside a checkpointed region are invisible (they are the checkpoint's own, dropped at
once), which is exactly the memory recomputation saves.  :class:`PeakTensorBytes` measures the
peak of live tensor bytes over a forward + backward (a dispatch mode that tracks every storage
an op allocates until it is freed), on any device.

Analytic model (Korthikanti et al. 2022, "Reducing activation recomputation in large
transformer models", Sec. 4), derived for *this* code's layers.  Notation: E bytes per
activation element (8 fp64, 4 fp32, 2 bf16/fp16), A = max(E, 4) (what 16-bit runs keep in
fp32: RMSNorm's up-cast input and 1/rms, attention's log-sum-exp),
s sequence, b micro-batch, h hidden, a heads, g kv heads, d = h/a, h_kv = g d, f ffn width,
t tp, r = s/t with sp else s (rows of the residual stream a rank holds).  Per layer:

    norms (x2)     RMSNorm (x32 * rsqrt(mean x32^2) then .to(E) * w): input A r b h (the input
                   itself when E >= 4), 1/rms A r b, normalised x E r b h.
                   LayerNorm (F.layer_norm): input E r b h, mean and 1/std 2 E r b (the CPU
                   kernel keeps them in the input dtype; CUDA in fp32, +4 r b bytes at E = 2).
    column inputs  2 E s b h: attention's q/k/v and the MLP's gate/up (or fc) each read one
                   [s, b, h] input (``column_parallel``): the replicated norm output, or under
                   sp its all-gathered copy, which F.linear keeps in full (with
                   parallel.tp_comm_chunks = 1; the chunked path is not modelled here).
    attention, split over t (heads):
      SDPA path (attention dropout off): q E s b h/t, k and v E s b h_kv/t each, the
                   log-sum-exp A s b a/t and, with RoPE (llama), the output E s b h/t; no s^2
                   scores (flash kernel).  The output follows q's memory order: without RoPE
                   (gpt2) q is a view of the [s, b, h/t] projection, so the out-proj input
                   below is a view of the output and they share one storage.
      blockwise path (attention dropout on, :mod:`colonnade.models.dropout_attention`):
                   q E s b h/t, k and v E s b h_kv/t each and the log-sum-exp A s b a/t; no
                   s^2 term (probabilities and keep-masks are recomputed in backward); its
                   output is written in [s, b, a/t d] order, so the out-proj input is a view.
    out-proj input E s b h/t (the [s, b, a/t d] copy of the attention output).
    MLP, split over t: llama SwiGLU silu(gate x) * up x: gate, up, silu(gate), product
                   4 E s b f/t; gpt2 GELU input and output 2 E s b f/t.
    hidden dropout (if on): two bool keep-masks 2 r b h bytes.
    selective      core attention is checkpointed: its inputs q E s b h/t, k, v E s b h_kv/t
                   replace the SDPA/blockwise terms above.
    full           a checkpointed block keeps only its input E r b h; a chunk of L layers holds
                   ceil(L/N) of them (uniform N) or min(N, L) + full layers (block N).

The paper's GPT (4h GELU MLP, LayerNorm, eager attention, dropout, masks of 1 byte) gives at
E = 2: sbh (34 + 5as/h), tp: sbh (10 + 24/t + 5as/(ht)), tp+sp: sbh (34/t + 5as/(ht)),
selective: without the 5as/h terms, full: 2 sbh (/t with sp); :func:`paper_layer_bytes`
scales its 16-bit terms by E/2 and keeps the masks at 1 byte. This code's gpt2 layer with the
paper's settings differs from it only in (i) attention dropout without s^2 terms (the blockwise path
keeps q, k, v and the fp32 log-sum-exp: -5 a s^2 b + 4 a s b), (ii) LayerNorm statistics 4 E s b,
and (iii) under sp the two all-gathered column inputs kept in full (+ 2 E (1 - 1/t) s b h): Megatron
keeps the [s/t, b, h] shard and all-gathers it again in backward. The llama layer adds RMSNorm's
up-cast input and normalised copy (2 (A + E) s b h instead of 2 E s b h), SwiGLU's four s b f
tensors (f ~ 8h/3: ~ 10.7 E sbh vs GELU's 8 E sbh at f = 4h), GQA's smaller k, v, and SDPA's flash
kernel that keeps the output and log-sum-exp instead of s^2 scores.

Kernel caveats: the terms are those of PyTorch's CPU flash kernel; CUDA kernels keep the same
output and fp32 log-sum-exp (the memory-efficient kernel pads it to a multiple of 32 positions,
plus two 8-byte RNG words) - a fraction of a percent at realistic sizes.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from colonnade.config.sections import ModelConfig
from colonnade.models.layer import TransformerLayer
from colonnade.models.recompute import RecomputePlan

# ----------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class SavedStorage:
    """One storage autograd keeps for backward."""

    layer: str | None
    """Key of the transformer layer it belongs to (``layers.3``), None outside every layer."""
    nbytes: int
    shape: tuple[int, ...]
    """Shape of the first tensor that saved it."""
    dtype: torch.dtype
    op: str
    """grad_fn of the saved tensor (``leaf`` for leaves and non-differentiable tensors)."""


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    st = t.untyped_storage()
    return (str(t.device), st.data_ptr())


class SavedTensorMeter:
    """Record the storages saved for backward inside ``with meter:``, once each.

    ``modules`` are the models (chunks) that run: their parameters and buffers are excluded,
    and their :class:`~colonnade.models.layer.TransformerLayer` s get forward hooks that
    attribute what is saved while they run (to the layer's ``key``, ``layers.<i>``).
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = list(modules)
        self.records: list[SavedStorage] = []
        self._seen: set[tuple[str, int]] = set()
        self._keep: list[torch.Tensor] = []
        self._excluded: set[tuple[str, int]] = set()
        self._stack: list[str] = []
        self._pending: dict[tuple[str, int], int] = {}
        self._handles: list[Any] = []
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        nbytes = t.untyped_storage().nbytes()
        if key in self._seen or key in self._excluded or nbytes == 0:
            return t
        self._seen.add(key)
        self._keep.append(t)  # keeps the storage (and so its address) alive while measuring
        layer = self._stack[-1] if self._stack else None
        op = t.grad_fn.name() if t.grad_fn is not None else "leaf"
        if layer is None:
            self._pending[key] = len(self.records)
        self.records.append(SavedStorage(layer, nbytes, tuple(t.shape), t.dtype, op))
        return t

    def _enter_layer(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        key = str(module.key)
        if args and isinstance(args[0], torch.Tensor):
            index = self._pending.pop(_storage_key(args[0]), None)
            if index is not None:  # a checkpoint's saved input: it belongs to this layer
                rec = self.records[index]
                self.records[index] = SavedStorage(key, rec.nbytes, rec.shape, rec.dtype, rec.op)
        self._stack.append(key)

    def _leave_layer(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self._stack.pop()

    def __enter__(self) -> SavedTensorMeter:
        for module in self.modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                self._excluded.add(_storage_key(tensor))
            for sub in module.modules():
                if isinstance(sub, TransformerLayer):
                    self._handles.append(sub.register_forward_pre_hook(self._enter_layer))
                    self._handles.append(sub.register_forward_hook(self._leave_layer))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles, self._keep, self._pending = [], [], {}

    def per_layer(self) -> dict[str, int]:
        """Bytes saved by each layer, in the order the layers ran."""
        out: dict[str, int] = {}
        for rec in self.records:
            if rec.layer is not None:
                out[rec.layer] = out.get(rec.layer, 0) + rec.nbytes
        return out

    @property
    def outside(self) -> int:
        """Bytes saved outside every layer (embedding, head, loss)."""
        return sum(rec.nbytes for rec in self.records if rec.layer is None)

    @property
    def total(self) -> int:
        """All bytes saved."""
        return sum(rec.nbytes for rec in self.records)


@dataclass(frozen=True)
class LayerMeasurement:
    """Bytes saved for backward by a chunk's layers for one micro-batch."""

    per_layer: dict[str, int]
    records: list[SavedStorage] = field(repr=False)

    @property
    def mean(self) -> float:
        """Average bytes per layer (checkpointed blocks spread over their layers)."""
        return sum(self.per_layer.values()) / max(len(self.per_layer), 1)


def measure_layers(chunk: nn.Module, x: torch.Tensor) -> LayerMeasurement:
    """Run ``chunk.run_layers(x)`` in training mode and record what backward would keep.

    ``x`` [s(/tp), b, h] is detached and made to require grad (as a real hidden state does),
    so every layer's input counts.  The graph is dropped afterwards (no backward runs).
    """
    was_training = chunk.training
    chunk.train()
    x = x.detach().requires_grad_(True)
    try:
        with SavedTensorMeter([chunk]) as meter:
            out = chunk.run_layers(x)
        del out
    finally:
        chunk.train(was_training)
    layers = [str(k) for k in chunk.layers]
    per_layer = {f"layers.{k}": meter.per_layer().get(f"layers.{k}", 0) for k in layers}
    return LayerMeasurement(per_layer, meter.records)


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of tensors allocated inside ``with meter:`` and still alive (any device).

    Every storage an op creates (not a view of one of its inputs) is counted from the op until
    Python-visible storage dies; tensors that existed before (weights, the batch) are not.
    ``peak`` is the high-water mark, ``current`` what is live now.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and _has_storage(t)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _has_storage(t) and _storage_key(t) not in inputs:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if key in self._live or nbytes == 0:
            return
        self._live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


# ----------------------------------------------------------------------------- analytic model


@dataclass(frozen=True)
class ActivationShape:
    """Everything the per-layer activation formula depends on."""

    seq: int
    batch: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    tp: int = 1
    sp: bool = False
    elem: int = 2
    """Bytes per activation element E."""
    arch: str = "llama"
    hidden_dropout: bool = False
    attention_dropout: bool = False

    @classmethod
    def from_model(cls, model: ModelConfig, seq: int, batch: int, *, tp: int = 1,
                   sp: bool = False, dtype: torch.dtype = torch.bfloat16) -> ActivationShape:
        """The shape of ``model``'s layers for micro-batch [b, s] on a tp (+sp) rank."""
        return cls(seq=seq, batch=batch, hidden=model.hidden_size, heads=model.num_heads,
                   kv_heads=model.kv_heads, ffn=model.ffn_size, tp=tp, sp=sp,
                   elem=torch.empty((), dtype=dtype).element_size(), arch=model.arch,
                   hidden_dropout=model.hidden_dropout > 0,
                   attention_dropout=model.attention_dropout > 0)


def layer_terms(x: ActivationShape, recompute: str = "none") -> dict[str, float]:
    """Bytes one layer keeps for backward, by term (see the module docstring).

    ``recompute`` 'none' | 'selective' | 'full' (one checkpointed layer: its input only).
    """
    s, b, h, a, t, e = x.seq, x.batch, x.hidden, x.heads, x.tp, x.elem
    acc = max(e, 4)
    rows = s // t if x.sp else s
    if recompute == "full":
        return {"block_input": float(e * rows * b * h)}
    sbh, d = float(s * b * h), h // a
    h_kv = x.kv_heads * d
    terms: dict[str, float] = {}
    if x.arch == "llama":
        terms["norms"] = 2.0 * (acc * rows * b * h + acc * rows * b + e * rows * b * h)
    else:
        terms["norms"] = 2.0 * (e * rows * b * h + 2 * e * rows * b)
    terms["column_inputs"] = 2.0 * e * sbh  # attention's and the MLP's, [s, b, h] even with sp
    q, kv = e * sbh / t, 2.0 * e * s * b * h_kv / t
    if recompute == "selective":
        terms["core_inputs"] = q + kv
    elif x.attention_dropout:  # blockwise: q, k, v and the log-sum-exp, no s^2 term
        terms["core_blockwise"] = q + kv + acc * s * b * a / t
    else:
        # SDPA's output takes q's memory order.  With RoPE q is a fresh [b, a/t, s, d] tensor,
        # so the [s, b, a/t d] out-proj input is a copy and the output is kept too; without
        # RoPE (gpt2) q is a view of the [s, b, a/t d] projection and the out-proj input a
        # view of the output: one storage.
        out = e * sbh / t if x.arch == "llama" else 0.0
        terms["core_sdpa"] = q + kv + out + acc * s * b * a / t
    terms["out_proj_input"] = e * sbh / t
    terms["mlp"] = (4.0 if x.arch == "llama" else 2.0) * e * s * b * x.ffn / t
    if x.hidden_dropout:
        terms["dropout_masks"] = 2.0 * rows * b * h  # bool
    return terms


def layer_bytes(x: ActivationShape, recompute: str = "none") -> float:
    """Sum of :func:`layer_terms`."""
    return sum(layer_terms(x, recompute).values())


def chunk_layer_bytes(x: ActivationShape, plan: RecomputePlan, num_layers: int) -> float:
    """Bytes a chunk of ``num_layers`` layers keeps for one micro-batch under ``plan``."""
    if plan.mode != "full":
        return num_layers * layer_bytes(x, plan.mode)
    stored = plan.checkpointed_blocks(num_layers)
    plain = 0 if plan.method == "uniform" else num_layers - stored
    return stored * layer_bytes(x, "full") + plain * layer_bytes(x, "none")


def paper_layer_bytes(s: int, b: int, h: int, a: int, *, tp: int = 1, sp: bool = False,
                      recompute: str = "none", elem: int = 2) -> float:
    """Korthikanti et al. 2022 per layer (their GPT), 16-bit terms scaled to ``elem`` bytes.

    At elem = 2: sbh (10 + 24/t + 5as/(ht)), with sp sbh (34/t + 5as/(ht)), selective drops
    the 5as/h terms, full 2 sbh (/t with sp).  Dropout masks stay 1 byte per element.
    """
    k, sbh = elem / 2.0, float(s) * b * h
    if recompute == "full":
        return 2.0 * k * sbh / (tp if sp else 1)
    core = 0.0 if recompute == "selective" else (4.0 * k + 1.0) * a * s * s * b
    replicated = (8.0 * k + 2.0) * sbh  # norm, QKV and MLP inputs; two dropout masks
    sharded = 24.0 * k * sbh + core
    return (replicated + sharded) / tp if sp else replicated + sharded / tp


def relative_error(measured: float, predicted: float) -> float:
    """|measured - predicted| / predicted."""
    return math.inf if predicted == 0 else abs(measured - predicted) / predicted
