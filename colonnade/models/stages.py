"""Which layers each virtual pipeline stage holds, and where each virtual stage lives.

Virtual stage v holds a contiguous run of layers; the first virtual stage also holds the
embedding, the last the final norm, head and loss. A *placement* puts virtual stages on
(stage, chunk): "loop" (Megatron's interleaving, every schedule but zbv) v = chunk * pp + stage;
"v" (ZB-V, vp = 2) chunk 0 of stage s is v = s and chunk 1 is v = 2 pp - 1 - s, so stage 0
holds the first and the last virtual stage. ``config.choices.schedule_placement`` names a
schedule's placement. By default every virtual stage
gets num_layers / (pp * vp) layers; ``pipeline_layout`` gives explicit counts for uneven splits.
A count that does not divide and has no layout is rejected by the config validator (no layer is
ever dropped); this function re-checks so it can be used on its own.

It lives with the models (not the pipeline) because building a rank's chunks needs it and the
pipeline package sits above the models.
"""

from __future__ import annotations

PLACEMENTS: tuple[str, ...] = ("loop", "v")
"""Virtual-stage placements (module docstring)."""


def _check_placement(placement: str, chunk: int | None = None) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}")
    if placement == "v" and chunk is not None and chunk not in (0, 1):
        raise ValueError(f"the 'v' placement holds chunks 0 and 1 (vp = 2), got chunk {chunk}")


def virtual_stage(stage: int, chunk: int, pp: int, placement: str = "loop") -> int:
    """Virtual stage of chunk ``chunk`` on stage ``stage``: c * pp + s ("loop", Megatron's
    interleaved layout) or s / 2 pp - 1 - s for chunk 0 / 1 ("v")."""
    _check_placement(placement, chunk)
    if placement == "v":
        return stage if chunk == 0 else 2 * pp - 1 - stage
    return chunk * pp + stage


def locate(v: int, pp: int, placement: str = "loop") -> tuple[int, int]:
    """(stage, chunk) holding virtual stage ``v``: the inverse of :func:`virtual_stage`."""
    _check_placement(placement)
    if placement == "v":
        return (v, 0) if v < pp else (2 * pp - 1 - v, 1)
    return v % pp, v // pp


def virtual_stage_layers(num_layers: int, pp: int, vp: int,
                         layout: tuple[int, ...] | None = None) -> list[list[int]]:
    """Global layer indices of every virtual stage, in virtual-stage order."""
    chunks = pp * vp
    if layout is None:
        if num_layers % chunks:
            raise ValueError(f"model.num_layers={num_layers} is not divisible by pp x vp="
                             f"{chunks}; set parallel.pipeline_layout")
        layout = (num_layers // chunks,) * chunks
    if len(layout) != chunks or sum(layout) != num_layers or min(layout) < 0:
        raise ValueError(f"parallel.pipeline_layout={list(layout)} must have {chunks} "
                         f"non-negative entries summing to {num_layers}")
    out, start = [], 0
    for count in layout:
        out.append(list(range(start, start + count)))
        start += count
    return out


def stage_chunks(num_layers: int, pp: int, vp: int, stage: int,
                 layout: tuple[int, ...] | None = None, placement: str = "loop"
                 ) -> list[tuple[list[int], bool, bool]]:
    """For pipeline rank ``stage``: per local chunk (layers, holds embedding, holds head)."""
    layers = virtual_stage_layers(num_layers, pp, vp, layout)
    last = pp * vp - 1
    vs = [virtual_stage(stage, c, pp, placement) for c in range(vp)]
    return [(layers[v], v == 0, v == last) for v in vs]
