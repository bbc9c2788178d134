"""benchmarks/peer_table.py --repeat N, no training run: every benchmark runs N times, each run
writes its own JSON (``<bench>_<workload>.run<k>.json``), and the table reads one row per layout
whose ratio and quartiles are taken over the rounds of all runs together (each run's own median
listed beside it), tokens/s the median over runs."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest

from tests.bench_import import load_benchmark


def _bench(name: str) -> ModuleType:
    return load_benchmark(f"{name}.py", f"bench_{name}")


def _row(layout: str, rounds: list[float], cpu: list[float], ours: float,
         peer: float, peer_name: str = "torch DDP") -> dict[str, Any]:
    return {"layout": layout, "colonnade": ours, "peer": peer_name, "peer_tokens_per_s": peer,
            "ratio": statistics.median(rounds), "ratio_q1": min(rounds),
            "ratio_q3": max(rounds), "ratio_rounds": rounds,
            "ratio_cpu": statistics.median(cpu), "ratio_cpu_rounds": cpu}


def test_pooled_row_takes_every_round_of_every_run() -> None:
    ratios = _bench("ratios")
    runs = [_row("dp2", [0.97, 0.98, 0.99], [1.0, 1.0, 1.0], 100.0, 101.0),
            _row("dp2", [1.01, 1.02, 1.03, 1.04, 1.05], [1.1] * 5, 110.0, 105.0),
            _row("dp2", [1.00], [0.9], 120.0, 130.0, peer_name="DeepSpeed ZeRO-0")]
    row = ratios.pooled_row(runs)
    every = [0.97, 0.98, 0.99, 1.01, 1.02, 1.03, 1.04, 1.05, 1.00]
    q1, med, q3 = statistics.quantiles(every, n=4, method="inclusive")
    assert row["ratio"] == pytest.approx(med) == pytest.approx(1.01)  # not 1.00, the runs' median
    assert (row["ratio_q1"], row["ratio_q3"]) == (pytest.approx(q1), pytest.approx(q3))
    assert row["run_ratios"] == [0.98, 1.03, 1.00]
    assert row["ratio_cpu"] == pytest.approx(1.1)  # 9 rounds: 3 x 1.0, 5 x 1.1, 1 x 0.9
    assert (row["colonnade"], row["peer_tokens_per_s"]) == (110.0, 105.0)
    assert row["peer"] == "torch DDP"  # the fastest peer of most runs
    # a run written before rows kept their rounds counts as one round, its median
    old = {k: v for k, v in runs[0].items() if not k.endswith("_rounds")}
    assert ratios.pooled_row([old, runs[2]])["ratio_rounds"] == [0.98, 1.00]
    no_cpu = {k: v for k, v in old.items() if k != "ratio_cpu"}
    assert ratios.pooled_row([no_cpu])["ratio_cpu"] is None


def test_repeat_runs_every_benchmark_n_times_and_the_table_pools_them(tmp_path: Path) -> None:
    pt = _bench("peer_table")
    rounds = {1: [0.98, 0.99, 1.00], 2: [1.02, 1.03, 1.04]}
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        path = Path(cmd[cmd.index("--json") + 1])
        k = 1 if path.name.endswith(".run1.json") else 2
        bench = Path(cmd[1]).stem
        layout = {"data_parallel": "dp2", "pipeline": "pp2 1F1B"}[bench]
        path.write_text(json.dumps({"rows": [_row(layout, rounds[k], rounds[k], 100.0 * k,
                                                  100.0)]}))
        return subprocess.CompletedProcess(cmd, 0)

    with mock.patch.object(pt.subprocess, "run", side_effect=fake_run):
        assert pt.main(["--only", "data_parallel,pipeline", "--repeat", "2",
                        "--results-dir", str(tmp_path)]) == 0
    # the whole list once, then again: a benchmark's runs are minutes apart
    assert [(Path(c[1]).stem, Path(c[c.index("--json") + 1]).name) for c in calls] == [
        ("data_parallel", "data_parallel_gpt2-tiny.run1.json"),
        ("pipeline", "pipeline_gpt2-tiny.run1.json"),
        ("data_parallel", "data_parallel_gpt2-tiny.run2.json"),
        ("pipeline", "pipeline_gpt2-tiny.run2.json")]
    pooled = json.loads((tmp_path / "pipeline_gpt2-tiny.json").read_text())
    assert pooled["run_files"] == ["pipeline_gpt2-tiny.run1.json", "pipeline_gpt2-tiny.run2.json"]
    (row,) = pooled["rows"]
    assert row["ratio"] == pytest.approx(1.01)  # the median of the six rounds
    assert row["run_ratios"] == [0.99, 1.03]
    table = (tmp_path / "peer_table.md").read_text()
    assert "| dp2 | 150 | torch DDP 100 | 1.01 [0.99, 1.03] (runs 0.99, 1.03) | 1.01 |" in table
    # the table rebuilt from the JSON alone reads the pooled rows again
    assert pt.main(["--from-json", "--results-dir", str(tmp_path)]) == 0
    assert (tmp_path / "peer_table.md").read_text() == table
    with pytest.raises(SystemExit, match="--repeat must be at least 1"):
        pt.main(["--repeat", "0", "--results-dir", str(tmp_path)])
