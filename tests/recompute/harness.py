"""Shared pieces of the recomputation tests: tiny float64 configs, data, and gradient runs.

Gradients are compared *within* one layout: the same shards, the same data, the same seed,
with and without recomputation. The pp = 1 runs use a GPipe-like order (every micro-batch's
forward, then the backwards in reverse), so each backward - and the recomputation inside it -
runs while the dropout tracker points at another micro-batch: the case a pipeline creates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint as tc

from colonnade.config.sections import Config, ParallelConfig, TrainingConfig
from colonnade.data.synthetic import random_batches
from colonnade.models.build import build_chunks
from colonnade.models.gpt import LayerFn, ModelChunk
from colonnade.models.params import unique_params
from colonnade.models.recompute import RecomputePlan, install
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.plan import Batch, StepPlan, set_rng_context
from colonnade.training.step import forward_backward
from tests.parity import max_rel_err, resolved, tiny_model
from tests.parity import rank_groups as shared_rank_groups

Grads = dict[str, torch.Tensor]
MODES: list[tuple[str, str, int]] = [
    ("selective", "uniform", 1),
    ("full", "uniform", 1),
    ("full", "uniform", 3),
    ("full", "block", 1),
    ("full", "block", 2),
]
"""(recompute, method, num_layers) of every recomputing run."""


def tiny_config(arch: str = "llama", *, tp: int = 1, sp: bool = False, pp: int = 1,
                vp: int = 1, layers: int = 4, dropout: float = 0.1, seq: int = 16,
                micro: int = 2, microbatches: int = 4, schedule: str = "1f1b") -> Config:
    """A resolved, validated fp64 config (llama: h 32, 4 heads, 2 kv heads, SwiGLU 64)."""
    llama = arch == "llama"  # gpt2: biases, an untied head, its own 4h GELU MLP
    model = tiny_model(arch, layers=layers, hidden=32, heads=4, kv_heads=2 if llama else None,
                       ffn=64 if llama else None, vocab=67, seq=seq, dropout=dropout, tie=False)
    config = Config(model=model,
                    parallel=ParallelConfig(tp=tp, sp=sp, pp=pp, vp=vp, schedule=schedule),
                    training=TrainingConfig(seq_len=seq, micro_batch_size=micro,
                                            microbatches=microbatches, precision="fp64",
                                            seed=11, eval_interval=0))
    return resolved(config)


def measured_layer_bytes(config: Config, dtype: torch.dtype, plans: tuple[RecomputePlan, ...] = (
        RecomputePlan(), RecomputePlan("selective"), RecomputePlan("full"))
                         ) -> list[tuple[RecomputePlan, float]]:
    """The single-process chunk of ``config`` in ``dtype``: under each recompute plan, the
    mean bytes one layer keeps for backward (saved-tensor hooks) for a random input
    [b, s, h] of the config's micro-batch and sequence."""
    from colonnade.analysis.measure import measure_layers

    (chunk,) = build_chunks(config, rank_groups(config), dtype=dtype)
    m, tr = config.model, config.training
    x = torch.randn(tr.micro_batch_size, tr.seq_len, m.hidden_size,
                    generator=torch.Generator().manual_seed(1)).to(dtype)  # [b, s, h]
    out = []
    for plan in plans:
        install([chunk], plan)
        out.append((plan, measure_layers(chunk, x).mean))
    return out


def with_recompute(config: Config, mode: str, method: str = "uniform", n: int = 1) -> Config:
    """``config`` with training.recompute / recompute_method / recompute_num_layers set."""
    training = dataclasses.replace(config.training, recompute=mode, recompute_method=method,
                                   recompute_num_layers=n)
    return dataclasses.replace(config, training=training)


def make_batches(config: Config, seed: int = 5) -> list[Batch]:
    """The micro-batches (tokens [b, s], labels [b, s]) of one step."""
    return random_batches(config, seed=seed)


def rank_groups(config: Config) -> ProcessGroups:
    """The process groups of ``config``'s layout (single-process when the world is 1)."""
    torch.set_num_threads(1)
    if dist.is_initialized() and dist.get_world_size() == 1:
        return ProcessGroups.single()  # the 1-rank pool runs the single-process model
    par = config.parallel
    return shared_rank_groups(ParallelDims(tp=par.tp, pp=par.pp))


