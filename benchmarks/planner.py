"""Planner against the published figures: Narayanan et al. 2021 Table 1 and ZeRO's memory.

    .venv/bin/python benchmarks/planner.py [--json PATH] [--fit]

Prints, per Table 1 row, the published TFLOP/s per GPU and the planner's prediction for the
published layout (micro-batch and vp chosen by the planner, they are not published), then the
layout the planner ranks first (with the 2021 system's features, and with all of colonnade's)
and why it is faster; then the ZeRO example; then H100: the GEMM efficiency curve against size
and the predicted tokens/s per GPU of published H100 BF16 runs (llm-foundry's MPT table,
https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md), the
rows the curve was fitted on and the held-out ones, before (the A100's one constant, the old
H100 preset) and after (the fitted curve); then the held-out report
(:mod:`colonnade.analysis.holdout`): every published throughput the planner knows, per source
and row, predicted against published with the error, the fitted-on rows marked, the held-out
worst per device, and the memory of every published configuration against its device (with
the measured peaks where published).  --fit re-runs the fits (A100 efficiency, a knee scan on
Table 1, the H100 curve).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colonnade.analysis.efficiency import layer_gemm_s, layer_gemms
from colonnade.analysis.fit import (
    MEGATRON_2021,
    fit_efficiency,
    fit_gemm_curve,
    h100_error,
    predict_row,
    relative_errors,
)
from colonnade.analysis.hardware import A100_EFFICIENCY, PRESETS
from colonnade.analysis.holdout import report
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import zero_paper_bytes
from colonnade.analysis.published import HELD_OUT_H100, MPT_H100_FIT, TABLE1, ZERO_EXAMPLE
from colonnade.analysis.search import Constraints, explain, plan
from colonnade.config.sections import ModelConfig


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


MPT_SOURCE = "https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md"


def gemm_curve() -> dict[str, list[float]]:
    """Achieved fraction of peak of one layer's GEMMs (micro-batch 4 x 2048 tokens, tp 1)
    against the hidden size, per preset."""
    hiddens = [512, 1024, 2048, 4096, 8192, 16384]
    print("\nGEMM efficiency of one gpt2 layer's forward (mb 4, s 2048, tp 1), fraction of peak:")
    print(f"{'hidden':>10} " + " ".join(f"{h:>7}" for h in hiddens))
    out: dict[str, list[float]] = {}
    for name in ("a100-80gb", "h100-sxm", "h200"):
        c = PRESETS[name]
        effs = []
        for h in hiddens:
            w = Workload(model=ModelConfig(arch="gpt2", num_layers=1, hidden_size=h,
                                           num_heads=max(1, h // 128), vocab_size=50304,
                                           max_seq_len=2048), seq_len=2048, global_batch=4)
            mats, core = layer_gemms(w, Layout(micro_batch=4))
            flops = sum(f for f, _ in mats) + core[0]
            effs.append(flops / sum(layer_gemm_s(w, Layout(micro_batch=4), c))
                        / c.peak_flops_per_s("bf16"))
        out[name] = effs
        print(f"{name:>10} " + " ".join(f"{e:>7.3f}" for e in effs))
    return out


def h100_rows() -> list[dict[str, Any]]:
    """Published H100 BF16 throughputs: the fitted curve against the old one constant."""
    after = PRESETS["h100-sxm"]
    before = dataclasses.replace(after, efficiency=A100_EFFICIENCY, gemm_knee_balance=0.0)
    print(f"\nH100 SXM BF16 tokens/s per GPU, llm-foundry MPT table ({MPT_SOURCE}); before = "
          f"the A100 constant {A100_EFFICIENCY} (the old preset), after = efficiency "
          f"{after.efficiency:g} with a GEMM knee of {after.gemm_knee:.0f} FLOP/B")
    head = (f"{'row':<24} {'set':<8} {'hidden':>6} {'paper':>7} {'before':>7} {'err':>7} "
            f"{'after':>7} {'err':>7}")
    print(head)
    print("-" * len(head))
    out = []
    for kind, rows in (("fit", MPT_H100_FIT), ("held-out", HELD_OUT_H100)):
        for row in rows:
            eb, ea = h100_error(row, before), h100_error(row, after)
            pub = row.tokens_per_s_per_gpu
            print(f"{row.label():<24} {kind:<8} {row.workload().model.hidden_size:>6} "
                  f"{pub:>7.0f} {pub * (1 + eb):>7.0f} {eb:>+7.1%} {pub * (1 + ea):>7.0f} "
                  f"{ea:>+7.1%}")
            out.append({"row": row.label(), "set": kind, "published": pub,
                        "error_before": eb, "error_after": ea, "source": MPT_SOURCE})
    for kind in ("fit", "held-out"):
        sel = [r for r in out if r["set"] == kind]
        print(f"{kind}: max |error| before {max(abs(r['error_before']) for r in sel):.1%}, "
              f"after {max(abs(r['error_after']) for r in sel):.1%}")
    return out


def held_out() -> dict[str, Any]:
    """The held-out report (colonnade.analysis.holdout, as `colonnade plan --validate`)."""
    lines, records = report()
    print("\nHeld-out report")
    print("\n".join(lines))
    return records


def refit() -> dict[str, Any]:
    """Re-run the fits: the A100 constant, a knee scan on Table 1, the H100 curve."""
    a100 = PRESETS["a100-80gb"]
    eff = fit_efficiency(a100)
    print(f"fitted A100 efficiency (minimax over Table 1): {eff:.4f}")
    scan = {}
    for knee in (0.0, 0.1, 0.25, 0.5, 1.0):
        c = dataclasses.replace(a100, gemm_knee_balance=knee)
        c = dataclasses.replace(c, efficiency=fit_efficiency(c, lo=0.6, hi=1.2))
        scan[knee] = max(abs(e) for e in relative_errors(c))
        print(f"  Table 1 with knee {knee:g} x balance: efficiency {c.efficiency:.3f}, "
              f"max |error| {scan[knee]:.1%}")
    h_eff, h_knee = fit_gemm_curve(PRESETS["h100-sxm"])
    print(f"fitted H100 curve (minimax over {len(MPT_H100_FIT)} MPT rows): efficiency "
          f"{h_eff:.4f}, knee {h_knee:.3f} x balance")
    return {"fitted_efficiency": eff, "table1_knee_scan": scan,
            "h100_curve": {"efficiency": h_eff, "gemm_knee_balance": h_knee}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--fit", action="store_true", help="re-run the efficiency fit")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if args.fit:
        result.update(refit())
    result["table1_megatron2021"] = table1(MEGATRON_2021, "2021 features (full recompute, "
                                           "no sp, no ZeRO)")
    result["table1_all_features"] = table1({}, "all colonnade features")
    result["zero"] = zero()
    result["gemm_curve"] = gemm_curve()
    result["h100_published"] = h100_rows()
    result["held_out"] = held_out()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
