"""The one parity harness every test package shares: tiny configs, synthetic batches, the
relative error, the process groups of a pool rank and the float64 training step.

The per-package modules (``tests/<package>/harness.py`` / ``common.py``) keep only what is
particular to their package (a layout type, an instrumented loop, a recording RNG tracker) and
call these with their own numbers, so every test keeps its model, data and tolerance.

The relative error of every parity assertion and TOL, the float64 bound, are the fuzzer's
(:mod:`colonnade.fuzz.compare`): one measure for the hand-picked tests and the fuzzed draws.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from colonnade.config.choices import tied_across_stages
from colonnade.config.sections import Config, ModelConfig
from colonnade.config.validate import resolve, validate
from colonnade.data_parallel.finalize import reduce_sp_and_tied
from colonnade.fuzz.compare import TOL as TOL  # re-exported: the tests import it from here
from colonnade.fuzz.compare import rel_err
from colonnade.fuzz.hf_twin import reference_update as reference_update  # re-exported
from colonnade.optim.adamw import decays
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.plan import Batch, ExecOptions, StepPlan
from colonnade.training.step import forward_backward

VOCAB = 101
"""Prime vocabulary: never divisible by tp, so every parity run pads the vocab."""


# ----------------------------------------------------------------------------- configs


def tiny_model(arch: str, *, layers: int = 2, hidden: int = 32, heads: int = 4,
               kv_heads: int | None = None, ffn: int | None = None, vocab: int = VOCAB,
               seq: int = 16, init_std: float = 0.05, dropout: float = 0.0,
               attention_dropout: float | None = None, tie: bool | None = None,
               bias: bool | None = None) -> ModelConfig:
    """A tiny decoder's ModelConfig (llama or gpt2) with each test package's numbers.

    ``tie`` / ``bias`` default to the architecture's (gpt2: tied head and biases; llama:
    neither); ``attention_dropout`` defaults to ``dropout``; ``kv_heads`` only for llama
    (GQA when < ``heads``). Sizes: h = ``hidden``, ``heads`` of h / heads, ffn = ``ffn`` or
    the architecture's default (llama SwiGLU 8h/3 rounded, gpt2 4h).
    """
    if arch not in ("llama", "gpt2"):
        raise ValueError(f"arch must be 'llama' or 'gpt2', got {arch!r}")
    gpt2 = arch == "gpt2"
    return ModelConfig(
        arch=arch, num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=None if gpt2 else kv_heads, ffn_hidden_size=ffn, vocab_size=vocab,
        max_seq_len=seq, init_std=init_std, hidden_dropout=dropout,
        attention_dropout=dropout if attention_dropout is None else attention_dropout,
        tie_embeddings=gpt2 if tie is None else tie, bias=gpt2 if bias is None else bias)


def world_of(config: Config) -> int:
    """Ranks the config's dense layout needs: tp x pp x dp (dp None counts as 1)."""
    par = config.parallel
    return par.tp * par.pp * int(par.dp or 1)


def resolved(config: Config, world: int | None = None) -> Config:
    """``config`` resolved and validated for ``world`` ranks (default: its own layout's)."""
    world = world_of(config) if world is None else world
    return validate(resolve(config, world), world)


# ----------------------------------------------------------------------------- data


def random_steps(steps: int, count: int, micro: int, seq: int, vocab: int = VOCAB, *,
                 seed: int, mark_last_id: bool = False) -> list[list[Batch]]:
    """Per step, ``count`` micro-batches (tokens [micro, seq], labels [micro, seq]) drawn one
    after another from one generator seeded ``seed``.

    ``mark_last_id``: token [0, 0] of each micro-batch is ``vocab - 1``, so the last real id
    (next to the tp padding of the vocabulary) always occurs.
    """
    gen = torch.Generator().manual_seed(seed)
    out: list[list[Batch]] = []
    for _ in range(steps):
        batches = []
        for _ in range(count):
            ids = torch.randint(0, vocab, (micro, seq + 1), generator=gen)  # [b, s + 1]
            if mark_last_id:
                ids[0, 0] = vocab - 1
            batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
        out.append(batches)
    return out


