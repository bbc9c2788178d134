"""Parameter helpers every layer above the models shares: each parameter once, and its gradient.

They sit here, below the pipeline, data parallelism, checkpoints and reliability, so that none of
those has to import the training package to walk a model's parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def grad_of(param: nn.Parameter) -> torch.Tensor | None:
    """The step's gradient a reduction should act on: ``param.grad`` when it holds one (the
    ``main_grad`` view of the flat buffer, or on one rank autograd's own tensor), else
    ``main_grad`` (bf16 / fp16 models fold their gradients into it)."""
    if param.grad is not None:
        return param.grad
    return getattr(param, "main_grad", None)


def unique_params(chunks: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Parameters of all chunks, each once, in a deterministic order."""
    seen: set[int] = set()
    out = []
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out
