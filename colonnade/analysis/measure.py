"""Activation memory measured: bytes saved for backward per layer, and the peak of live bytes.

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

The analytic model these measurements check is :mod:`colonnade.analysis.activations`.
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

from colonnade.models.layer import TransformerLayer


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


def relative_error(measured: float, predicted: float) -> float:
    """|measured - predicted| / predicted."""
    return math.inf if predicted == 0 else abs(measured - predicted) / predicted
