"""Context parallelism in `colonnade plan` and `colonnade train --dry-run` (issue 16).

No published context-parallel anchor exists in /work/shared/anchors/published.md (its rows
are Narayanan et al.'s GPT table at s = 2048), so the planner is checked on its own terms:
at a long sequence where no cp = 1 layout fits in memory, a search with --cp picks cp > 1.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from colonnade.analysis.cli import main as plan_main
from colonnade.analysis.cp_comm import cp_comm
from colonnade.analysis.hardware import get_cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import memory_per_device
from colonnade.analysis.search import Constraints, PlanError, cp_shape_ok, layouts, plan
from colonnade.cli import main
from colonnade.config import load_config, resolve
from colonnade.config.sections import ModelConfig
from tests.reliability.jobs import tiny_args, write_corpus
from tests.workflow.cli import hashes

LLAMA = ModelConfig(arch="llama", num_layers=16, hidden_size=2048, num_heads=16,
                    num_kv_heads=4, vocab_size=32000, max_seq_len=131072)


def test_planner_picks_cp_when_the_sequence_is_long_and_memory_tight() -> None:
    w = Workload(model=LLAMA, seq_len=131072, global_batch=8)
    cluster = get_cluster("h100")
    fixed = dict(recompute=("none", "selective"), zero=(0, 1))
    with pytest.raises(PlanError, match="fits on no layout"):
        plan(w, cluster, 8, Constraints(tp=1, pp=1, **fixed))  # type: ignore[arg-type]
    result = plan(w, cluster, 8, Constraints(tp=1, pp=1, cp=(1, 2, 4, 8),  # type: ignore[arg-type]
                                             cp_attention=("ring", "all_to_all"), **fixed))
    best = result.best.layout
    assert best.cp > 1 and best.world == 8
    assert all(e.layout.cp > 1 for e in result.ranked)  # nothing at cp 1 fits
    assert f"--parallel.cp={best.cp}" in best.overrides()
    one = memory_per_device(w, dataclasses.replace(best, cp=1, dp=best.dp * best.cp))
    assert one.total > cluster.memory_bytes >= result.best.memory.total


def test_cp_search_follows_the_validator_rules() -> None:
    w = Workload(model=dataclasses.replace(LLAMA, max_seq_len=4096), seq_len=4096,
                 global_batch=8)
    assert cp_shape_ok(w, 1, 8, "ring") and cp_shape_ok(w, 2, 8, "ring", sp=True)
    assert not cp_shape_ok(Workload(model=LLAMA, seq_len=4100, global_batch=8), 1, 4, "ring")
    assert cp_shape_ok(w, 1, 8, "all_to_all")  # 4 kv heads, cp 8: replicated
    assert cp_shape_ok(w, 2, 2, "all_to_all") and not cp_shape_ok(w, 1, 32, "all_to_all")
    dropout = dataclasses.replace(w, model=dataclasses.replace(LLAMA, attention_dropout=0.1))
    assert cp_shape_ok(dropout, 1, 2, "ring") and cp_shape_ok(dropout, 1, 2, "all_to_all")
    cons = Constraints(cp=(1, 2, 4), cp_attention=("ring", "all_to_all"), zero=(0,),
                       recompute=("none",))
    found = list(layouts(w, 8, get_cluster("h100"), cons))
    assert {(lay.cp, lay.cp_attention) for lay in found} == {
        (1, "ring"), (2, "ring"), (2, "all_to_all"), (4, "ring"), (4, "all_to_all")}
    assert all(lay.world == 8 for lay in found)


def test_hierarchical_cp_priced_and_searched() -> None:
    """cp 32 over 16 heads: all_to_all cannot split them, hierarchical can (its inner size
    divides the heads). Bytes per layer at cp 8 = a2a 2 x ring 4, s = 131072, b = 1, bf16,
    d = 128, 16 heads, 4 kv heads (s_l = 16384, h_kv = 2 after the all-to-all) by the
    module's formulas: all-to-all (a-1)/a b s_l d E (2 a_l + 2 a h_kv) = 83,886,080 each way;
    ring K = 2 b (a s_l) h_kv d E = 33,554,432, forward 3 K, backward 3 K + 4 K x 4/2."""
    w = Workload(model=LLAMA, seq_len=131072, global_batch=8)
    assert not cp_shape_ok(w, 1, 32, "all_to_all") and cp_shape_ok(w, 1, 32, "ring")
    assert cp_shape_ok(w, 1, 32, "hierarchical", a2a=4)
    assert not cp_shape_ok(w, 1, 32, "hierarchical", a2a=32)  # 16 heads over 32 ranks
    assert not cp_shape_ok(w, 1, 32, "hierarchical", a2a=3)
    lay = Layout(cp=8, cp_attention="hierarchical", cp_a2a_size=2, dp=1)
    one = cp_comm(w, lay, get_cluster("h100"))
    a2a, k = 83_886_080, 33_554_432
    assert one.fwd_bytes == a2a + 3 * k
    assert one.bwd_bytes == a2a + 3 * k + 4 * k * 2
    ring = cp_comm(w, dataclasses.replace(lay, cp_attention="ring", cp_a2a_size=None),
                   get_cluster("h100"))
    assert ring.fwd_bytes == 7 * k > one.fwd_bytes  # the same block, 7 hops instead of 3
    cons = Constraints(tp=1, pp=1, cp=(32,), cp_attention=("all_to_all", "hierarchical"),
                       zero=(0,), recompute=("none",))
    found = {(x.cp_attention, x.cp_a2a_size) for x in layouts(w, 32, get_cluster("h100"), cons)}
    assert found == {("hierarchical", 2), ("hierarchical", 4), ("hierarchical", 8),
                     ("hierarchical", 16)}
    assert "--parallel.cp_a2a_size=4" in Layout(cp=8, cp_attention="hierarchical",
                                                cp_a2a_size=4).overrides()


def test_plan_cli_searches_cp(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama3-8b", "--cluster", "h100", "--gpus", "8", "--seq-len", "32768",
            "--max-seq-len", "32768", "--global-batch", "8", "--tp", "1", "--pp", "1",
            "--recompute", "none,selective", "--zero", "3", "--top", "3"]
    assert plan_main(argv) == 2  # cp 1 only (the default): nothing fits
    err = capsys.readouterr().err
    assert "fits on no layout" in err and "or search context parallelism (--cp 1,2,4,8" in err
    assert plan_main([*argv, "--cp", "1,2,4,8", "--cp-attention", "ring,all_to_all"]) == 0
    out = capsys.readouterr().out
    assert "best: --parallel.tp=1 --parallel.cp=" in out and "--parallel.cp=1 " not in out
    assert plan_main([*argv, "--cp", "1,x"]) == 2
    assert "--cp='1,x'" in capsys.readouterr().err
    assert plan_main([*argv, "--cp-attention", "hybrid"]) == 2


def test_dry_run_prints_the_cp_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    text = write_corpus(tmp_path / "text", docs=2, words=200)
    args = tiny_args(text, tmp_path / "prep", tmp_path / "run",
                     model__max_seq_len=256, training__seq_len=256)
    before = hashes(tmp_path)
    assert main(["train", *args, "--nproc", "2", "--parallel.cp=2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert hashes(tmp_path) == before
    line = next(ln for ln in out.splitlines() if ln.startswith("cp: "))
    assert line.startswith("cp: 2 (ring, zigzag): activations x1/2 (")
    ratio = float(line.split("ratio ")[1].split(")")[0])
    assert 0.5 <= ratio < 0.6 and "ring p2p" in line and "MB/step per rank" in line
    assert "exposed ~" in line and "ms on" in line
    assert "  cp_buffers " in out  # the ring's transient buffers, a row of the memory table
    cfg = resolve(load_config(None, [*args, "--parallel.cp=2"]), 2)
    lay = Layout.from_config(cfg, 2)
    assert (lay.cp, lay.dp, Workload.from_config(cfg).seq_len) == (2, 1, 256)
    assert main(["train", *args, "--dry-run"]) == 0
    assert "\ncp: " not in capsys.readouterr().out  # cp = 1: no line