def step_global_batch(step: int, count: int, micro: int, seq: int, vocab: int = VOCAB,
                      seed_base: int = 1000) -> tuple[torch.Generator, torch.Tensor]:
    """The global batch of ``step``, [count, micro, seq + 1], from a generator seeded
    ``seed_base + step`` (any layout at any step draws the same tokens); returns the generator
    too, for callers that draw masks after it."""
    gen = torch.Generator().manual_seed(seed_base + step)
    return gen, torch.randint(0, vocab, (count, micro, seq + 1), generator=gen)


def split_micro(data: torch.Tensor) -> list[Batch]:
    """[count, micro, seq + 1] ids -> ``count`` (tokens, labels) pairs of [micro, seq]."""
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


# ----------------------------------------------------------------------------- errors


def max_rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest :func:`rel_err` over same-named tensors (the names must agree)."""
    assert sorted(got) == sorted(want), f"names differ: {sorted(set(got) ^ set(want))}"
    return max((rel_err(got[k], ref) for k, ref in want.items()), default=0.0)


# ----------------------------------------------------------------------------- groups


def rank_groups(dims: ParallelDims, cp_a2a_size: int | None = None,
                zero_shard_size: int | None = None) -> ProcessGroups:
    """This pool rank's groups of ``dims`` (one thread per rank; ``cp_a2a_size``: hierarchical
    cp's groups too; ``zero_shard_size``: hybrid sharding's groups too); outside any process
    group a world of 1 gets the single-process groups (``ProcessGroups.build`` does that)."""
    torch.set_num_threads(1)
    if dist.is_initialized() and dist.get_world_size() != dims.world_size:
        raise AssertionError(f"pool has {dist.get_world_size()} ranks, layout needs "
                             f"{dims.world_size}")
    return ProcessGroups.build(dims, zero_shard_size=zero_shard_size, cp_a2a_size=cp_a2a_size)


def dims_of(config: Config) -> ParallelDims:
    """The dense layout of ``config`` (tp, pp, vp, dp)."""
    par = config.parallel
    return ParallelDims(tp=par.tp, pp=par.pp, dp=int(par.dp or 1), vp=par.vp)


# ----------------------------------------------------------------------------- training


def train_step(chunks: list[Any], ddp: Any, opt: Any, groups: ProcessGroups, config: Config,
               step: int, batches: list[Batch], *, options: ExecOptions | None = None,
               after_backward: Callable[[], None] | None = None,
               before_optim: Callable[[], None] | None = None) -> tuple[list[float], Any]:
    """One optimizer step assembled by hand, as the Trainer does it.

    zero grads -> forward_backward over ``batches`` (this rank's micro-batches, grads synced
    by the data-parallel hook) -> ``after_backward()`` -> finish the grad sync -> sp / tied
    reductions -> ``before_optim()`` -> ``opt.step()``. Returns (the micro-batch losses this
    rank reports, what ``opt.step()`` returned).
    """
    m = len(batches)
    opt.zero_grad()
    plan = StepPlan(groups, step, config.parallel.schedule,
                    loss_scale=getattr(opt, "loss_scale", 1.0),
                    grad_sync=ddp.grad_sync_hook(m),
                    options=options if options is not None else ExecOptions())
    losses = forward_backward(chunks, batches, plan)
    if after_backward is not None:
        after_backward()
    ddp.finish_grad_sync()
    reduce_sp_and_tied(chunks, groups, tied_across_stages(config.model.tie_embeddings,
                                                          config.parallel.schedule), ddp)
    if before_optim is not None:
        before_optim()
    return losses, opt.step()


def reference_adamw(params: list[torch.nn.Parameter], config: Config) -> torch.optim.AdamW:
    """torch.optim.AdamW over ``params`` with Colonnade's decay rule
    (:func:`~colonnade.optim.adamw.decays`: matrices decay, vectors such as norms and biases,
    experts' stacked biases included, do not) and the config's optim settings."""
    o = config.optim
    return torch.optim.AdamW(
        [{"params": [p for p in params if decays(p)], "weight_decay": o.weight_decay},
         {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


