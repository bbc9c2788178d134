"""ZB-V configuration (``parallel.schedule = "zbv"``): the rules of config/validate.py
``_pipeline`` and ``_compile`` refuse vp != 2, pp = 1 and training.compile with messages that
name the field and the fix, before any work (the CLI exits 2 and writes nothing); pp 2 / 4
with vp 2 validate; ``pipeline_layout`` counts layers per virtual stage in v order, which the
"v" placement puts on stages s and 2 pp - 1 - s; the dry run shows the layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from colonnade.cli import main
from colonnade.config.choices import schedule_placement, tied_across_stages
from colonnade.config.sections import Config, ModelConfig, ParallelConfig, TrainingConfig
from colonnade.config.validate import problems, resolve
from colonnade.models.stages import stage_chunks

TINY = {"hidden_size": 32, "num_heads": 4, "num_layers": 4, "max_seq_len": 32}
TINY_ARGS = ["--model.num_layers=4", "--model.hidden_size=32", "--model.num_heads=4",
             "--model.vocab_size=300", "--model.max_seq_len=32", "--training.seq_len=16",
             "--training.micro_batch_size=2", "--training.steps=2", "--training.device=cpu",
             "--training.eval_interval=0"]


def _problems(world: int, model: dict[str, object] | None = None,
              training: dict[str, object] | None = None, **par: object) -> list[str]:
    config = Config(model=ModelConfig(**{**TINY, **(model or {})}),  # type: ignore[arg-type]
                    parallel=ParallelConfig(**par),  # type: ignore[arg-type]
                    training=TrainingConfig(**{"seq_len": 16, **(training or {})}))  # type: ignore[arg-type]
    return problems(resolve(config, world), world)


@pytest.mark.parametrize(("world", "model", "par"), [
    (2, {}, {"pp": 2, "vp": 2}),
    (4, {"num_layers": 8}, {"pp": 4, "vp": 2}),
    (4, {}, {"pp": 2, "vp": 2, "dp": 2, "zero_stage": 3}),
    (4, {}, {"pp": 2, "vp": 2, "tp": 2, "sp": True}),
    (2, {"num_layers": 6}, {"pp": 2, "vp": 2, "pipeline_layout": (3, 1, 1, 1)}),
    (2, {"num_layers": 5}, {"pp": 2, "vp": 2, "pipeline_layout": (1, 2, 0, 2)}),
])
def test_valid_zbv_layouts(world: int, model: dict[str, object],
                           par: dict[str, object]) -> None:
    assert _problems(world, model, schedule="zbv", **par) == []


@pytest.mark.parametrize(("world", "model", "training", "par", "fragments"), [
    (2, {}, {}, {"pp": 2, "vp": 1},
     ["parallel.schedule='zbv' places two chunks per stage in a V",
      "set parallel.vp=2 (got 1)"]),
    (2, {"num_layers": 6}, {}, {"pp": 2, "vp": 3},
     ["parallel.schedule='zbv' places two chunks per stage in a V",
      "set parallel.vp=2 (got 3)"]),
    (1, {}, {}, {"pp": 1, "vp": 2},
     ["parallel.schedule='zbv' needs parallel.pp >= 2 (got 1)", "schedule='1f1b' with pp=1",
      "parallel.vp > 1 needs parallel.pp > 1"]),
    (1, {}, {}, {"pp": 1, "vp": 1},
     ["parallel.schedule='zbv' needs parallel.pp >= 2 (got 1)", "set parallel.vp=2 (got 1)"]),
    (2, {}, {"compile": True}, {"pp": 2, "vp": 2},
     ["training.compile=true does not go with parallel.schedule='zbv'",
      "set training.compile=false"]),
    (2, {"num_layers": 6}, {}, {"pp": 2, "vp": 2, "pipeline_layout": (3, 1, 1)},
     ["parallel.pipeline_layout has 3 entries; it needs pp x vp=4"]),
    (2, {"num_layers": 6}, {}, {"pp": 2, "vp": 2},
     ["model.num_layers=6 is not divisible by parallel.pp x parallel.vp=4"]),
])
def test_zbv_rules_name_field_and_fix(world: int, model: dict[str, object],
                                      training: dict[str, object], par: dict[str, object],
                                      fragments: list[str]) -> None:
    found = _problems(world, model, training, schedule="zbv", **par)
    for fragment in fragments:
        assert any(fragment in p for p in found), (fragment, found)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--nproc", "2", "--parallel.pp=2"], "set parallel.vp=2 (got 1)"),
    (["--nproc", "2", "--parallel.pp=2", "--parallel.vp=3", "--model.num_layers=6"],
     "set parallel.vp=2 (got 3)"),
    (["--parallel.vp=2"], "parallel.schedule='zbv' needs parallel.pp >= 2 (got 1)"),
    (["--nproc", "2", "--parallel.pp=2", "--parallel.vp=2", "--training.compile=true"],
     "training.compile=true does not go with parallel.schedule='zbv'"),
])
def test_cli_refuses_before_any_work(args: list[str], fragment: str, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # runs/, checkpoints/ and the built-in corpus would go here
    assert main(["train", *TINY_ARGS, "--parallel.schedule=zbv", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err, err
    assert list(tmp_path.iterdir()) == []  # nothing prepared, launched or written


def test_dry_run_shows_the_zbv_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY_ARGS, "--nproc", "2", "--parallel.pp=2", "--parallel.vp=2",
                 "--parallel.schedule=zbv", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "layout: pp2-vp2 (schedule zbv) on 2 rank(s)" in out, out
    assert "model: llama, 4 layers" in out, out
    assert list(tmp_path.iterdir()) == []


def test_layout_is_in_v_order_and_the_v_placement_reads_it() -> None:
    """(3, 1, 1, 1) for pp 2: v0 = layers 0-2 and v3 = layer 5 on stage 0 (embedding and
    head), v1 = layer 3 and v2 = layer 4 on stage 1; the loop placement of interleaved 1F1B
    puts v2 on stage 0 instead."""
    assert schedule_placement("zbv") == "v"
    assert schedule_placement("interleaved_1f1b") == "loop"
    layout = (3, 1, 1, 1)
    assert stage_chunks(6, 2, 2, 0, layout, "v") == [([0, 1, 2], True, False),
                                                     ([5], False, True)]
    assert stage_chunks(6, 2, 2, 1, layout, "v") == [([3], False, False), ([4], False, False)]
    assert stage_chunks(6, 2, 2, 0, layout, "loop") == [([0, 1, 2], True, False),
                                                        ([4], False, False)]
    assert not tied_across_stages(True, "zbv")  # one Parameter on stage 0
    assert tied_across_stages(True, "interleaved_1f1b")
    assert not tied_across_stages(False, "1f1b")
