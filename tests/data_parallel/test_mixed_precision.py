"""Mixed precision under data parallelism: the fp16 dynamic loss scale and bf16 tracking fp32.

fp16: one rank finds an inf (or NaN) in the part of the gradient it owns after the sync (so no
other rank can see it in its own numbers); every rank must skip that step (parameters and
Adam step count unchanged) and halve the scale; after ``loss_scale_window`` clean steps it
doubles again.

bf16 vs fp32, 50 steps of the tiny model on dp=2 with ZeRO-1. Tolerance, justified: bf16 keeps
8 significant bits, so each rounding of an activation or weight is off by up to 2^-9 ~ 0.2%
relative. The fp32 master weights and main gradients keep the *update* exact to fp32, so the
trajectories differ by the forward/backward rounding only, not by a drift that grows with the
step count: the loss difference stays a few rounding units of the O(1) logits, ~2^-8 x 2 ~ 1e-2
absolute on a loss of ~4.6 at worst. We accept |loss_bf16 - loss_fp32| <= 0.03 at every step
and a mean difference <= 0.01 over the last 10 steps (measured: 0.009 max, 0.002 late mean),
and require the fp32 loss to fall by more than 1.0 over the 50 steps (measured: 4.66 -> 1.22),
30x the tolerance, so following the curve means something.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from colonnade.config.sections import Config
from tests.data_parallel.common import make_batches, mean_losses, rank_train, tiny_config


def _train_inject(config: Config, step_batches: list[Any], inject: dict[str, Any]
                  ) -> dict[str, Any]:
    out = rank_train(config, step_batches, inject)
    out.pop("params")
    return out


@pytest.mark.parametrize("zero,value", [(True, float("inf")), (False, float("nan"))],
                         ids=["zero1-inf", "ddp-nan"])
def test_fp16_overflow_on_one_rank_skips_everywhere(run_ranks: Callable[..., list[Any]],
                                                    zero: bool, value: float) -> None:
    """Step 1: rank 1 alone sees a non-finite gradient; all skip; scale 1024 -> 512 -> 1024."""
    config = tiny_config(dp=2, zero=zero, precision="fp16", steps=4, microbatches=1,
                         loss_scale=1024.0, scale_window=2, clip=1.0)
    batches = make_batches(config)
    results = run_ranks(2, _train_inject, config, batches, {"step": 1, "rank": 1,
                                                           "value": value})
    for res in results:
        infos = res["infos"]
        assert [i["skipped"] for i in infos] == [0.0, 1.0, 0.0, 0.0], f"rank {res['rank']}"
        # scale used by each step's backward: clean, overflow (halve), clean, clean (2 = window)
        assert [i["loss_scale"] for i in infos] == [1024.0, 1024.0, 512.0, 512.0]
        assert res["adam_steps"] == 3, "the skipped step must not advance Adam"
        assert res["final_scale"] == 1024.0, "two clean steps after the backoff double it"


def test_fp16_skip_leaves_parameters_unchanged(run_ranks: Callable[..., list[Any]]) -> None:
    """A run whose only step overflows on rank 0 keeps the initial parameters bit for bit."""
    config = tiny_config(dp=2, zero=True, precision="fp16", steps=1, microbatches=1,
                         loss_scale=1024.0)
    batches = make_batches(config)
    results = run_ranks(2, _params_after_skip, config, batches)
    for res in results:
        assert res["unchanged"], f"rank {res['rank']} changed parameters on a skipped step"
        assert res["scale"] == 512.0


def _params_after_skip(config: Config, step_batches: list[Any]) -> dict[str, Any]:
    from colonnade.models.build import build_reference

    out = rank_train(config, step_batches, {"step": 0, "rank": 0, "value": float("inf")})
    init = {p.sharding.key: p.detach().double()  # type: ignore[attr-defined]
            for p in build_reference(config).parameters()}
    unchanged = all(bool((out["params"][k] == v).all()) for k, v in init.items())
    return {"rank": out["rank"], "unchanged": unchanged, "scale": out["final_scale"]}


def _bf16_vs_fp32(config_bf16: Config, config_fp32: Config, step_batches: list[Any]
                  ) -> dict[str, Any]:
    low = rank_train(config_bf16, step_batches)
    high = rank_train(config_fp32, step_batches)
    return {"bf16": low["losses"], "fp32": high["losses"], "rank": low["rank"]}


def test_bf16_tracks_fp32(run_ranks: Callable[..., list[Any]]) -> None:
    """50 steps, dp=2, ZeRO-1: bf16 params + fp32 masters/grads follow the fp32 loss curve."""
    kw: dict[str, Any] = dict(dp=2, zero=True, steps=50, microbatches=1, clip=1.0, lr=3e-3)
    bf16, fp32 = tiny_config(precision="bf16", **kw), tiny_config(precision="fp32", **kw)
    batches = make_batches(fp32)
    batches = [batches[0]] * len(batches)  # one fixed batch: the loss must fall fast
    results = run_ranks(2, _bf16_vs_fp32, bf16, fp32, batches)
    low = mean_losses([{"losses": r["bf16"]} for r in results])
    high = mean_losses([{"losses": r["fp32"]} for r in results])
    diffs = [abs(a - b) for a, b in zip(low, high, strict=True)]
    assert high[0] - high[-1] > 1.0, f"fp32 loss barely moved: {high[0]:.3f} -> {high[-1]:.3f}"
    assert max(diffs) <= 0.03, f"bf16 left the fp32 curve by {max(diffs):.4f}"
    assert sum(diffs[-10:]) / 10 <= 0.01, f"late mean difference {sum(diffs[-10:]) / 10:.4f}"


TOLERANCE_STATES = 0.05
"""|loss - loss with fp32 states| at every step with bf16 moments and masters."""


def _states_runs(configs: list[Config], step_batches: list[Any]) -> dict[str, Any]:
    runs = [rank_train(c, step_batches) for c in configs]
    return {"losses": [r["losses"] for r in runs], "bytes": [r["state_bytes"] for r in runs]}


def test_bf16_states_track_fp32_states(run_ranks: Callable[..., list[Any]]) -> None:
    """bf16 model, 10 steps at dp2 on one fixed batch: bf16 moments and masters at ZeRO-3
    (the bf16 parameter shard is the master, updated through fp32 chunks) follow fp32
    states at ZeRO-1. Rounding the moments changes each update by 2^-9 relative; rounding
    the masters loses the part of each update below half a bf16 ulp of the weight, which
    shifts the curve by a few bf16 rounding units of the O(1) logits: TOLERANCE_STATES
    (measured 0.016; bf16 moments alone with fp32 masters: 0.0009 over 12 steps), while the
    loss falls by > 1.0 (measured 4.63 -> 3.18)."""
    kw: dict[str, Any] = dict(dp=2, steps=10, microbatches=1, clip=1.0, lr=3e-3,
                              precision="bf16")
    base = tiny_config(zero=True, **kw)
    bf16 = dataclasses.replace(base.optim, state_dtype="bf16", master_dtype="bf16")
    configs = [base, dataclasses.replace(tiny_config(zero_stage=3, **kw), optim=bf16)]
    batches = make_batches(base)
    batches = [batches[0]] * len(batches)  # one fixed batch: the loss must fall fast
    results = run_ranks(2, _states_runs, configs, batches)
    for r in results:  # per owned element: 12 bytes (fp32 master, m, v) against 4 (bf16 m, v)
        assert r["bytes"][0] == 3 * r["bytes"][1]
    fp32, bf16_curve = (mean_losses([{"losses": r["losses"][k]} for r in results])
                        for k in range(2))
    assert fp32[0] - fp32[-1] > 1.0, f"loss barely moved: {fp32[0]:.3f} -> {fp32[-1]:.3f}"
    worst = max(abs(a - b) for a, b in zip(bf16_curve, fp32, strict=True))
    assert worst <= TOLERANCE_STATES, f"bf16 states left fp32 states' curve by {worst:.4f}"
