"""``colonnade train --parallel.cp=2`` as a user runs it (float64): the same losses as one
process on the same data (1e-12), with ring and all-to-all attention and with packed-document
masks; a resume that changes cp; ``colonnade generate`` from the cp-trained checkpoint (at
cp = 1); the layout line and the throughput fields under cp (tokens per step global, FLOPs per
device over every rank). The commands run in this process, their ranks on the rank pool
(the ``cli`` fixture)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from colonnade.cli import main
from colonnade.config.load import load_config
from colonnade.models.counts import flops_per_token
from tests.reliability.jobs import losses, tiny_args
from tests.workflow.cli import Cli, assert_same_losses, greedy_text
from tests.workflow.conftest import corpus

__all__ = ["corpus"]

STEPS, TOL = 6, 1e-12
DOC_MASKS = {"data__reset_attention_mask": "true", "data__reset_position_ids": "true"}


def _args(corpus: tuple[Path, Path], run: Path, **extra: object) -> list[str]:
    return tiny_args(*corpus, run, training__precision="fp64", training__steps=STEPS,
                     **extra)


@pytest.fixture(scope="module")
def reference(corpus: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, tuple[dict[int, float], Path]]:
    """One-process runs, plain and with document masks: (losses, checkpoint.save)."""
    out = {}
    for name, extra in (("plain", {}), ("docs", DOC_MASKS)):
        root = tmp_path_factory.mktemp(f"ref-{name}")
        assert main(["train", *_args(corpus, root / "run", checkpoint__save=root / "ckpt",
                                     checkpoint__interval=3, **extra)]) == 0
        out[name] = (losses(root / "run"), root / "ckpt")
    return out


CASES = [("ring", "plain"), ("ring", "docs")]  # all_to_all: test_resume_changes_cp's first run


@pytest.mark.parametrize(("attention", "data"), CASES, ids=[f"{a}-{d}" for a, d in CASES])
def test_cp2_train_equals_one_process(corpus: tuple[Path, Path], tmp_path: Path,
                                      reference: dict[str, tuple[dict[int, float], Path]],
                                      attention: str, data: str,
                                      capsys: pytest.CaptureFixture[str], cli: Cli) -> None:
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    extra = DOC_MASKS if data == "docs" else {}
    args = _args(corpus, run, parallel__cp=2, parallel__cp_attention=attention,
                 checkpoint__save=ckpt, checkpoint__interval=3, **extra)
    status, out = cli(["train", "--nproc", "2", *args])
    assert status == 0, out
    overlap = ", overlapped" if attention == "ring" else ""
    assert f"colonnade: cp2 (cp attention: {attention}{overlap}) on cpu" in out, out
    want, ref_ckpt = reference[data]
    assert_same_losses(losses(run), want, range(1, STEPS + 1), TOL)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(None, args)
    per_step = 2 * 16  # global batch (micro-batch 2 x 1 x dp 1) x seq_len: the same at cp2
    flops = flops_per_token(cfg.model, 16)
    for rec in records:
        assert rec["tokens"] == rec["step"] * per_step
        assert rec["tflops_per_device"] == pytest.approx(
            rec["tokens_per_s"] * flops / 1e12 / 2, rel=1e-9)  # two devices share the work
        assert rec["mfu"] == pytest.approx(rec["tflops_per_device"] / 1.0, rel=1e-9)
    meta = json.loads((ckpt / "step_00000006" / "metadata.json").read_text())
    assert meta["layout"]["cp"] == 2 and meta["layout"]["cp_attention"] == attention
    if data == "plain" and attention == "ring":  # generate runs at cp = 1, as one process
        assert greedy_text(ckpt, capsys, "the ") == greedy_text(ref_ckpt, capsys, "the ")


def test_resume_changes_cp(corpus: tuple[Path, Path], tmp_path: Path,
                           reference: dict[str, tuple[dict[int, float], Path]],
                           cli: Cli) -> None:
    """A cp2 all-to-all run (the one-process losses) that died after committing step 3,
    re-run as cp4 (ring): it resumes at step 3 and steps 4..6 have the same losses."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    first = _args(corpus, run, parallel__cp=2, parallel__cp_attention="all_to_all",
                  checkpoint__save=ckpt, checkpoint__interval=3)
    status, out = cli(["train", "--nproc", "2", *first])
    assert status == 0, out
    assert "colonnade: cp2 (cp attention: all_to_all) on cpu" in out, out
    want, _ = reference["plain"]
    assert_same_losses(losses(run), want, range(1, STEPS + 1), TOL)
    (ckpt / "latest").write_text("step_00000003\n")  # as if it died after step 3
    again = _args(corpus, run, parallel__cp=4, checkpoint__save=ckpt, checkpoint__interval=3)
    status, out = cli(["train", "--nproc", "4", *again])
    assert status == 0, out
    assert "resuming from" in out and "step_00000003" in out, out
    assert "cp4 (cp attention: ring, overlapped)" in out, out
    assert_same_losses(losses(run), want, range(1, STEPS + 1), TOL)


EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "long-context-cp2.toml"


def test_long_context_example_fits_only_with_cp(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """configs/long-context-cp2.toml: training.memory_limit_gb is below the memory model's
    cp1 estimate and above its cp2 one, so the dry run at cp2 fits and a cp1 run is refused
    before anything is prepared or written, pointing at --parallel.cp=2."""
    run = tmp_path / "run"
    base = ["train", "--config", str(EXAMPLE), f"--logging.dir={run}"]
    assert main([*base, "--nproc", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "layout: cp2 (cp attention: ring, overlapped) on 2 rank(s)" in out, out
    assert "cp: 2 (ring" in out, out
    fits = re.search(r"memory limit: 0\.09 GiB per rank; the estimate ([\d.]+) GiB fits", out)
    assert fits and 0.07 < float(fits.group(1)) < 0.085, out  # 0.078 by the memory model
    assert main([*base, "--parallel.cp=1", "--dry-run"]) == 0
    assert "memory limit: train would refuse this run" in capsys.readouterr().out
    assert main([*base, "--parallel.cp=1"]) == 2
    err = capsys.readouterr().err
    need = re.search(r"training\.memory_limit_gb=0\.09: this run needs an estimated ([\d.]+) "
                     r"GiB per rank", err)
    assert need and 0.13 < float(need.group(1)) < 0.15, err  # 0.140 by the memory model
    assert "--parallel.cp=2 (" in err, err
    assert not run.exists()
