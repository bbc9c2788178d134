"""Which layers each virtual pipeline stage holds.

Virtual stage v = chunk * pp + stage holds a contiguous run of layers; the first virtual stage
also holds the embedding, the last the final norm, head and loss. By default every virtual stage
gets num_layers / (pp * vp) layers; ``pipeline_layout`` gives explicit counts for uneven splits.
A count that does not divide and has no layout is rejected by the config validator (no layer is
ever dropped); this function re-checks so it can be used on its own.

It lives with the models (not the pipeline) because building a rank's chunks needs it and the
pipeline package sits above the models.
"""

from __future__ import annotations


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
                 layout: tuple[int, ...] | None = None) -> list[tuple[list[int], bool, bool]]:
    """For pipeline rank ``stage``: per local chunk (layers, holds embedding, holds head)."""
    layers = virtual_stage_layers(num_layers, pp, vp, layout)
    last = pp * vp - 1
    return [(layers[c * pp + stage], c * pp + stage == 0, c * pp + stage == last)
            for c in range(vp)]
