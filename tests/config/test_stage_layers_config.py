"""Uneven pipeline stages in the configuration: ``parallel.first_stage_layers`` /
``last_stage_layers`` (Megatron's --decoder-first/last-pipeline-num-layers) expand into layers
per virtual stage in one place (config/rules_pipeline.py ``stage_layout``), which the models
build from; every misuse is refused by the validator with the fields and a fix."""

from __future__ import annotations

import pytest

from colonnade.config.rules_pipeline import stage_layout
from colonnade.config.sections import Config, ModelConfig, ParallelConfig, TrainingConfig
from colonnade.config.validate import problems, resolve
from colonnade.models.stages import stage_chunks


def _config(layers: int, **par: object) -> Config:
    model = ModelConfig(hidden_size=32, num_heads=4, num_layers=layers, max_seq_len=32)
    parallel = ParallelConfig(**par)  # type: ignore[arg-type]
    return resolve(Config(model=model, parallel=parallel, training=TrainingConfig(seq_len=16)),
                   parallel.pp)


@pytest.mark.parametrize(("layers", "par", "want"), [
    (61, {"pp": 8, "first_stage_layers": 5, "last_stage_layers": 8}, (5,) + (8,) * 7),
    (7, {"pp": 2, "first_stage_layers": 3}, (3, 4)),
    (6, {"pp": 4, "last_stage_layers": 0}, (2, 2, 2, 0)),  # the last stage: head and loss only
    (10, {"pp": 2, "vp": 2, "schedule": "interleaved_1f1b", "first_stage_layers": 1,
          "last_stage_layers": 3}, (1, 3, 3, 3)),
    (6, {"pp": 2, "vp": 2, "schedule": "zbv", "first_stage_layers": 1,
         "last_stage_layers": 1}, (1, 2, 2, 1)),  # v order: stage 0 holds v0 and v3
    (6, {"pp": 2, "pipeline_layout": (2, 4)}, (2, 4)),
    (6, {"pp": 2}, None),
    (6, {}, None),
])
def test_stage_layout_expands_the_ends(layers: int, par: dict[str, object],
                                       want: tuple[int, ...] | None) -> None:
    cfg = _config(layers, **par)
    assert problems(cfg, None) == []
    assert stage_layout(cfg.parallel, layers) == want
    if want is not None:  # what each stage builds: the counts in virtual-stage order
        p = cfg.parallel
        placement = "v" if p.schedule == "zbv" else "loop"
        built = {tuple(ls) for s in range(p.pp)
                 for ls, _, _ in stage_chunks(layers, p.pp, p.vp, s, want, placement)}
        assert sum(len(b) for b in built) == layers


@pytest.mark.parametrize(("layers", "par", "fragments"), [
    (61, {"pp": 8, "first_stage_layers": 6},
     ["parallel.first_stage_layers=6: the other 7 virtual stages", "e.g. first_stage_layers=5"]),
    (8, {"pp": 4, "first_stage_layers": 1, "last_stage_layers": 2},
     ["the other 2 virtual stages", "e.g. first_stage_layers=0 and last_stage_layers=2"]),
    (4, {"first_stage_layers": 1}, ["parallel.first_stage_layers=1 needs a pipeline",
                                    "set parallel.pp >= 2"]),
    (4, {"pp": 2, "last_stage_layers": 1, "pipeline_layout": (3, 1)},
     ["parallel.last_stage_layers=1 and parallel.pipeline_layout=[3, 1] both place layers"]),
    (4, {"pp": 2, "first_stage_layers": -1}, ["parallel.first_stage_layers=-1 must be >= 0"]),
    (4, {"pp": 2, "first_stage_layers": 5}, ["the other 1 virtual stages"]),
    (7, {"pp": 2}, ["model.num_layers=7 is not divisible", "parallel.first_stage_layers"]),
])
def test_stage_layers_refused_with_fix(layers: int, par: dict[str, object],
                                       fragments: list[str]) -> None:
    found = problems(_config(layers, **par), None)
    for fragment in fragments:
        assert any(fragment in p for p in found), (fragment, found)
