"""``training.memory_limit_gb``: refuse, before any work starts, a run the memory model says
exceeds the per-rank budget, and name what would fit.

The estimate is the planner's (:func:`colonnade.analysis.memory.memory_per_device`): model
states of the ZeRO stage, the activations of the in-flight micro-batches (1/cp of them per rank
under context parallelism), the pipeline / sp / cp buffers, on the fullest pipeline stage.
What fits is found with the same model, changing one thing at a time from the configured
layout (each alternative keeps the global batch and the other degrees):

* context parallelism: the smallest cp (a power of two, up to s/2) the validator accepts for
  this shape whose estimate fits, with the same tp, pp and dp (so cp x as many ranks);
* ``training.recompute='full'`` (each layer keeps only its input);
* the largest smaller ``training.micro_batch_size`` dividing the current one (with
  ``training.microbatches`` raised to keep the global batch);
* if none of these alone fits: the smallest cp together with recompute='full'.

Called by the command line (``colonnade train`` and every torchrun rank, right after
:func:`colonnade.training.preflight.preflight`; before any file is written, data prepared or
process started) and reported by ``--dry-run``.  It lives in analysis, above training, because
it reuses the planner's memory model.
"""

from __future__ import annotations

import dataclasses

from colonnade.analysis.hardware import GIB
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import Memory, memory_per_device, stage_label
from colonnade.analysis.search import cp_shape_ok
from colonnade.config.load import ConfigError
from colonnade.config.sections import Config


@dataclasses.dataclass(frozen=True)
class Fit:
    """One alternative that fits: the flags that select it and its estimate."""

    flags: str
    """`colonnade train` overrides, e.g. '--parallel.cp=2'."""
    total_gib: float
    """Estimated peak GiB per rank."""
    note: str = ""
    """What else changes (e.g. the rank count)."""

    def describe(self) -> str:
        """'flags (X GiB per rank[, note])'."""
        return f"{self.flags} ({self.total_gib:.3g} GiB per rank{self.note})"


def estimate(config: Config, world: int) -> tuple[Workload, Layout, Memory]:
    """The memory model's per-rank peak of a resolved config on ``world`` ranks."""
    workload = Workload.from_config(config)
    layout = Layout.from_config(config, world)
    return workload, layout, memory_per_device(workload, layout)


def _cp_fit(w: Workload, layout: Layout, limit: float, recompute: str | None = None
            ) -> Fit | None:
    """The smallest cp > layout.cp (same tp, pp, dp) that fits, optionally with recompute."""
    cp = layout.cp * 2
    while cp <= w.seq_len // 2:
        trial = dataclasses.replace(layout, cp=cp, **({"recompute": recompute}
                                                      if recompute else {}))
        if cp_shape_ok(w, trial.tp, cp, trial.cp_attention, trial.sp, trial.cp_a2a_size):
            total = memory_per_device(w, trial).total
            if total <= limit:
                flags = f"--parallel.cp={cp}" + (f" --training.recompute={recompute}"
                                                  if recompute else "")
                return Fit(flags, total / GIB, f", on {trial.world} ranks")
        cp *= 2
    return None


def _micro_fit(w: Workload, layout: Layout, limit: float) -> Fit | None:
    """The largest smaller micro-batch (a divisor of the current one) that fits."""
    for mb in range(layout.micro_batch - 1, 0, -1):
        if layout.micro_batch % mb:
            continue
        trial = dataclasses.replace(layout, micro_batch=mb)
        total = memory_per_device(w, trial).total
        if total <= limit:
            m = trial.microbatches(w.global_batch)
            return Fit(f"--training.micro_batch_size={mb} --training.microbatches={m}",
                       total / GIB)
    return None


def fits(w: Workload, layout: Layout, limit_bytes: float) -> list[Fit]:
    """Alternatives to ``layout`` within ``limit_bytes`` per rank (module docstring order)."""
    found: list[Fit] = []
    cp = _cp_fit(w, layout, limit_bytes)
    if cp is not None:
        found.append(cp)
    if layout.recompute != "full":
        trial = dataclasses.replace(layout, recompute="full")
        total = memory_per_device(w, trial).total
        if total <= limit_bytes:
            found.append(Fit("--training.recompute=full", total / GIB))
    micro = _micro_fit(w, layout, limit_bytes)
    if micro is not None:
        found.append(micro)
    if not found and layout.recompute != "full":
        both = _cp_fit(w, layout, limit_bytes, recompute="full")
        if both is not None:
            found.append(both)
    return found


def limit_problem(config: Config, world: int) -> str | None:
    """None when ``training.memory_limit_gb`` is unset or the estimate is within it, else
    the refusal: the estimate by kind, the limit and what would fit (fields named)."""
    limit_gb = config.training.memory_limit_gb
    if limit_gb is None:
        return None
    w, layout, mem = estimate(config, world)
    limit = limit_gb * GIB
    if mem.total <= limit:
        return None
    gib = mem.gib()
    parts = ", ".join(f"{k} {gib[k]:.3g}" for k in ("params", "grads", "optimizer",
                                                    "activations", "buffers", "grad_buckets",
                                                    "gathered", "cp_buffers",
                                                    "loss_backward") if gib[k] > 0)
    options = fits(w, layout, limit)
    advice = ("What fits (the same model's estimate): "
              + "; ".join(f.describe() for f in options)) if options else (
        "Nothing tried fits (parallel.cp up to seq_len/2, training.recompute=full, a smaller "
        "training.micro_batch_size): the model states need more ranks: raise parallel.dp "
        "with parallel.zero_stage, parallel.tp or parallel.pp")
    return (f"training.memory_limit_gb={limit_gb:g}: this run needs an estimated "
            f"{gib['total']:.3g} GiB per rank ({layout.short()}, {stage_label(mem.stage)} "
            f"stage: {parts} "
            f"GiB; the planner's memory model), more than the limit. {advice}; or raise "
            "training.memory_limit_gb.")


def check_memory_limit(config: Config, world: int) -> None:
    """Raise :class:`ConfigError` when the resolved ``config`` exceeds its memory limit."""
    problem = limit_problem(config, world)
    if problem is not None:
        raise ConfigError(problem)


def memory_limit_line(config: Config, world: int) -> str | None:
    """The dry run's line about training.memory_limit_gb (None when unset)."""
    limit_gb = config.training.memory_limit_gb
    if limit_gb is None:
        return None
    problem = limit_problem(config, world)
    if problem is None:
        total = estimate(config, world)[2].total / GIB
        return f"memory limit: {limit_gb:g} GiB per rank; the estimate {total:.3g} GiB fits"
    return f"memory limit: train would refuse this run: {problem}"