def gpipe_grads(chunks: list[ModelChunk], groups: ProcessGroups,
                batches: list[Batch]) -> tuple[list[float], Grads]:
    """pp = 1: every forward, then every backward in reverse order; losses and local grads."""
    (chunk,) = chunks
    chunk.train()
    chunk.zero_grad(set_to_none=True)
    m, losses = len(batches), []
    for k, (tokens, labels) in enumerate(batches):
        set_rng_context(chunks, StepPlan(groups, step=0), k, m)
        losses.append(chunk(tokens, labels))
    for loss in reversed(losses):
        (loss / m).backward()
    return [float(v.detach()) for v in losses], local_grads(chunks)


def pipeline_grads(chunks: list[ModelChunk], groups: ProcessGroups, batches: list[Batch],
                   schedule: str) -> tuple[list[float], Grads]:
    """pp > 1: the pipeline executor runs ``schedule``; losses (last stage) and local grads."""
    for chunk in chunks:
        chunk.train()
        chunk.zero_grad(set_to_none=True)
    losses = forward_backward(chunks, batches, StepPlan(groups, step=0, schedule=schedule))
    return losses, local_grads(chunks)


def local_grads(chunks: list[ModelChunk]) -> Grads:
    """This rank's gradient shards keyed by global parameter name."""
    out: Grads = {}
    for p in unique_params(chunks):
        assert p.grad is not None, f"{p.sharding.key} has no gradient"  # type: ignore[attr-defined]
        out[p.sharding.key] = p.grad.detach().clone()  # type: ignore[attr-defined]
    return out


def count_calls(chunks: list[ModelChunk]) -> dict[str, int]:
    """Count transformer-layer forwards ('layer') and core-attention calls ('core') from now on.

    A recomputation runs them again inside backward, so the counts prove it happened.
    """
    calls = {"layer": 0, "core": 0}
    for chunk in chunks:
        for layer in chunk.layers.values():
            layer.register_forward_pre_hook(lambda *_: calls.__setitem__("layer",
                                                                         calls["layer"] + 1))
            core = layer.attn.core_attention

            def counted(*args: object, core: Callable[..., torch.Tensor] = core) -> torch.Tensor:
                calls["core"] += 1
                return core(*args)

            layer.attn.core_attention = counted  # instance attribute: this model only
    return calls


class UnprotectedRecompute:
    """Negative control: full recomputation *without* restoring the dropout context."""

    def __init__(self, chunk: ModelChunk) -> None:
        self.chunk = chunk

    def __call__(self, fns: list[LayerFn], x: torch.Tensor) -> torch.Tensor:
        for fn in fns:
            x = tc.checkpoint(fn, x, use_reentrant=False)
        return x


def compare_modes(config: Config, modes: list[tuple[str, str, int]],
                  control: bool = False) -> dict[str, float]:
    """Rank body: relative gradient error of each recompute mode against none (same layout).

    Also returns 'loss_spread' (do micro-batches differ) and, with ``control``, the error of
    :class:`UnprotectedRecompute` (must be large: dropout is on and the context moves).
    """
    groups = rank_groups(config)
    chunks = build_chunks(config, groups, dtype=torch.float64)
    batches = make_batches(config)
    par = config.parallel

    def run() -> tuple[list[float], Grads]:
        if par.pp > 1:
            return pipeline_grads(chunks, groups, batches, par.schedule)
        return gpipe_grads(chunks, groups, batches)

    calls = count_calls(chunks)
    losses, base = run()
    base_calls = dict(calls)
    out: dict[str, float] = {"loss_spread": max(losses) - min(losses) if losses else 0.0}
    for mode, method, n in modes:
        install(chunks, RecomputePlan(mode, method, n))
        calls.update(layer=0, core=0)
        again, grads = run()
        assert again == losses, f"{mode}/{method}/{n}: losses {again} vs {losses}"
        what = "core" if mode == "selective" else "layer"
        assert calls[what] > base_calls[what], (
            f"{mode}/{method}/{n}: {calls[what]} {what} forwards, as many as without "
            "recomputation: nothing was recomputed")
        out[f"{mode}/{method}/{n}"] = max_rel_err(grads, base)
    if control:
        install(chunks, RecomputePlan())
        chunks[0].layer_runner = UnprotectedRecompute(chunks[0])
        out["control"] = max_rel_err(run()[1], base)
    install(chunks, RecomputePlan.from_config(config.training))
    return out

