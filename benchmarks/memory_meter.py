"""Per-rank memory meters of the side-by-side benchmarks (benchmarks/data_parallel.py).

* :class:`RssPeak` samples the process's resident set every millisecond (/proc/self/statm).
* :func:`state_bytes` adds up the distinct tensor storages reachable from a framework's
  objects: what a rank's training state occupies, whether its pages were touched or not.
"""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any

import torch


class RssPeak:
    """Samples this process's resident set every millisecond; ``stop`` gives peak - start;
    ``step_growth`` the peak since :meth:`mark` minus the resident set at the mark."""

    def __init__(self) -> None:
        self.start = self.peak = self.base = self.since_mark = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            rss = self._rss()
            self.peak, self.since_mark = max(self.peak, rss), max(self.since_mark, rss)

    def mark(self) -> None:
        """Start the step window: its growth is measured from the resident set now."""
        self.base = self.since_mark = self._rss()

    def step_growth(self) -> int:
        """Peak resident set since :meth:`mark` minus the resident set at the mark."""
        return max(self.since_mark, self._rss()) - self.base

    def stop(self) -> int:
        """Stop sampling; returns the peak growth in bytes."""
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._rss()) - self.start


def state_bytes(*roots: Any, limit: int = 200_000) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` (this rank's training
    state: parameters or shards, gradients, optimizer moments, flat buffers), following
    modules, containers and the attributes of objects (breadth first, at most ``limit``
    objects; a DTensor counts its local shard). Storages are told apart by data pointer."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    todo = list(roots)
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            if local.device.type != "meta" and local.untyped_storage().nbytes():
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0),
                                                   storage.nbytes())
            todo += [obj.grad] if obj.is_leaf and obj.grad is not None else []
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo += list(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            todo += [obj.state, obj.param_groups]
        elif isinstance(obj, torch.nn.Module) or (
                hasattr(obj, "__dict__") and not callable(obj) and not inspect.ismodule(obj)):
            todo += list(vars(obj).values())
    return sum(storages.values())
