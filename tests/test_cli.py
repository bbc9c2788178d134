"""The ``colonnade`` command line, run in-process through ``main()``.

``train --print-config`` / ``--help-config``, error reporting, and a single-process end-to-end
run: prepare a tiny text directory, train a few steps, save, then ``generate`` from the save.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from colonnade.checkpoint.export import load_exported
from colonnade.cli import main
from colonnade.config import config_from_dict, load_config, resolve
from colonnade.models.build import build_reference

REPO = Path(__file__).resolve().parents[1]


def test_print_config_leaves_the_derived_values_to_a_comment(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--parallel.tp=2", "--training.micro_batch_size=3", "--training.microbatches=2",
            "--model.hidden_size=96", "--model.num_heads=4"]
    assert main(["train", "--nproc", "4", "--print-config", *args]) == 0
    text = capsys.readouterr().out
    data = tomllib.loads(text)
    assert "dp" not in data["parallel"]  # derived from --nproc: the text runs with any
    assert data["training"]["microbatches"] == 2 and "global_batch_size" not in data["training"]
    assert data["model"]["hidden_size"] == 96
    assert config_from_dict(data) == load_config(None, args)
    assert resolve(config_from_dict(data), 4).training.global_batch_size == 3 * 2 * 2
    assert text.rstrip().endswith("parallel.dp = 2, training.global_batch_size = 12")


def test_print_config_reads_a_preset(capsys: pytest.CaptureFixture[str]) -> None:
    preset = REPO / "configs" / "tiny-gpt2.toml"
    assert main(["train", "--config", str(preset), "--print-config",
                 "--training.steps=11"]) == 0
    data = tomllib.loads(capsys.readouterr().out)
    assert data["model"]["arch"] == "gpt2" and data["model"]["tie_embeddings"] is True
    assert data["training"]["steps"] == 11


def test_help_config_lists_every_field_with_docs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help-config"]) == 0
    text = capsys.readouterr().out
    assert "--parallel.tp=1" in text
    assert "Tensor-parallel degree" in text
    assert "--training.precision=fp32" in text


@pytest.mark.parametrize(("args", "fragments"), [
    (["--model.hiden_size=3"], ["model.hiden_size", "Did you mean 'hidden_size'"]),
    (["--model.num_heads=5"], ["model.hidden_size=64 is not divisible by model.num_heads=5"]),
    (["--nproc", "3", "--parallel.tp=2"], ["world size 3", "--nproc"]),
    (["--parallel.tp=x"], ["parallel.tp: expected an integer"]),
])
def test_config_errors_exit_2_naming_the_field(capsys: pytest.CaptureFixture[str],
                                               args: list[str], fragments: list[str]) -> None:
    assert main(["train", "--print-config", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("colonnade: ")
    for fragment in fragments:
        assert fragment in err, err


def test_unknown_argument_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--print-config", "--bogus"])
    assert exc.value.code == 2
    assert "--section.field=value" in capsys.readouterr().err


def _text_dir(root: Path) -> Path:
    """A small corpus of real Python source (the package's own files)."""
    out = root / "text"
    out.mkdir()
    for i, path in enumerate(sorted((REPO / "colonnade" / "config").glob("*.py"))):
        (out / f"doc{i}.py").write_text(path.read_text())
    return out


def test_train_then_generate_end_to_end(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    text = _text_dir(tmp_path)
    model_dir, run_dir = tmp_path / "model", tmp_path / "run"
    args = ["train", "--model.vocab_size=300", "--model.hidden_size=32", "--model.num_layers=2",
            "--model.num_heads=4", "--model.num_kv_heads=2", "--model.max_seq_len=32",
            "--training.seq_len=32", "--training.micro_batch_size=4", "--training.microbatches=2",
            "--training.steps=8", "--training.eval_interval=4", "--training.eval_batches=2",
            "--training.device=cpu", "--optim.lr=1e-2", "--optim.warmup_steps=1",
            f"--data.input={text}", f"--data.prepared_dir={tmp_path / 'prep'}",
            f"--logging.dir={run_dir}", "--logging.progress=false",
            "--logging.tensorboard=false", "--logging.log_interval=2",
            f"--checkpoint.save={model_dir}"]
    torch.manual_seed(0)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "validation loss" in out and "lower" in out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 4, 6, 8]  # step 0: validation only
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in records[1:])
    assert records[-1]["loss"] < records[1]["loss"]
    valid = [r["valid_loss"] for r in records if "valid_loss" in r]
    assert len(valid) == 3 and valid[-1] < valid[1] < valid[0]
    assert load_config(run_dir / "config.toml").training.global_batch_size == 8

    # the saved model: the trained weights, not the initial ones
    config, model = load_exported(model_dir)
    assert config.model.num_kv_heads == 2
    initial = {p.sharding.key: p for p in build_reference(config).parameters()}
    trained = {p.sharding.key: p for p in model.parameters()}
    assert set(initial) == set(trained)
    assert all(not torch.equal(initial[k], trained[k]) for k in trained if trained[k].ndim > 1)

    gen = ["generate", str(model_dir), "--prompt", "def ", "--max-new-tokens", "12",
           "--temperature", "0"]
    assert main(gen) == 0
    greedy = capsys.readouterr().out
    assert main([*gen, "--no-cache"]) == 0
    assert capsys.readouterr().out == greedy  # KV cache and recompute agree
    assert greedy.startswith("def ") and len(greedy.rstrip("\n")) > len("def ")  # new tokens
    assert main(["generate", str(model_dir), "--max-new-tokens", "8", "--seed", "3"]) == 0
    sampled = capsys.readouterr().out
    assert main(["generate", str(model_dir), "--max-new-tokens", "8", "--seed", "3"]) == 0
    assert capsys.readouterr().out == sampled  # seeded sampling is reproducible

    # the run's logging dir (its config.toml names the checkpoint), a step dir, an HF export
    assert main(["convert", "--to-hf", str(model_dir), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    for where in (run_dir, model_dir / "step_00000008", tmp_path / "hf"):
        assert main(["generate", str(where), *gen[2:]]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out == greedy, where


def test_generate_on_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tmp_path)]) == 2  # one clear line, no traceback
    err = capsys.readouterr().err
    assert f"{tmp_path} is not a model directory" in err
    assert "Hugging Face" in err and "config.json" in err and "--checkpoint.save" in err
    (tmp_path / "config.toml").write_text("[training]\nsteps = 3\n")  # a run that saved none
    assert main(["generate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (f"{tmp_path} is a run's logging.dir whose checkpoint.save ({tmp_path / 'checkpoints'})"
            " holds no committed checkpoint (no latest marker): that run saved no model") in err
    assert "config.toml missing" not in err
    assert main(["generate", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_of_prepare_plan_and_train(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["prepare"], capsys)
    assert "--data.input=None" in text and "--data.text_key=text" in text
    assert "Field (jsonl/json records) or column" in text  # the field's docstring
    assert "--model.vocab_size=None" in text and "--optim.lr" not in text  # the tokenizer's
    assert "None (the default): the tokenizer's size" in text
    assert "colonnade prepare --data.input=my_texts/" in text
    text = _help(["plan"], capsys)
    assert "Choose a parallel layout before you train" in text
    assert "colonnade plan --model llama3-8b --cluster h200 --gpus 64" in text
    assert "Wire into the main CLI" not in text and "run_plan(args)" not in text
    text = _help(["train"], capsys)
    assert "--dry-run" in text and "meta device" in text
    text = _help(["plot"], capsys)
    assert "RUN_DIR" in text and "pip install -e '.[plot]'" in text
    text = _help(["generate"], capsys)
    assert "Hugging Face" in text and "logging.dir" in text


def test_bench_lists_runs_and_rejects(capsys: pytest.CaptureFixture[str]) -> None:
    """`colonnade bench` lists the benchmarks/*.py that run as scripts by docstring (not the
    modules they import), runs one with its own options (passed through untouched), and an
    unknown name, or a module's, exits 2 naming the choices."""
    assert main(["bench"]) == 0
    listing = capsys.readouterr().out
    names = {line.split()[0] for line in listing.splitlines()[:-2] if line.strip()}
    files = {p.stem: p.read_text()
             for p in (Path(__file__).parents[1] / "benchmarks").glob("*.py")}
    scripts = {stem for stem, text in files.items() if 'if __name__ == "__main__":' in text}
    assert len(scripts) >= 8 and {"ratios", "pipeline_train", "memory_meter"} <= set(files)
    assert names == scripts
    assert "Narayanan et al. 2021 Table 1" in listing
    assert main(["bench", "planner", "--help"]) == 0  # the script's own --help, in a child
    for name in ("nope", "ratios"):
        assert main(["bench", name]) == 2
        err = capsys.readouterr().err
        assert f"unknown benchmark '{name}'" in err and "planner_cpu" in err


def test_prepared_device_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/planner_device.py (the GPU check a session with a device runs) stays
    runnable: its CPU smoke mode trains, predicts the same layout and writes its JSON."""
    out = tmp_path / "device.json"
    assert main(["bench", "planner_device", "--quick", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["measurement"]["device"] == "cpu" and got["steps"] == 3
    measured, planned = got["rows"]["measured"], got["rows"]["planner"]
    assert measured["tokens_per_s"] == pytest.approx(4 * 2 * 128 / measured["step_s"])
    assert 0.2 < got["predicted_over_measured"] < 5.0  # same order: a sanity bound, not a target
    assert planned["step_s"] == pytest.approx(got["planner_breakdown_s"]["total"])
