"""Shared pieces of the tensor/sequence-parallel tests: tiny configs, data, one training loop
used by both the parallel ranks and the single-process reference, and a recording RNG tracker.

Rank functions live in the test modules (module level, so the pool imports them by name); this
module holds what both sides run, so a difference in results can only come from the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from colonnade.checkpoint.export import gather_full
from colonnade.config.sections import Config, OptimConfig, ParallelConfig, TrainingConfig
from colonnade.data_parallel import build_data_parallel
from colonnade.models.build import build_chunks
from colonnade.models.gpt import ModelChunk
from colonnade.models.params import unique_params
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.pipeline.plan import Batch
from colonnade.training.step import set_train_mode
from tests.parity import TOL, VOCAB, random_steps, rel_err, resolved, tiny_model, train_step
from tests.parity import rank_groups as shared_rank_groups


def tiny_config(arch: str, tp: int, sp: bool, *, dropout: float = 0.0, layers: int = 2,
                seq: int = 16, micro: int = 2, microbatches: int = 2, steps: int = 3,
                vocab: int = VOCAB) -> Config:
    """A resolved, validated float64 config of a tiny model on ``tp`` ranks.

    llama: h=64, 8 query heads, 4 kv heads (GQA), SwiGLU 192, RoPE, untied.
    gpt2: h=32, 4 heads, GELU 128, biases, learned positions, tied embeddings.
    """
    if arch == "llama":
        model = tiny_model("llama", layers=layers, hidden=64, heads=8, kv_heads=4, vocab=vocab,
                           seq=seq, dropout=dropout)
    else:
        model = tiny_model(arch, layers=layers, hidden=32, heads=4, vocab=vocab, seq=seq,
                           dropout=dropout)
    config = Config(
        model=model,
        parallel=ParallelConfig(tp=tp, sp=sp),
        training=TrainingConfig(steps=steps, seq_len=seq, micro_batch_size=micro,
                                microbatches=microbatches, precision="fp64", seed=7,
                                eval_interval=0),
        optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.1,
                          clip_grad=1.0),
    )
    return resolved(config, tp)


def make_batches(config: Config, seed: int = 3) -> list[list[Batch]]:
    """Per step, the micro-batches (tokens [b, s], labels [b, s]) of the global batch; token
    [0, 0] of each is the last real id (next to the padding)."""
    tr = config.training
    return random_steps(tr.steps, tr.microbatches or 1, tr.micro_batch_size, tr.seq_len,
                        config.model.vocab_size, seed=seed, mark_last_id=True)


def full_tensors(chunks: list[nn.Module], groups: ProcessGroups,
                 grads: bool = False) -> dict[str, torch.Tensor]:
    """Gathered full parameters (or their gradients), keyed by global name."""
    out: dict[str, torch.Tensor] = {}
    for p in unique_params(chunks):
        t = p.grad if grads else p
        if t is None:
            raise AssertionError(f"{p.sharding.key} has no gradient")  # type: ignore[attr-defined]
        out[p.sharding.key] = gather_full(t, p.sharding, groups.tp)  # type: ignore[attr-defined]
    return out


def run_training(chunks: list[ModelChunk], groups: ProcessGroups, config: Config,
                 step_batches: list[list[Batch]]) -> dict[str, Any]:
    """Evaluate the initial logits, then run ``len(step_batches)`` AdamW steps.

    Returns logits [b, s, V] of the first micro-batch at init (eval mode), per-step
    micro-batch losses, the gathered gradients of step 0 (after the sp/tied reductions,
    before clipping) and the gathered parameters after the last step.
    """
    (chunk,) = chunks
    set_train_mode(chunks, False)
    logits = chunk.full_logits(step_batches[0][0][0])  # [b, s, V]
    ddp = build_data_parallel(chunks, config, groups)
    opt = DistributedOptimizer(ddp, config.optim, groups, config.training.steps,
                               config.training.precision)
    losses: list[list[float]] = []
    grads: dict[str, torch.Tensor] = {}
    for step, batches in enumerate(step_batches):
        set_train_mode(chunks, True)

        def keep_grads(step: int = step) -> None:
            if step == 0:
                grads.update(full_tensors(chunks, groups, grads=True))

        losses.append(train_step(chunks, ddp, opt, groups, config, step, batches,
                                 before_optim=keep_grads)[0])
    return {"logits": logits, "losses": losses, "grads": grads,
            "params": full_tensors(chunks, groups)}


def assert_close_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                     tol: float = TOL, zero: float = 1e-9) -> float:
    """Same names and shapes, every tensor within ``tol`` relative error; returns the worst.

    A tensor whose exact value is zero holds only rounding noise on both sides, which no
    relative error can match: the key-projection bias gradient (softmax ignores a shift shared
    by all keys), hence also that bias after AdamW steps. When the reference's norm is below
    ``zero`` x the largest reference norm, the other side must be below it as well.
    """
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    limit = zero * max(float(t.double().norm()) for t in want.values())
    worst = 0.0
    for key, ref in want.items():
        assert got[key].shape == ref.shape, f"{what} {key}: {got[key].shape} vs {ref.shape}"
        if float(ref.double().norm()) <= limit:
            size = float(got[key].double().norm())
            assert size <= limit, f"{what} {key}: exactly zero in the reference, norm {size:.3e}"
            continue
        err = rel_err(got[key], ref)
        assert err <= tol, f"{what} {key}: relative error {err:.3e} > {tol:g}"
        worst = max(worst, err)
    return worst


@dataclass
class RecordingTracker(RNGTracker):
    """An RNGTracker that keeps every keep-mask it hands out, keyed (site, step, micro-batch)."""

    masks: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    record_steps: int = 1

    def keep_mask(self, site: str, full_shape: tuple[int, ...], p: float,
                  index: tuple[slice, ...], device: torch.device) -> torch.Tensor:
        mask = super().keep_mask(site, full_shape, p, index, device)
        if self.step < self.record_steps:
            key = (site, self.step, self.microbatch)
            if key in self.masks:
                raise AssertionError(f"dropout site {site} drew twice in one micro-batch")
            self.masks[key] = mask.clone()
        return mask


def install_recorder(chunks: list[ModelChunk], seed: int) -> RecordingTracker:
    """Swap the shared ParallelContext's tracker for a recording one (same seed, same masks)."""
    recorder = RecordingTracker(seed)
    chunks[0].ctx.rng = recorder
    return recorder


def rank_groups(tp: int) -> ProcessGroups:
    """Groups of a pure-tp layout on the pool's world (one thread per rank)."""
    return shared_rank_groups(ParallelDims(tp=tp))


def parallel_run(config: Config, step_batches: list[list[Batch]],
                 record_masks: bool = False) -> dict[str, Any]:
    """Rank function body: build this rank's shard of the model and train it."""
    groups = rank_groups(config.parallel.tp)
    chunks = build_chunks(config, groups, dtype=torch.float64)
    recorder = install_recorder(chunks, config.training.seed) if record_masks else None
    out = run_training(chunks, groups, config, step_batches)
    out["tp_rank"] = groups.tp_rank
    out["masks"] = recorder.masks if recorder is not None else {}
    return out
