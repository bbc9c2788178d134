"""Tensor partitioning (parallel.tp_comm_chunks) preserves results exactly.

Operator level: the chunked column (all-gather + matmul, one or several sibling weights) and
row (matmul + reduce-scatter) operators equal the unchunked ones in output and in every
gradient (float64, rel. error <= 1e-12), on tp 2 and 4 with 2 and 4 chunks, and they really
issue ``chunks`` collectives. Model level: a training step of tp2+sp and tp4+sp models (llama
and gpt2) with 2 and 4 chunks gives the loss and gathered gradients of the unchunked model;
one bf16 step stays close. Pipeline: tp2 x pp2 with vp2 (interleaved 1F1B), chunking and
overlap_p2p on vs off. Config: a chunk count not dividing seq_len / tp is rejected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from colonnade.config.load import ConfigError
from colonnade.config.sections import Config
from colonnade.config.validate import validate
from colonnade.data_parallel.finalize import reduce_sp_and_tied
from colonnade.models.build import build_chunks
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.plan import ExecOptions, StepPlan
from colonnade.tensor_parallel import mappings as mp
from colonnade.tensor_parallel.partition import (
    chunk_rows,
    gathered_linear,
    gathered_linears,
    linear_reduce_scatter,
)
from colonnade.training.step import forward_backward, set_train_mode
from tests.tensor_parallel.harness import full_tensors, make_batches, rel_err, tiny_config

TOL = 1e-12
"""Largest relative error accepted between chunked and unchunked runs (float64)."""


def _grads_of(out: torch.Tensor, seed_grad: torch.Tensor,
              leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    out.backward(seed_grad)
    grads = [t.grad.clone() for t in leaves]  # type: ignore[union-attr]
    for t in leaves:
        t.grad = None
    return grads


def siblings_errors(x_local: torch.Tensor, group: Any, chunks: int,
                    gen: torch.Generator) -> dict[str, float]:
    """Three weights (two with a bias) sharing one chunked gather vs one plain gather."""
    h, r = x_local.shape[-1], group.rank
    tp = group.size
    weights = [torch.randn(o * tp, h, generator=gen, dtype=torch.float64)[r * o:(r + 1) * o]
               .requires_grad_() for o in (2, 3, 1)]  # shards [o_k/tp, h]
    biases = [torch.randn(2, generator=gen, dtype=torch.float64).requires_grad_(), None,
              torch.randn(1, generator=gen, dtype=torch.float64).requires_grad_()]
    seeds = [torch.randn(x_local.shape[0] * group.size, x_local.shape[1], w.shape[0],
                         generator=gen, dtype=torch.float64) for w in weights]
    leaves = [x_local, *weights, biases[0], biases[2]]
    full = mp.gather_seq(x_local, group)  # [s, b, h]
    want = [F.linear(full, w, bias) for w, bias in zip(weights, biases, strict=True)]
    want_g = _grads_of(torch.cat(want, -1), torch.cat(seeds, -1), leaves)
    got = gathered_linears(x_local, weights, biases, group, chunks)
    got_g = _grads_of(torch.cat(got, -1), torch.cat(seeds, -1), leaves)
    errs = {f"siblings_out{i}": rel_err(a.detach(), e.detach())
            for i, (a, e) in enumerate(zip(got, want, strict=True))}
    names = ["dx", "dw0", "dw1", "dw2", "db0", "db2"]
    errs.update({f"siblings_{n}": rel_err(a, e)
                 for n, a, e in zip(names, got_g, want_g, strict=True)})
    return errs


def ops_rank(tp: int, chunks: int) -> dict[str, float]:
    """Rank function: chunked vs plain sp operators on random float64 data; worst errors."""
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(tp=tp))
    group, r = groups.tp, groups.tp_rank
    gen = torch.Generator().manual_seed(11)  # same full tensors on every rank
    s, b, h, o = 8 * tp, 2, 6, 5 * tp
    x_full = torch.randn(s, b, h, generator=gen, dtype=torch.float64)  # [s, b, h]
    w_col = torch.randn(o, h, generator=gen, dtype=torch.float64)[r * 5:(r + 1) * 5]
    bias = torch.randn(o, generator=gen, dtype=torch.float64)[r * 5:(r + 1) * 5]
    gy_col = torch.randn(s, b, 5, generator=gen, dtype=torch.float64) * (r + 1)  # [s, b, o/tp]
    w_row = torch.randn(h, 5, generator=gen, dtype=torch.float64) * (r + 2)  # [h, i/tp]
    gy_row = torch.randn(s // tp, b, h, generator=gen, dtype=torch.float64) * (r + 3)
    x_local = x_full.chunk(tp)[r].clone().requires_grad_()  # [s/tp, b, h]
    leaves = [x_local, w_col.requires_grad_(), bias.requires_grad_()]
    errs: dict[str, float] = {}
    groups.stats.reset()
    want = F.linear(mp.gather_seq(x_local, group), w_col, bias)  # [s, b, o/tp]
    want_g = _grads_of(want, gy_col, leaves)
    got = gathered_linear(x_local, w_col, bias, group, chunks)
    got_g = _grads_of(got, gy_col, leaves)
    errs["column_out"] = rel_err(got.detach(), want.detach())
    for name, a, e in zip(("column_dx", "column_dw", "column_db"), got_g, want_g, strict=True):
        errs[name] = rel_err(a, e)
    errs.update(siblings_errors(x_local, group, chunks, gen))
    x_row = torch.randn(s, b, 5, generator=gen, dtype=torch.float64).requires_grad_()
    leaves = [x_row, w_row.requires_grad_()]
    want = mp.reduce_scatter_seq(F.linear(x_row, w_row), group)  # [s/tp, b, h]
    want_g = _grads_of(want, gy_row, leaves)
    got = linear_reduce_scatter(x_row, w_row, group, chunks)
    got_g = _grads_of(got, gy_row, leaves)
    errs["row_out"] = rel_err(got.detach(), want.detach())
    for name, a, e in zip(("row_dx", "row_dw"), got_g, want_g, strict=True):
        errs[name] = rel_err(a, e)
    ops = groups.stats.ops
    for key in ("tp/all_gather/sp_gather_chunk", "tp/reduce_scatter/sp_gather_chunk_bwd",
                "tp/reduce_scatter/sp_reduce_scatter_chunk",
                "tp/all_gather/sp_reduce_scatter_chunk_bwd"):
        errs[f"calls {key}"] = float(ops[key].calls)
    return errs


@pytest.mark.parametrize(("tp", "chunks"), [(2, 2), (2, 4), (4, 2), (4, 4)])
def test_chunked_operators_equal_unchunked(run_ranks: Callable[..., list[Any]], tp: int,
                                           chunks: int) -> None:
    for rank, errs in enumerate(run_ranks(tp, ops_rank, tp, chunks)):
        for name, value in errs.items():
            if name.startswith("calls "):
                expect = 2 * chunks if "sp_gather_chunk" in name else chunks  # + siblings
                assert value == expect, f"rank {rank}: {name[6:]} ran {value} times, not {expect}"
            else:
                assert value <= TOL, f"rank {rank}: {name} relative error {value:.3e} > {TOL}"


def test_chunked_operators_on_one_rank_and_bad_chunks() -> None:
    """tp = 1 (copy collectives) is exact; a chunk count not dividing s/tp fails naming it."""
    group = ProcessGroups.single().tp
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 2, 4, generator=gen, dtype=torch.float64)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(gathered_linear(x, w, None, group, 3), F.linear(x, w),
                               rtol=0, atol=1e-15)
    torch.testing.assert_close(linear_reduce_scatter(x, w, group, 4), F.linear(x, w),
                               rtol=0, atol=1e-15)
    assert chunk_rows(12, 4, "here") == 3
    with pytest.raises(ValueError, match="tp_comm_chunks=5"):
        gathered_linear(x, w, None, group, 5)
    with pytest.raises(ValueError, match="tp_comm_chunks must be >= 1"):
        chunk_rows(12, 0, "here")


def test_config_rejects_chunks_not_dividing_the_local_sequence() -> None:
    config = tiny_config("llama", 4, True)  # seq 16: 4 rows per rank
    validate(with_chunks(config, 4), 4)
    with pytest.raises(ConfigError, match=r"tp=4 x tp_comm_chunks=8"):
        validate(with_chunks(config, 8), 4)


def with_chunks(config: Config, chunks: int, **parallel: Any) -> Config:
    """``config`` with parallel.tp_comm_chunks (and other parallel fields) replaced."""
    par = dataclasses.replace(config.parallel, tp_comm_chunks=chunks, **parallel)
    return dataclasses.replace(config, parallel=par)


def step_results(config: Config, groups: ProcessGroups, batches: list[Any],
                 options: ExecOptions | None = None) -> dict[str, Any]:
    """One forward/backward step of a fresh model: micro-batch losses and gathered grads."""
    chunks = build_chunks(config, groups, dtype=torch.float64)
    set_train_mode(chunks, True)
    plan = StepPlan(groups, 0, config.parallel.schedule, options=options or ExecOptions())
    groups.stats.reset()
    losses = forward_backward(chunks, batches, plan)
    reduce_sp_and_tied(chunks, groups, config.model.tie_embeddings)
    calls = groups.stats.total("tp/all_gather/sp_gather_chunk", "calls")
    return {"losses": losses, "grads": full_tensors(chunks, groups, grads=True),
            "chunk_gathers": calls}


def model_rank(config: Config, chunk_counts: list[int]) -> dict[int, dict[str, Any]]:
    """Rank function: the same step unchunked and with each chunk count."""
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(tp=config.parallel.tp))
    (batches,) = make_batches(config)
    return {n: step_results(with_chunks(config, n), groups, batches) for n in [1, *chunk_counts]}


def assert_same_step(base: dict[str, Any], got: dict[str, Any], who: str) -> None:
    """Identical losses and gradients within TOL.

    A gradient whose exact value is zero (the key bias: softmax ignores a per-query constant
    q.b_k) is rounding noise of ~1e-19 in both runs; its error is measured against a floor of
    1e-6 of the global gradient norm instead of its own norm.
    """
    err = rel_err(torch.tensor(got["losses"]), torch.tensor(base["losses"]))
    assert err <= TOL, f"{who}: losses {got['losses']} vs {base['losses']} ({err:.3e})"
    assert sorted(got["grads"]) == sorted(base["grads"]), f"{who}: gradient names differ"
    floor = 1e-6 * float(torch.stack([g.norm() for g in base["grads"].values()]).norm())
    assert floor > 0, f"{who}: all gradients are zero (vacuous comparison)"
    for key, ref in base["grads"].items():
        err = float((got["grads"][key] - ref).norm()) / max(float(ref.norm()), floor)
        assert err <= TOL, f"{who}: gradient {key} relative error {err:.3e} > {TOL}"


@pytest.mark.parametrize(("arch", "tp"), [("llama", 2), ("gpt2", 2), ("llama", 4), ("gpt2", 4)])
def test_model_step_chunked_equals_unchunked(run_ranks: Callable[..., list[Any]], arch: str,
                                             tp: int) -> None:
    config = tiny_config(arch, tp, True, steps=1)
    for rank, res in enumerate(run_ranks(tp, model_rank, config, [2, 4])):
        assert res[1]["chunk_gathers"] == 0, "chunks=1 must use the plain operators"
        for n in (2, 4):
            assert res[n]["chunk_gathers"] > 0, f"chunks={n} did not use the chunked operators"
            assert_same_step(res[1], res[n], f"{arch} tp{tp} rank {rank} chunks={n}")


def bf16_rank(config: Config) -> dict[int, dict[str, Any]]:
    """Rank function: one bf16 step (bf16 params and activations), unchunked and 4 chunks."""
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(tp=config.parallel.tp))
    (batches,) = make_batches(config)
    out = {}
    for n in (1, 4):
        chunks = build_chunks(with_chunks(config, n), groups, dtype=torch.bfloat16)
        losses = forward_backward(chunks, batches, StepPlan(groups, 0))
        reduce_sp_and_tied(chunks, groups, config.model.tie_embeddings)
        out[n] = {"losses": losses,
                  "grads": {k: v.float() for k, v in full_tensors(chunks, groups, True).items()}}
    return out


def test_bf16_step_chunked_close_to_unchunked(run_ranks: Callable[..., list[Any]]) -> None:
    """bf16 rounds each chunk's matmul alone, so only closeness is expected: loss within
    1e-2 and every gradient within 5e-2 relative (a wrong row order gives errors near 1)."""
    config = tiny_config("llama", 2, True, steps=1)
    for rank, res in enumerate(run_ranks(2, bf16_rank, config)):
        err = rel_err(torch.tensor(res[4]["losses"]), torch.tensor(res[1]["losses"]))
        assert err <= 1e-2, f"rank {rank}: bf16 losses {res[4]['losses']} vs {res[1]['losses']}"
        for key, ref in res[1]["grads"].items():
            if float(ref.norm()) > 1e-3 * max(float(g.norm()) for g in res[1]["grads"].values()):
                err = rel_err(res[4]["grads"][key], ref)
                assert err <= 5e-2, f"rank {rank}: bf16 gradient {key} relative error {err:.3e}"


def pipeline_rank(config: Config, variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank function (tp2 x pp2): the same step under each (tp_comm_chunks, overlap_p2p)."""
    torch.set_num_threads(1)
    par = config.parallel
    groups = ProcessGroups.build(ParallelDims(tp=par.tp, pp=par.pp))
    (batches,) = make_batches(config)
    out = []
    for v in variants:
        cfg = with_chunks(config, v["chunks"], overlap_p2p=v["overlap_p2p"])
        res = step_results(cfg, groups, batches, ExecOptions(overlap=v["overlap_p2p"]))
        res["last_stage"] = groups.is_last_stage
        out.append(res)
    return out


def test_pipeline_tp2_pp2_vp2_switches_preserve_results(
        run_ranks: Callable[..., list[Any]]) -> None:
    base = tiny_config("llama", 2, True, layers=4, steps=1, microbatches=4)
    par = dataclasses.replace(base.parallel, pp=2, vp=2, schedule="interleaved_1f1b")
    config = validate(dataclasses.replace(base, parallel=par), 4)
    variants = [{"chunks": c, "overlap_p2p": o} for c, o in ((1, False), (1, True), (2, False),
                                                             (2, True), (4, True))]
    results = run_ranks(4, pipeline_rank, config, variants)
    for rank, per_variant in enumerate(results):
        ref = per_variant[0]
        assert (len(ref["losses"]) == 4) == ref["last_stage"], f"rank {rank}: loss count"
        for v, res in zip(variants[1:], per_variant[1:], strict=True):
            assert_same_step(ref, res, f"tp2xpp2xvp2 rank {rank} {v}")
