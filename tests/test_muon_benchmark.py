"""benchmarks/muon.py on a tiny GPT-2, one process: its step times, Newton-Schulz share and
losses are numbers of the run they claim (the exchange part runs on 4 ranks in the benchmark
only; tests/optim/test_muon_exchange.py checks its bytes against the formula)."""

from __future__ import annotations

import pytest

from tests.bench_import import load_benchmark


def test_muon_benchmark_measures_both_optimizers() -> None:
    bench = load_benchmark("muon.py", "bench_muon")
    w = bench.Workload(name="micro", arch="gpt2", hidden=32, layers=2, heads=4, kv_heads=4,
                       vocab=128, seq_len=16, global_batch=4, lr=1e-2, weight_decay=0.1)
    res = bench.run(w, 4, pairs=2, warmup=0, ns_repeats=1, exchange_steps=0, loss_steps=3,
                    data_dir=None)
    st, ns, loss = res["step_time"], res["newton_schulz"], res["loss"]
    assert all(t > 0 for t in st["step_s"].values()) and len(st["ratio_rounds"]) == 2
    assert st["ratio"] == pytest.approx(sorted(st["ratio_rounds"])[0] / 2
                                        + sorted(st["ratio_rounds"])[1] / 2)
    # 2 layers x (q, k, v, o, fc, proj) of gpt2; embeddings, head, norms, biases are AdamW's
    assert ns["matrices"] == 12 and ns["elements"] == 2 * (4 * 32 * 32 + 2 * 32 * 128)
    share = ns["per_step_s"] / st["step_s"]["muon"]  # not bounded by 1 here: a loaded
    assert ns["share_of_muon_step"] == share > 0  # machine may deschedule a timed NS call
    assert set(ns["per_shape_s"]) == {"32x32", "128x32", "32x128"}
    adamw, muon = loss["adamw"]["losses"], loss["muon"]["losses"]
    assert adamw[0] == muon[0] and adamw[2] != muon[2]  # same start, other updates
    assert loss["muon"]["final"] == muon[-1]
    # a 6-element matrix in pieces of 4 and 2 (one owner: the 2 move there and back), and an
    # expert matrix of 8 held whole: 2 (6 - 4) x 4 bytes
    pieces = [("w", None, 4, 6), ("w", None, 2, 6), ("e", 0, 8, 8)]
    assert bench.exchange_bound(pieces, 4) == 16.0
    assert "muon/adamw" in bench.table(res)
