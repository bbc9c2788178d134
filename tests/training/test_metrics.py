"""What a run reports (issue 14, item 12): tokens, elapsed time, ETA and perplexity in every
record and log line, the step-0 validation loss as its own record, MFU only against a known
peak, TensorBoard's absence said aloud, W&B logging of every record."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from colonnade.cli import main
from colonnade.config import load_config
from colonnade.device import peak_tflops
from colonnade.training.metrics import MetricsWriter, RunClock, format_line, logging_problems
from tests.reliability.jobs import tiny_args, write_corpus


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], str]:
    """A 6-step single-process run (log every 2 steps, evaluate every 3), no peak given:
    (run dir, its metrics.jsonl records, what it printed)."""
    root = tmp_path_factory.mktemp("metrics_run")
    text = write_corpus(root / "text", docs=3, words=1200)
    args = [a for a in tiny_args(text, root / "prep", root / "run", training__steps=6,
                                 training__eval_interval=3, training__eval_batches=2,
                                 logging__log_interval=2)
            if not a.startswith("--logging.peak_tflops")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", *args]) == 0
    lines = (root / "run" / "metrics.jsonl").read_text().splitlines()
    return root / "run", [json.loads(line) for line in lines], out.getvalue()


def test_records_hold_tokens_elapsed_eta_and_perplexity(
        run: tuple[Path, list[dict[str, Any]], str]) -> None:
    run_dir, records, _ = run
    cfg = load_config(run_dir / "config.toml")
    per_step = int(cfg.training.global_batch_size or 0) * cfg.training.seq_len
    assert per_step == 2 * 16
    assert [r["step"] for r in records] == [0, 2, 3, 4, 6]
    first = records[0]  # the validation loss before any step, a record of its own
    assert "loss" not in first and first["tokens"] == 0 and "eta_s" not in first
    assert first["valid_ppl"] == pytest.approx(math.exp(first["valid_loss"]), rel=1e-12)
    assert first["valid_loss"] == pytest.approx(math.log(300), rel=0.05)  # untrained: ~ln V
    for rec in records[1:]:
        assert rec["tokens"] == rec["step"] * per_step
        assert rec["eta_s"] == pytest.approx(rec["elapsed_s"] / rec["step"] * (6 - rec["step"]),
                                             rel=1e-9)
        assert "mfu" not in rec  # a CPU's peak is unknown: no guessed MFU
    assert records[-1]["eta_s"] == 0.0
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[0] < elapsed[-1]
    valid = [r for r in records[1:] if "valid_loss" in r]
    assert [r["step"] for r in valid] == [3, 6]
    assert all(r["valid_ppl"] == pytest.approx(math.exp(r["valid_loss"]), rel=1e-12)
               for r in valid)


def test_log_lines_show_eta_elapsed_tokens_and_mfu_na(
        run: tuple[Path, list[dict[str, Any]], str]) -> None:
    _, records, out = run
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 5
    assert lines[0].startswith("step     0 | valid ") and "(ppl " in lines[0]
    assert "0 tok" in lines[0] and "ETA" not in lines[0]
    last = lines[-1]
    assert f"{records[-1]['tokens']} tok" in last  # 192 tokens
    assert "ETA 0m00s" in last and "elapsed " in last
    assert "MFU n/a" in last and "%" not in last.split("MFU")[1]
    assert "MFU n/a: the peak TFLOP/s of cpu is unknown (set --logging.peak_tflops" in out


def test_mfu_only_against_a_known_peak() -> None:
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, torch.float32, None) is None  # was a measured matmul: MFU 400%
    assert peak_tflops(cpu, torch.bfloat16, 2.5) == 2.5
    rec = {"step": 4, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0,
           "tflops_per_device": 0.5, "mfu": 0.5 / 2.5}
    assert "MFU 20.0%" in format_line(rec)


def test_run_clock_numbers() -> None:
    clock = RunClock(start_step=10, total_steps=30, tokens_per_step=64)
    clock.t0 -= 40.0  # 40 s ago
    got = clock.fields(20)
    assert got["tokens"] == 20 * 64
    assert got["elapsed_s"] == pytest.approx(40.0, abs=0.5)
    assert got["eta_s"] == pytest.approx(got["elapsed_s"] / 10 * 10)  # 10 steps done, 10 left
    resumed = RunClock(start_step=10, total_steps=30, tokens_per_step=64, elapsed_before_s=500.0)
    resumed.t0 -= 40.0  # resumed 40 s ago after 500 s of training: the ETA is this segment's
    again = resumed.fields(20)
    assert again["elapsed_s"] == pytest.approx(540.0, abs=0.5)
    assert again["eta_s"] == pytest.approx(again["elapsed_s"] - 500.0)
    assert resumed.elapsed() == pytest.approx(540.0, abs=0.5)
    assert "eta_s" not in RunClock(5, 9, 1).fields(5)  # no step done yet (JSON has no NaN)
    line = format_line({"step": 20, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0,
                        "tokens_per_s": 1.0, "tflops_per_device": 0.0, **got})
    assert "1.28k tok" in line and "elapsed 0m40s" in line and "ETA 0m40s" in line


def test_tensorboard_asked_for_but_missing_warns(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    writer = MetricsWriter(tmp_path, tensorboard=True)
    writer.write({"step": 1, "loss": 2.0})
    writer.close()
    err = capsys.readouterr().err
    assert "logging.tensorboard=true but the tensorboard package is not installed" in err
    assert "pip install -e '.[tb]'" in err and "--logging.tensorboard=false" in err
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.0,
                                                                    "attempt": 0}
    assert load_config(None, []).logging.tensorboard is False  # opt-in: no warning by default


def _without_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))


def test_wandb_missing_is_refused_before_anything(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _without_wandb(monkeypatch)
    cfg = load_config(None, ["--logging.wandb_project=demo"])
    assert logging_problems(cfg.logging) and not logging_problems(load_config(None, []).logging)
    status = main(["train", "--logging.wandb_project=demo", f"--logging.dir={tmp_path / 'r'}",
                   f"--data.prepared_dir={tmp_path / 'd'}", "--training.steps=2"])
    err = capsys.readouterr().err
    assert status == 2
    assert "logging.wandb_project='demo' but the wandb package is not installed" in err
    assert "pip install wandb" in err
    assert list(tmp_path.iterdir()) == []  # nothing prepared, nothing written


def test_wandb_gets_every_finite_scalar(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    class FakeRun:
        def log(self, data: dict[str, float], step: int) -> None:
            calls.append(("log", (dict(data), step)))

        def finish(self) -> None:
            calls.append(("finish", None))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    writer = MetricsWriter(tmp_path, False, wandb_project="proj", wandb_run_name="r1",
                           run_config={"model": {"hidden_size": 32}})
    writer.write({"step": 3, "loss": 1.5, "valid_ppl": math.inf, "eta_s": math.nan, "n": 4})
    writer.close()
    assert calls[0][0] == "init"
    assert calls[0][1]["project"] == "proj" and calls[0][1]["name"] == "r1"
    assert calls[0][1]["config"] == {"model": {"hidden_size": 32}}
    assert calls[1] == ("log", ({"loss": 1.5, "n": 4}, 3))
    assert calls[2] == ("finish", None)


def test_a_fresh_run_moves_an_earlier_runs_records_aside(tmp_path: Path) -> None:
    """A new run (step 0) in a logging.dir holding another run's metrics.jsonl keeps no record of
    it (not even its step-0 one, which would duplicate step 0) and loses none: they move to
    metrics.dropped.jsonl. A resume at step 4 keeps steps 0..4."""
    old = [{"step": s, "loss": 5.0 - s} for s in (0, 2, 4, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    writer = MetricsWriter(tmp_path, tensorboard=False, start_step=4)
    writer.close()
    kept = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (kept, writer.dropped) == ([0, 2, 4], 1)
    writer = MetricsWriter(tmp_path, tensorboard=False, start_step=0)
    writer.write({"step": 0, "valid_loss": 7.0})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 0, "valid_loss": 7.0, "attempt": 1}]
    dropped = (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["step"] for x in dropped) == [0, 2, 4, 6]
    assert writer.dropped == 3


def test_records_say_which_attempt_wrote_them_also_when_dropped(tmp_path: Path) -> None:
    """Each start of training into a logging.dir stamps its records with the next attempt
    number (one more than any record holds, in either file), so the records that two resumes
    from step 2 moved to metrics.dropped.jsonl are told apart; :attr:`kept` is the history a
    resume continues."""
    numbers = []
    for _ in range(3):
        writer = MetricsWriter(tmp_path, tensorboard=False, start_step=2)
        numbers.append(writer.attempt)
        assert [r["step"] for r in writer.kept] == ([] if not numbers[:-1] else [1, 2])
        for step in ([1, 2, 3, 4] if writer.attempt == 0 else [3, 4]):
            writer.write({"step": step, "loss": 1.0})
        writer.close()
    assert numbers == [0, 1, 2]
    read = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["attempt"]) for r in read] == [(1, 0), (2, 0), (3, 2), (4, 2)]
    dropped = (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()
    assert [(json.loads(x)["step"], json.loads(x)["attempt"]) for x in dropped] == [
        (3, 0), (4, 0), (3, 1), (4, 1)]


def test_a_different_config_toml_is_kept_not_replaced(tmp_path: Path) -> None:
    from colonnade.training.lifecycle import write_run_config

    assert write_run_config(tmp_path, "a = 1\n") == ""
    assert write_run_config(tmp_path, "a = 1\n") == ""  # the same run again: nothing to keep
    assert "config.previous-1.toml" in write_run_config(tmp_path, "a = 2\n")
    assert "config.previous-2.toml" in write_run_config(tmp_path, "a = 3\n")
    assert [(tmp_path / n).read_text() for n in
            ("config.previous-1.toml", "config.previous-2.toml", "config.toml")] == [
        "a = 1\n", "a = 2\n", "a = 3\n"]
