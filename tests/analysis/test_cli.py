"""`colonnade plan` end to end: table, JSON, plot, exit status of bad input, calibration."""

from __future__ import annotations

import argparse
import json

from colonnade.analysis.calibrate import (
    TINY_LAYOUTS,
    calibrated_cluster,
    measure_gloo,
    measure_local,
    predict_tiny,
    tiny_workload,
)
from colonnade.analysis.cli import add_plan_parser, main, run_plan
from colonnade.analysis.hardware import PRESETS
from colonnade.analysis.report import format_table
from colonnade.analysis.search import plan
from colonnade.parallel.pool import RankPools


def test_plan_writes_table_json_and_plot(tmp_path, capsys) -> None:
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["--model", "llama2-7b", "--gpus", "16", "--top", "3", "--tp", "2",
               "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "best: --parallel.tp=2" in printed
    data = json.loads(out_json.read_text())
    assert data["gpus"] == 16 and len(data["ranked"]) == 3
    top = data["ranked"][0]
    assert top["layout"]["tp"] == 2 and top["fits"]
    assert top["time_s"]["total"] > 0 and top["memory_gib"]["total"] < 78
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_subparser_wiring_and_bad_input(capsys) -> None:
    parser = argparse.ArgumentParser(prog="colonnade")
    sub = parser.add_subparsers(dest="command")
    add_plan_parser(sub)
    args = parser.parse_args(["plan", "--model", "gpt3-175b", "--gpus", "8"])
    assert run_plan(args) == 2
    assert "fits on no layout" in capsys.readouterr().err
    args = parser.parse_args(["plan", "--model", "nope", "--gpus", "8"])
    assert run_plan(args) == 2
    assert "neither a file nor a preset" in capsys.readouterr().err
    args = parser.parse_args(["plan", "--model", "llama2-7b", "--gpus", "37"])  # pp > layers
    assert run_plan(args) == 2
    assert "cannot be factored" in capsys.readouterr().err


def test_dimension_overrides_and_plain_table() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_plan_parser(sub)
    from colonnade.analysis.cli import build

    args = parser.parse_args(["plan", "--model", "llama2-7b", "--layers", "8", "--hidden",
                              "1024", "--heads", "8", "--ffn", "2816", "--global-batch", "64",
                              "--seq-len", "1024", "--gpus", "8", "--sp", "off"])
    w, cons = build(args)
    assert (w.model.num_layers, w.model.hidden_size, w.seq_len, w.global_batch) == (
        8, 1024, 1024, 64)
    result = plan(w, PRESETS["a100-80gb"], 8, cons)
    text = format_table(result, 4)
    assert text.count("\n") == 2 + 4 + 1 and "tokens/s" in text
    assert not any(e.layout.sp for e in result.ranked)


def test_calibration_measures_and_predicts(rank_pools: RankPools) -> None:
    """Measured on the session's warm 2-rank pool (``measure_gloo``'s ``pool``), not on two
    processes started for it."""
    w = tiny_workload()
    local = measure_local(w.model, tokens=512)
    assert local["matmul_gflops"] > 0.5 and local["memory_gbps"] > 0.5
    gloo = measure_gloo(rank_pools.get(2))
    assert 0 < gloo["latency_us"] < 50_000 and gloo["gbps"] > 0.01
    cluster = calibrated_cluster(local, gloo)
    preds = predict_tiny(cluster, w)
    assert len(preds) == len(TINY_LAYOUTS) >= 6
    assert all(0 < e.step_s < 10 for e in preds)
