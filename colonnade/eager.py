"""``eager``: a function that ``torch.compile`` never traces, without importing dynamo at import.

``torch.compiler.disable(fn)`` imports ``torch._dynamo`` (and with it sympy, the FX symbolic
shapes and dynamo's trace rules) when the decorator runs: ~1 s of CPU per process on the 2-core
machine, about as long as ``import torch`` itself, paid by every rank, every CLI call and every
``--help``, though only a run with ``training.compile`` on ever traces anything. PyTorch's own
optimizers and DDP avoid it with ``torch._disable_dynamo``, which imports dynamo at the wrapped
function's first call instead: this module is the one place Colonnade uses it.

Under ``torch.compile`` a call to an ``eager`` function is a graph break: dynamo does not trace
the wrapper (it lives in ``torch/_compile.py``, which dynamo skips; ``TORCH_LOGS=graph_breaks``
names it "Attempted to call function marked as skipped", with the wrapped function's module and
qualname in its debug context), so the wrapper runs as Python, and it calls
``torch._dynamo.disable(fn)``: ``fn`` and everything it calls run with dynamo's frame hook off,
as with ``torch.compiler.disable`` (compiled modules called from inside still run compiled).
Without compilation the wrapper calls ``fn`` through that same disabled function; dynamo is
imported only if such a function runs (dropout, context parallelism, selective recompute, MoE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def eager(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` never traced by ``torch.compile`` (recursively: nothing it calls is traced
    either), the same function to every caller; dynamo is imported at its first call, not now."""
    return torch._disable_dynamo(fn, recursive=True)
