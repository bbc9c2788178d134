"""Measured bytes saved for backward per layer against the documented analytic model.

Every (arch, dtype, dropout, recompute) case must be within 10% of
:func:`colonnade.analysis.activations.layer_bytes` (in practice the two agree to the byte), on one
rank and on tp = 2 ranks with and without sp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.analysis.activations import (
    ActivationShape,
    chunk_layer_bytes,
    layer_bytes,
    paper_layer_bytes,
)
from colonnade.analysis.measure import (
    PeakTensorBytes,
    SavedTensorMeter,
    measure_layers,
    relative_error,
)
from colonnade.models.build import build_chunks
from colonnade.models.counts import ArchFacts
from colonnade.models.recompute import RecomputePlan, install
from tests.recompute.harness import rank_groups, tiny_config

TOL = 0.10
PLANS = [RecomputePlan(), RecomputePlan("selective"), RecomputePlan("full"),
         RecomputePlan("full", "uniform", 2), RecomputePlan("full", "block", 1)]


def measure_cases(arch: str, tp: int, sp: bool, dtype: torch.dtype,
                  dropouts: tuple[float, ...] = (0.0, 0.1)) -> list[dict[str, Any]]:
    """Rank body: measured and predicted bytes per layer for every plan and dropout setting."""
    out = []
    for dropout in dropouts:
        config = tiny_config(arch, tp=tp, sp=sp, layers=4, dropout=dropout, seq=32)
        groups = rank_groups(config)
        (chunk,) = build_chunks(config, groups, dtype=dtype)
        tr, layers = config.training, config.model.num_layers
        shape = ActivationShape.from_model(config.model, tr.seq_len, tr.micro_batch_size,
                                           tp=tp, sp=sp, dtype=dtype)
        rows = tr.seq_len // tp if sp else tr.seq_len
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(rows, tr.micro_batch_size, config.model.hidden_size, generator=gen,
                        dtype=torch.float64).to(dtype)  # [s(/tp), b, h]
        for plan in PLANS:
            install([chunk], plan)
            got = measure_layers(chunk, x)
            want = chunk_layer_bytes(shape, plan, layers) / layers
            out.append({"case": f"{arch} tp{tp}{'+sp' if sp else ''} {dtype} p={dropout} "
                                f"{plan.mode}/{plan.method}/{plan.num_layers}",
                        "measured": got.mean, "predicted": want})
    return out


def _check(cases: list[dict[str, Any]]) -> None:
    for case in cases:
        err = relative_error(case["measured"], case["predicted"])
        assert err <= TOL, (f"{case['case']}: measured {case['measured']:.0f} B/layer vs "
                            f"predicted {case['predicted']:.0f} ({err:.1%})")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_single_rank_matches_formula(arch: str, dtype: torch.dtype) -> None:
    _check(measure_cases(arch, 1, False, dtype))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])
def test_tp2_matches_formula(run_ranks: Callable[..., list[Any]], sp: bool) -> None:
    for cases in run_ranks(2, measure_cases, "llama", 2, sp, torch.float64):
        _check(cases)


def test_recompute_modes_order_and_full_is_the_input() -> None:
    """none > selective > full, and full keeps exactly each layer's input E s b h."""
    cases = {c["case"].split()[-1]: c["measured"]
             for c in measure_cases("llama", 1, False, torch.float64, (0.1,))}
    assert cases["none/uniform/1"] > cases["selective/uniform/1"] > cases["full/uniform/1"]
    assert cases["full/uniform/1"] == 32 * 2 * 32 * 8  # s b h fp64
    assert cases["full/uniform/2"] == cases["full/uniform/1"] / 2


def test_paper_formulas() -> None:
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert paper_layer_bytes(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert paper_layer_bytes(s, b, h, a, tp=t) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert paper_layer_bytes(s, b, h, a, tp=t, sp=True) == pytest.approx(
        sbh * (34 / t + 5 * a * s / (h * t)))
    assert paper_layer_bytes(s, b, h, a, tp=t, sp=True, recompute="selective") == (
        pytest.approx(sbh * 34 / t))
    assert paper_layer_bytes(s, b, h, a, tp=t, recompute="full") == 2 * sbh
    assert paper_layer_bytes(s, b, h, a, elem=4, recompute="full") == 4 * sbh


def test_gpt2_formula_differs_from_paper_only_by_documented_terms() -> None:
    """bf16 gpt2 with dropout: the paper + LayerNorm stats, and the blockwise attention's
    fp32 log-sum-exp in place of the paper's 5 a s^2 b bytes of scores, masks, probabilities;
    with the paper's eager attention, only the LayerNorm stats."""
    s, b, h, a = 64, 2, 64, 4
    gpt2 = ArchFacts(mlp_matrices=2, norm_has_bias=True, positions="learned")
    shape = ActivationShape(seq=s, batch=b, hidden=h, heads=a, kv_heads=a, ffn=4 * h, elem=2,
                            facts=gpt2, hidden_dropout=True, attention_dropout=True)
    stats = 2 * 2 * 2 * s * b
    assert shape.kernel == "blockwise"
    extra = stats - 5 * a * s * s * b + 4 * a * s * b
    assert layer_bytes(shape) == paper_layer_bytes(s, b, h, a) + extra
    eager = dataclasses.replace(shape, attention="eager")
    assert layer_bytes(eager) == paper_layer_bytes(s, b, h, a) + stats
    assert layer_bytes(eager, "selective") == paper_layer_bytes(
        s, b, h, a, recompute="selective") + stats


def test_meter_counts_storages_once_and_skips_parameters() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    model = torch.nn.Module()
    model.w = w
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with SavedTensorMeter([model]) as meter:
        y = x @ w  # saves x and w
        z = (x[:2] * y[:2]).sum()  # saves views of x and y
    assert meter.total == x.numel() * 8 + y.numel() * 8, meter.records
    assert meter.outside == meter.total and meter.per_layer() == {}
    z.backward()


def test_peak_live_bytes_fall_with_recomputation() -> None:
    config = tiny_config("llama", layers=4, dropout=0.0, seq=64)
    (chunk,) = build_chunks(config, rank_groups(config), dtype=torch.float64)
    tokens = torch.randint(0, config.model.vocab_size, (2, 64))
    peaks = {}
    for plan in (RecomputePlan(), RecomputePlan("full")):
        install([chunk], plan)
        chunk.zero_grad(set_to_none=True)
        with PeakTensorBytes() as meter:
            chunk(tokens, tokens).backward()
        peaks[plan.mode] = meter.peak
        assert meter.current < meter.peak / 2, "freed tensors must leave the live count"
    s, b, h = 64, 2, 32
    saved = 4 * (layer_bytes(ActivationShape.from_model(config.model, s, b,
                                                        dtype=torch.float64))
                 - 8 * s * b * h)
    assert peaks["none"] - peaks["full"] > 0.5 * saved, peaks
