"""Parameter and FLOP counts against the closed forms of the papers and known model sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from colonnade.analysis.published import TABLE1, narayanan_flops, narayanan_params
from colonnade.config.load import load_config
from colonnade.models.counts import LayerShape, step_flops, total_params

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("row", TABLE1, ids=lambda r: f"{r.params_b}B")
def test_table1_flops_equal_narayanan_eq3(row) -> None:
    m = LayerShape.of(row.model())
    for recompute, full in (("full", True), ("none", False)):
        ours = step_flops(m, 2048, row.batch, recompute)
        paper = narayanan_flops(row.batch, 2048, row.layers, row.hidden, 51200, full)
        assert ours == pytest.approx(paper, rel=1e-12)


@pytest.mark.parametrize("row", TABLE1, ids=lambda r: f"{r.params_b}B")
def test_table1_params(row) -> None:
    """Ours = Narayanan's P plus the final LayerNorm (2h); both round to the published size."""
    m = LayerShape.of(row.model())
    paper = narayanan_params(row.layers, row.hidden, 51200, 2048)
    assert total_params(m) - paper == pytest.approx(2 * row.hidden, abs=1e-3 * row.hidden)
    assert total_params(m) / 1e9 == pytest.approx(row.params_b, rel=0.04)


@pytest.mark.parametrize(("preset", "expected"), [
    ("llama2-7b", 6_738_415_616), ("llama2-70b", 68_976_648_192)])
def test_llama_params_match_the_released_checkpoints(preset: str, expected: int) -> None:
    m = LayerShape.of(load_config(f"{CONFIGS}/{preset}.toml").model)
    assert total_params(m) == expected


def test_gpt3_presets_sizes() -> None:
    small = LayerShape.of(load_config(f"{CONFIGS}/gpt3-1.3b.toml").model)
    big = LayerShape.of(load_config(f"{CONFIGS}/gpt3-175b.toml").model)
    assert total_params(small) / 1e9 == pytest.approx(1.3, rel=0.03)
    assert total_params(big) / 1e9 == pytest.approx(175, rel=0.01)


def test_llama_flops_count_swiglu_and_gqa() -> None:
    """2 x matrices + 4sh per token forward: 70B with GQA (8 kv heads of 128)."""
    m = LayerShape.of(load_config(f"{CONFIGS}/llama2-70b.toml").model)
    h, f, kv = 8192, 28672, 1024
    per_token_fwd = 80 * (2 * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * 4096 * h) + 2 * h * 32000
    assert step_flops(m, 4096, 1, "none") == pytest.approx(3 * 4096 * per_token_fwd, rel=1e-12)
