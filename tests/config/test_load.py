"""The config loader: TOML files, ``--section.field=value`` overrides, suggestions, TOML output.

Cross-field rules are tested in ``tests/reliability``; here every rejected input must name the
offending field (or file) and say how to fix it.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from colonnade.config import (
    SECTIONS,
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    field_docs,
    load_config,
    parse_overrides,
    resolve,
    validate,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_toml_file_sets_fields_and_keeps_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, '[model]\narch = "gpt2"\nhidden_size = 96\n[parallel]\n'
                            'pipeline_layout = [1, 3]\n[optim]\nlr = 5e-4\n')
    cfg = load_config(path)
    assert cfg.model.arch == "gpt2"
    assert cfg.model.hidden_size == 96
    assert cfg.parallel.pipeline_layout == (1, 3)
    assert cfg.optim.lr == 5e-4
    assert cfg.model.num_layers == Config().model.num_layers  # untouched default
    assert cfg.training == Config().training


def test_overrides_apply_after_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[model]\nhidden_size = 96\nnum_layers = 6\n")
    cfg = load_config(path, ["--model.hidden_size=128", "training.steps=7"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.training.steps) == (128, 6, 7)


@pytest.mark.parametrize(
    ("override", "section", "name", "expected"),
    [
        ("--model.hidden_size=1_024", "model", "hidden_size", 1024),
        ("--training.steps=2e3", "training", "steps", 2000),
        ("--parallel.sp=true", "parallel", "sp", True),
        ("--parallel.sp=off", "parallel", "sp", False),
        ("--parallel.overlap_p2p=0", "parallel", "overlap_p2p", False),
        ("--optim.lr=3e-4", "optim", "lr", 3e-4),
        ("--optim.clip_grad=2", "optim", "clip_grad", 2.0),
        ("--model.num_kv_heads=none", "model", "num_kv_heads", None),
        ("--model.num_kv_heads=2", "model", "num_kv_heads", 2),
        ("--checkpoint.save=null", "checkpoint", "save", None),
        ("--checkpoint.save=out/run", "checkpoint", "save", "out/run"),
        ("--parallel.pipeline_layout=1,3", "parallel", "pipeline_layout", (1, 3)),
        ("--parallel.pipeline_layout=[2, 2]", "parallel", "pipeline_layout", (2, 2)),
        ("--data.blend=0.3:a/data,0.7:b/data", "data", "blend", ("0.3:a/data", "0.7:b/data")),
        ("--data.blend=", "data", "blend", ()),
        ("--data.input=a=b", "data", "input", "a=b"),
    ],
)
def test_override_coercion(override: str, section: str, name: str, expected: object) -> None:
    cfg = load_config(None, [override])
    value = getattr(getattr(cfg, section), name)
    assert value == expected and type(value) is type(expected), (override, value)


def test_parse_overrides_nests_by_section() -> None:
    out = parse_overrides(["--model.arch=gpt2", "model.num_layers=2", "--optim.lr=1"])
    assert out == {"model": {"arch": "gpt2", "num_layers": "2"}, "optim": {"lr": "1"}}


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("--model.hidden_size=big", ["model.hidden_size", "expected an integer", "'big'"]),
        ("--model.hidden_size=64.5", ["model.hidden_size", "expected an integer"]),
        ("--model.num_layers=true", ["model.num_layers", "expected an integer"]),
        ("--parallel.sp=maybe", ["parallel.sp", "expected true/false"]),
        ("--optim.lr=fast", ["optim.lr", "expected a number"]),
        ("--model.num_kv_heads=two", ["model.num_kv_heads", "expected an integer"]),
        ("--parallel.pipeline_layout=1,x", ["parallel.pipeline_layout", "expected an integer"]),
        ("--model.hidden_size", ["--model.hidden_size", "--section.field=value"]),
        ("--hidden_size=64", ["--hidden_size=64", "--section.field=value"]),
    ],
)
def test_bad_override_names_field(override: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("--model.hiden_size=64", ["model.hiden_size", "Did you mean 'hidden_size'"]),
        ("--parallel.tensor_parallel=2", ["parallel.tensor_parallel", "Valid names:", "tp"]),
        ("--modle.arch=gpt2", ["modle", "Did you mean 'model'"]),
        ("--optimizer.lr=1", ["optimizer", "Did you mean 'optim'"]),
        ("--zzz.lr=1", ["zzz", "Valid names:", "training"]),
    ],
)
def test_unknown_names_suggest_the_closest(override: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_unknown_field_in_file_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, "[training]\nmicro_batch = 4\n")
    with pytest.raises(ConfigError, match=r"training\.micro_batch'.*Did you mean "
                                          r"'microbatches' or 'micro_batch_size'\?"):
        load_config(path)


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    path = _write(tmp_path, 'model = "llama"\n')
    with pytest.raises(ConfigError, match="section 'model' must be a table"):
        load_config(path)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml' does not exist \(see configs/"):
        load_config(tmp_path / "nope.toml")
    path = _write(tmp_path, "[model\nhidden_size = 3\n")
    with pytest.raises(ConfigError, match=r"run\.toml' is not valid TOML"):
        load_config(path)


def test_wrong_type_in_file_names_field(tmp_path: Path) -> None:
    path = _write(tmp_path, '[parallel]\ntp = "two"\n')
    with pytest.raises(ConfigError, match=r"parallel\.tp: expected an integer, got 'two'"):
        load_config(path)


def _nondefault_config() -> Config:
    return config_from_dict({
        "model": {"arch": "gpt2", "hidden_size": 48, "num_kv_heads": 2, "norm_eps": 1e-6,
                  "tie_embeddings": True},
        "parallel": {"tp": 2, "pipeline_layout": [1, 3], "order": "dp-tp-pp-cp-ep"},
        "data": {"blend": ["0.5:x/data", "0.5:y \"q\"\\z"], "input": "some dir"},
        "optim": {"lr": 1.5e-4, "initial_loss_scale": 65536.0},
        "training": {"global_batch_size": 16, "precision": "bf16"},
        "checkpoint": {"save": "ckpt"},
        "logging": {"peak_tflops": 123.5, "tensorboard": False},
    })


@pytest.mark.parametrize("source", ["default", "nondefault", *sorted(
    p.name for p in CONFIGS.glob("*.toml"))])
def test_config_to_toml_round_trip(source: str, tmp_path: Path) -> None:
    if source == "default":
        cfg = Config()
    elif source == "nondefault":
        cfg = _nondefault_config()
    else:
        cfg = load_config(CONFIGS / source)
    text = config_to_toml(cfg)
    assert config_from_dict(tomllib.loads(text)) == cfg
    path = tmp_path / "again.toml"
    path.write_text(text)
    assert load_config(path) == cfg
    assert tomllib.loads(text) == config_to_dict(cfg)


def test_config_to_dict_drops_none_and_lists_tuples() -> None:
    data = config_to_dict(_nondefault_config())
    assert "dp" not in data["parallel"]  # None
    assert data["parallel"]["pipeline_layout"] == [1, 3]
    assert set(data) == set(SECTIONS)


def test_a_none_that_is_not_the_default_reads_back_as_none(tmp_path: Path) -> None:
    """checkpoint.save=none (the opt-out; its default is 'auto') is written as "none", so the
    run's config.toml does not come back as a run that saves."""
    cfg = config_from_dict({"checkpoint": {"save": "none"}})
    assert cfg.checkpoint.save is None and Config().checkpoint.save == "auto"
    assert config_to_dict(cfg)["checkpoint"]["save"] == "none"
    path = tmp_path / "run.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg


