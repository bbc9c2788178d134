"""Planner against the published figures: Narayanan et al. 2021 Table 1 and ZeRO's memory.

    .venv/bin/python benchmarks/planner.py [--json PATH] [--fit]

Prints, per Table 1 row, the published TFLOP/s per GPU and the planner's prediction for the
published layout (micro-batch and vp chosen by the planner, they are not published), then the
layout the planner ranks first (with the 2021 system's features, and with all of colonnade's)
and why it is faster; then the ZeRO example.  --fit re-runs the efficiency fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colonnade.planner.fit import MEGATRON_2021, fit_efficiency, predict_row
from colonnade.planner.hardware import PRESETS
from colonnade.planner.memory import zero_paper_bytes
from colonnade.planner.published import TABLE1, ZERO_EXAMPLE
from colonnade.planner.search import Constraints, explain, plan


def table1(features: dict[str, Any], label: str) -> list[dict[str, Any]]:
    """Reproduce every row; print and return the records."""
    a100 = PRESETS["a100-80gb"]
    print(f"\nNarayanan et al. 2021 Table 1 on a100-80gb (efficiency {a100.efficiency}); "
          f"ranked-first search: {label}")
    head = (f"{'params':>7} {'tp':>2} {'pp':>2} {'GPUs':>5} {'B':>5} {'paper':>6} {'pred':>6} "
            f"{'err':>6} {'mb':>3} {'vp':>2} {'GiB':>5} | {'ranked first':<52} {'gain':>6}")
    print(head)
    print("-" * len(head))
    out = []
    for row in TABLE1:
        ref = predict_row(row, a100)
        best = plan(row.workload(), a100, row.gpus, Constraints(**features)).best
        gain = ref.step_s / best.step_s - 1
        err = ref.tflops_per_device / row.tflops - 1
        print(f"{row.params_b:>7} {row.tp:>2} {row.pp:>2} {row.gpus:>5} {row.batch:>5} "
              f"{row.tflops:>6.0f} {ref.tflops_per_device:>6.1f} {err:>+6.1%} "
              f"{ref.layout.micro_batch:>3} {ref.layout.vp:>2} "
              f"{ref.memory.total / 2**30:>5.1f} | {best.layout.short():<52} {gain:>+6.1%}")
        rec = {"params_b": row.params_b, "published_tflops": row.tflops,
               "predicted_tflops": ref.tflops_per_device, "relative_error": err,
               "published_layout": ref.as_dict(), "ranked_first": best.as_dict(),
               "gain": gain}
        if gain > 0.05:
            rec["reason"] = explain(best, ref)
        out.append(rec)
    worst = max(abs(r["relative_error"]) for r in out)
    print(f"max |error| {worst:.1%} (target 10%)")
    for rec in out:
        if "reason" in rec:
            print(f"  {rec['params_b']}B: {rec['reason']}")
    return out


def zero() -> dict[str, float]:
    """ZeRO example: 7.5B parameters, Nd = 64."""
    psi, nd = ZERO_EXAMPLE["params"], ZERO_EXAMPLE["dp"]
    names = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
    print(f"\nZeRO memory per device, {psi / 1e9:g}B params, Nd={nd}:")
    got = {}
    for stage, paper in ZERO_EXAMPLE["gb"].items():
        gb = zero_paper_bytes(psi, nd, stage) / 1e9
        got[names[stage]] = gb
        print(f"  {names[stage]:<9} paper {paper:>6.1f} GB  planner {gb:>7.2f} GB")
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--fit", action="store_true", help="re-run the efficiency fit")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if args.fit:
        eff = fit_efficiency(PRESETS["a100-80gb"])
        print(f"fitted A100 efficiency (minimax over Table 1): {eff:.4f}")
        result["fitted_efficiency"] = eff
    result["table1_megatron2021"] = table1(MEGATRON_2021, "2021 features (full recompute, "
                                           "no sp, no ZeRO)")
    result["table1_all_features"] = table1({}, "all colonnade features")
    result["zero"] = zero()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
