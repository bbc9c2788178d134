"""Uneven pipeline stages: Megatron's convenience form expanded into layers per virtual stage,
and its rule (one of :data:`colonnade.config.validate.RULES`).

``parallel.first_stage_layers`` / ``parallel.last_stage_layers`` (Megatron's
--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers) give the layers of
the virtual stage holding the embedding (v = 0) and of the one holding the head and the loss
(v = pp vp - 1); the other pp vp - 2 virtual stages (pp vp - 1 when only one is given) split
the remaining layers evenly. With vp = 1 a virtual stage is a stage, as in Megatron; with
vp > 1 only the chunk that holds the embedding or the head gets the count (Megatron divides
the first stage's count over its vp chunks instead, which lightens chunks that hold no
embedding); under ZB-V both are chunks of stage 0. :func:`stage_layout` is the one place that
turns either form into the explicit ``parallel.pipeline_layout`` the models build from.
"""

from __future__ import annotations

from colonnade.config.sections import Config, ParallelConfig


def ends_layout(num_layers: int, chunks: int, first: int | None, last: int | None
                ) -> tuple[int, ...] | None:
    """Layers per virtual stage with ``first`` layers on v = 0 and ``last`` on v = chunks - 1
    (None: part of the even split), the rest divided evenly; None when that is impossible
    (fewer than 2 virtual stages, a negative count, or a rest the others do not divide)."""
    ends = [x for x in (first, last) if x is not None]
    others = chunks - len(ends)
    rest = num_layers - sum(ends)
    if chunks < 2 or min(ends, default=0) < 0 or rest < 0:
        return None
    if others == 0:
        return (first, last) if rest == 0 else None  # type: ignore[return-value]
    if rest % others:
        return None
    each = rest // others
    return ((each if first is None else first,) + (each,) * (chunks - 2)
            + (each if last is None else last,))


def stage_layout(par: ParallelConfig, num_layers: int) -> tuple[int, ...] | None:
    """The layers per virtual stage to build (pp x vp entries, virtual-stage order):
    ``parallel.pipeline_layout`` when given, else the expansion of first_stage_layers /
    last_stage_layers (:func:`ends_layout`), else None (the even split). Without a pipeline
    (pp x vp = 1) always None."""
    chunks = par.pp * par.vp
    if par.pipeline_layout is not None or chunks < 2:
        return par.pipeline_layout if chunks >= 2 else None
    if par.first_stage_layers is None and par.last_stage_layers is None:
        return None
    return ends_layout(num_layers, chunks, par.first_stage_layers, par.last_stage_layers)


def _suggest(num_layers: int, chunks: int, first: int | None, last: int | None) -> str:
    """The nearest given counts that the other virtual stages divide (for the message)."""
    fs = range(num_layers + 1) if first is not None else [None]
    ls = range(num_layers + 1) if last is not None else [None]
    fits = [(abs((f or 0) - (first or 0)) + abs((x or 0) - (last or 0)), f, x)
            for f in fs for x in ls if ends_layout(num_layers, chunks, f, x) is not None]
    if not fits:
        return "no such counts exist"
    _, f, x = min(fits, key=lambda fit: fit[0])
    named = [f"first_stage_layers={f}" if f is not None else "",
             f"last_stage_layers={x}" if x is not None else ""]
    return "e.g. " + " and ".join(n for n in named if n)


def pipeline_rules(c: Config, _: int | None) -> list[str]:
    """first_stage_layers / last_stage_layers: only with a pipeline, not with an explicit
    pipeline_layout, non-negative, and the other virtual stages dividing the rest."""
    p, out = c.parallel, []
    first, last = p.first_stage_layers, p.last_stage_layers
    if first is None and last is None:
        return out
    given = ", ".join(f"parallel.{n}={v}" for n, v in (("first_stage_layers", first),
                                                       ("last_stage_layers", last))
                      if v is not None)
    chunks = p.pp * p.vp
    if chunks < 2:
        return [f"{given} needs a pipeline (parallel.pp x parallel.vp >= 2, got {chunks}); "
                "set parallel.pp >= 2 or unset it."]
    if p.pipeline_layout is not None:
        return [f"{given} and parallel.pipeline_layout={list(p.pipeline_layout)} both place "
                "layers; give one of them (pipeline_layout lists every virtual stage)."]
    if min(x for x in (first, last) if x is not None) < 0:
        return [f"{given} must be >= 0 (0: the stage holds only the embedding or the head)."]
    n = c.model.num_layers
    if ends_layout(n, chunks, first, last) is None:
        others = chunks - (first is not None) - (last is not None)
        out.append(f"{given}: the other {others} virtual stages (pp x vp = {chunks}) must "
                   f"split the remaining model.num_layers={n} - "
                   f"{(first or 0) + (last or 0)} evenly; "
                   f"{_suggest(n, chunks, first, last)}, or set parallel.pipeline_layout.")
    return out