def test_every_field_has_a_docstring() -> None:
    for name, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert len(docs.get(f.name, "")) >= 8, f"{name}.{f.name} has no docstring"


def test_sections_are_frozen_and_keyword_only() -> None:
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.hidden_size = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        SECTIONS["model"]("llama")  # positional arguments are refused


def test_resolve_derives_dp_and_batches() -> None:
    cfg = load_config(None, ["--parallel.tp=2", "--training.micro_batch_size=3",
                             "--training.microbatches=4"])
    out = resolve(cfg, 8)
    assert out.parallel.dp == 4
    assert out.training.global_batch_size == 3 * 4 * 4
    cfg = load_config(None, ["--parallel.pp=2", "--training.micro_batch_size=2",
                             "--training.global_batch_size=24"])
    out = validate(resolve(cfg, 4), 4)
    assert (out.parallel.dp, out.training.microbatches) == (2, 6)
    assert resolve(out, 4) == out  # idempotent


def test_validation_error_lists_every_problem_with_fix() -> None:
    cfg = load_config(None, ["--model.arch=gpt2", "--model.num_heads=3", "--parallel.sp=true"])
    with pytest.raises(ConfigError) as err:
        validate(resolve(cfg, 1), 1)
    text = str(err.value)
    assert "model.hidden_size=64 is not divisible by model.num_heads=3" in text
    assert "parallel.sp=true needs parallel.tp > 1" in text and "set sp=false" in text
    assert text.count("\n  - ") == 2, text


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_presets_are_valid(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    par = cfg.parallel  # dp unset (derived from --nproc): the fewest ranks its experts fold into
    dp = par.dp or max(1, par.ep * (par.expert_tp or 1) // (par.tp * par.cp))
    world = par.tp * par.pp * par.cp * dp
    validate(resolve(cfg, world), world)
