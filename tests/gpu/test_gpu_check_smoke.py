"""benchmarks/gpu_check.py --cpu-smoke (not gpu-marked: CI runs it): every stage runs at tiny
sizes on the CPU, the CUDA-only one says it does not apply, and the JSON holds the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGES = ["environment", "train_demo", "train_1p3b", "train_llama8b_cut", "plain_pytorch",
          "torchtitan", "fp8", "cuda_graphs", "compile", "async_checkpoint", "sdpa_kernel",
          "generate", "gpu_tests"]
FLAGGED = ("fp8", "cuda_graphs")
"""Stages of flags other parts of issue 39 add: "not available" until they exist."""


def test_gpu_check_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a generous budget: this shared CI machine runs other tests alongside (~40 s when idle,
    # plus the compile stage's first compilation: 75 s measured on a loaded machine, seconds
    # once inductor's on-disk cache holds it)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"),
                           "--cpu-smoke", "--budget-s", "360", "--json", str(out),
                           "--workdir", str(tmp_path / "work")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=420,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "cpu-smoke" and result["cluster"] == "cpu-local"
    assert 0 < result["total_s"] < result["budget_s"] == 360
    stages = {r["stage"]: r for r in result["stages"]}
    assert list(stages) == STAGES
    status = {n: r["status"] for n, r in stages.items()}
    assert status.pop("fp8") in ("ok", "not available")
    assert status.pop("cuda_graphs") in ("n/a", "not available")  # needs CUDA once it exists
    assert status == {**{n: "ok" for n in STAGES if n not in FLAGGED}, "gpu_tests": "n/a",
                      "torchtitan": "not available"}
    assert stages["gpu_tests"]["note"].startswith("not applicable on CPU")
    assert all(r["seconds"] >= 0 for r in result["stages"])
    assert "triton" in stages["torchtitan"]["note"] or "torchtitan" in stages["torchtitan"]["note"]
    for name, steps in (("train_demo", 3), ("train_1p3b", 2), ("train_llama8b_cut", 2)):
        meas, pred = stages[name]["measured"], stages[name]["predicted"]
        assert meas["steps"] == steps and meas["timed_steps"] == steps - 1
        assert meas["tokens_per_s"] > 0 and meas["tflops"] > 0 and meas["peak_mem_gib"] > 0
        assert pred["tokens_per_s"] > 0 and pred["tflops"] > 0 and pred["peak_mem_gib"] > 0
    assert stages["train_demo"]["measured"]["last_loss"] < 8.0  # ln(2048) = 7.6 at the start
    assert stages["sdpa_kernel"]["measured"]["backends"] == ["flash"]
    plain = stages["plain_pytorch"]["measured"]  # the same tiny Llama, vocab 2048
    assert plain["tokens_per_s"] > 0 and abs(plain["first_loss"] - 7.62) < 0.3
    assert plain["params"] == stages["plain_pytorch"]["shape"]["layers"] * (
        2 * 32 + 32 * (32 + 2 * 16) + 32 * 32 + 3 * 32 * 64) + 2 * 2048 * 32 + 32
    ckpt = stages["async_checkpoint"]["measured"]
    # 4 bytes x (param + 2 moments) x params at least; the stalls are parts of the saves
    assert ckpt["bytes"] > 12 * ckpt["params"] > 0
    assert 0 < max(ckpt["stall_s"], ckpt["stall_overlap_s"]) <= ckpt["two_saves_total_s"]
    assert ckpt["saved"] == ["step_00000002", "step_00000003"]
    comp = stages["compile"]["measured"]  # training.compile off vs on, same weights and data
    assert comp["rounds"] == 3 and comp["layers"] == 2
    assert comp["eager_step_s"] > 0 and comp["compiled_step_s"] > 0
    assert comp["speedup_median_ratio"] > 0 and comp["first_step_compiled_s"] > 0
    assert abs(comp["first_loss_compiled"] - comp["first_loss_eager"]) < 1e-4  # fp32
    gen = stages["generate"]["measured"]
    assert gen["sample"].startswith("def ") and gen["chars"] > len("def ")
