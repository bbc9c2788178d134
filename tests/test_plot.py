"""`colonnade plot` (issue 14, item 12): the numbers it reads from metrics.jsonl, and the PNG."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest

from colonnade.cli import main
from colonnade.config.load import ConfigError
from colonnade.plot import plot_runs, read_run, run_labels


def _run(root: Path, name: str, scale: float) -> Path:
    """A run dir whose metrics.jsonl looks like training's (step-0 validation record, a
    re-logged step after a resume, a non-finite perplexity)."""
    run = root / name
    run.mkdir(parents=True)
    records = [{"step": 0, "valid_loss": 5.0 * scale, "valid_ppl": math.exp(5.0 * scale),
                "tokens": 0}]
    for step in range(1, 41):
        rec = {"step": step, "loss": scale * 5.0 / step ** 0.5, "lr": 1e-3 * min(1, step / 5),
               "tokens_per_s": 1000.0 + step, "tokens": 32 * step}
        if step % 10 == 0:
            rec["valid_loss"] = scale * 5.5 / step ** 0.5
            rec["valid_ppl"] = math.exp(rec["valid_loss"])
        records.append(rec)
    records.append({"step": 40, "loss": 0.123, "lr": 1e-3, "tokens_per_s": 7.0,
                    "valid_ppl": math.inf})  # the last record of a step wins; inf left out
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_read_run_returns_the_logged_numbers(tmp_path: Path) -> None:
    data = read_run(_run(tmp_path, "a", 1.0))
    steps, loss = data["loss"]
    assert steps == list(range(1, 41))
    assert loss[0] == 5.0 and loss[3] == pytest.approx(2.5) and loss[-1] == 0.123
    assert data["valid_loss"] == ([0, 10, 20, 30, 40],
                                  [5.0, *(5.5 / s ** 0.5 for s in (10, 20, 30, 40))])
    ppl_steps, ppl = data["valid_ppl"]
    assert ppl_steps == [0, 10, 20, 30, 40] and ppl[1] == pytest.approx(math.exp(5.5 / 10**0.5))
    assert data["tokens_per_s"][1][:2] == [1001.0, 1002.0] and data["tokens_per_s"][1][-1] == 7.0
    assert data["lr"][1][:6] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 1e-3])
    assert read_run(tmp_path / "a" / "metrics.jsonl") == data  # the file itself works too


def test_plot_writes_a_png_of_the_overlaid_runs(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _run(tmp_path, "baseline", 1.0), _run(tmp_path, "bigger", 0.8)
    out = plot_runs([a, b], tmp_path / "out" / "cmp.png")
    assert out.is_file() and _png_size(out) == (1200, 800)
    assert out.stat().st_size > 20_000  # four panels of curves, not an empty canvas
    assert run_labels([a, b]) == ["baseline", "bigger"]
    assert main(["plot", str(a), str(b), "--out", str(tmp_path / "cli.png")]) == 0
    assert f"wrote {tmp_path / 'cli.png'}" in capsys.readouterr().out
    assert _png_size(tmp_path / "cli.png") == (1200, 800)


def test_plot_errors_name_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl missing" in err and "logging.dir" in err
    assert not (tmp_path / "x.png").exists()
    run = _run(tmp_path, "a", 1.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[plot\]'"):
        plot_runs([run], tmp_path / "y.png")
