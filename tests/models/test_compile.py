"""``training.compile`` changes no result: each transformer layer compiled (TorchInductor's C++
backend on CPU) against the same model eager, on the same ranks, data and seed.

Float64, dropout on (hidden and attention, p = 0.1), 3 AdamW steps of 2 micro-batches: the
losses of every micro-batch (so every dropout mask: a different mask changes a loss by ~1e-2)
agree to 1e-12, the reduced gradients of every step and the parameters after the last step to
1e-10 relative (inductor fuses and reorders floating-point sums: equal up to round-off, not bit
for bit). Layouts: one process; tp2 + sp with selective recompute; pp2 1F1B with full
recompute; dp2 with ZeRO-1 and overlapped parameter gathers (pre-forward hooks). fp32 and bf16
agree within the tolerances stated at their test. Each run also checks that the layers did run
compiled (a compiled autograd node in the loss graph), that every layer shares one compiled
graph with no recompilation across steps and micro-batches (the dropout context moves at each),
and where dynamo broke the graph.

Compilation is slow on two shared cores: models are tiny (h 32, 2 layers, seq 16) and each
layout is one pool launch that trains eager and compiled in turn.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from colonnade.checkpoint.export import full_state
from colonnade.cli import main
from colonnade.config.load import ConfigError
from colonnade.config.sections import Config, OptimConfig, ParallelConfig, TrainingConfig
from colonnade.config.validate import cxx_compiler, problems, validate
from colonnade.data_parallel import DataParallel, build_data_parallel
from colonnade.models.build import build_chunks, build_reference, param_dtype
from colonnade.models.compile import (
    GRAPH_MODE,
    HEAD_MARK,
    compile_layers,
    compile_mode,
    compiled_layers,
    is_compiled,
    wants_compile,
)
from colonnade.models.gpt import ModelChunk
from colonnade.models.layer import TransformerLayer
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.pool import RankPools
from colonnade.pipeline.plan import Batch
from tests.parity import (
    dims_of,
    max_rel_err,
    random_steps,
    rank_groups,
    rel_err,
    resolved,
    tiny_model,
    train_step,
)

EXACT_LOSS = 1e-12
"""Largest |loss difference| in float64 (absolute; losses are ~4.6)."""
TOL = 1e-10
"""Largest relative error of float64 gradients and parameters."""
FLOOR = 1e-3
"""Norm below which parameter errors count as absolute."""
NOISE = 1e-9
"""Largest absolute difference of the attention key bias, whose gradient is exactly zero in
exact arithmetic (softmax is invariant to adding q.b_k to every score of a query): it holds
only round-off (~1e-17), which compiled and eager kernels round differently, and Adam moves
it by lr x g / eps ~ 1e-12 per step."""


def make_config(*, tp: int = 1, pp: int = 1, dp: int = 1, sp: bool = False, zero: bool = False,
                recompute: str = "none", precision: str = "fp64", dropout: float = 0.1,
                compile: bool = False, arch: str = "gpt2") -> Config:
    """A resolved config (gpt2, or llama with GQA: 2 kv heads): h 32, 4 heads, 2 layers, seq
    16, micro-batch 2, 2 micro-batches per rank, 3 steps, AdamW lr 1e-2 with clipping at 0.5."""
    model = tiny_model(arch, layers=2, hidden=32, heads=4, seq=16, dropout=dropout,
                       kv_heads=2 if arch == "llama" else None)
    config = Config(
        model=model,
        parallel=ParallelConfig(tp=tp, pp=pp, dp=dp, sp=sp, use_distributed_optimizer=zero,
                                bucket_size=2000),
        training=TrainingConfig(steps=3, seq_len=16, micro_batch_size=2, microbatches=2,
                                precision=precision, seed=7, eval_interval=0,
                                recompute=recompute, compile=compile),
        optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.1,
                          clip_grad=0.5))
    return resolved(config)


def with_compile(config: Config, on: bool) -> Config:
    """``config`` with training.compile set to ``on``."""
    return dataclasses.replace(config, training=dataclasses.replace(config.training, compile=on))


def step_batches(config: Config) -> list[list[Batch]]:
    """Per step, the micro-batches of every dp rank (rank r takes [r m, (r + 1) m))."""
    tr = config.training
    count = int(tr.microbatches or 1) * int(config.parallel.dp or 1)
    return random_steps(tr.steps, count, tr.micro_batch_size, tr.seq_len, seed=3)


def graph_nodes(t: torch.Tensor) -> set[str]:
    """Type names of every autograd node behind ``t``."""
    seen: set[int] = set()
    names: set[str] = set()
    stack = [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    return names


def _hooks(chunks: list[Any]) -> tuple[int, int]:
    """Forward pre-hooks on the transformer layers, and on the modules inside them."""
    layers = [layer for chunk in chunks for layer in chunk.layers.values()]
    inner = [m for layer in layers for m in layer.modules() if m is not layer]
    return (sum(len(m._forward_pre_hooks) for m in layers),
            sum(len(m._forward_pre_hooks) for m in inner))


def _step_grads(ddp: DataParallel) -> torch.Tensor:
    """This rank's reduced gradients of the step, flattened (a copy)."""
    return torch.cat([g.reshape(-1) for g in ddp.step_grads()])


def _train(config: Config, batches: list[list[Batch]], groups: ProcessGroups) -> dict[str, Any]:
    """Train ``config`` on this rank: per-step losses, reduced gradients, final parameters,
    the comm counters (calls and bytes per group and operation), the pre-forward hooks."""
    chunks = build_chunks(config, groups, dtype=param_dtype(config.training.precision))
    ddp = build_data_parallel(chunks, config, groups)
    groups.stats.reset()
    opt = DistributedOptimizer(ddp, config.optim, groups, config.training.steps,
                               config.training.precision)
    m = int(config.training.microbatches or 1)
    r = groups.dp_rank
    losses, grads = [], []
    for step, all_batches in enumerate(batches):
        got, _ = train_step(chunks, ddp, opt, groups, config, step,
                            all_batches[r * m:(r + 1) * m],
                            before_optim=lambda: grads.append(_step_grads(ddp)))
        losses.append(got)
    ddp.finish_param_gather()
    nodes: set[str] = set()
    first = chunks[0]
    if first.first:  # one more forward of the first chunk: did its layers run compiled?
        first.train()
        tokens = batches[0][0][0]
        nodes = graph_nodes(first.run_layers(first.embedding(tokens)))
    comm = {key: (op["calls"], op["payload_bytes"]) for key, op in groups.stats.snapshot().items()}
    return {"losses": losses, "grads": grads, "params": full_state(chunks, groups),
            "compiled": compiled_layers(chunks), "layers": sum(len(c.layers) for c in chunks),
            "nodes": nodes, "comm": comm, "hooks": _hooks(chunks)}


def eager_and_compiled(config: Config, batches: list[list[Batch]]) -> dict[str, Any]:
    """Rank body: the same run eager, then compiled; the compiled run's dynamo facts."""
    groups = (rank_groups(dims_of(config)) if dims_of(config).world_size > 1
              else ProcessGroups.single())
    eager = _train(with_compile(config, False), batches, groups)
    torch._dynamo.reset()
    counters.clear()
    compiled = _train(with_compile(config, True), batches, groups)
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(
        TransformerLayer.forward.__code__)
    head_entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(
        ModelChunk.head_loss.__code__)
    breaks = {break_site(key): n for key, n in counters["graph_break"].items()}
    torch._dynamo.reset()
    return {"eager": eager, "compiled": compiled, "entries": len(entries), "breaks": breaks,
            "rank": groups.rank, "head_entries": len(head_entries)}


def break_site(reason: str) -> str:
    """A graph break's site: the qualname of the function when dynamo skipped calling or
    inlining an :func:`colonnade.eager.eager` one (``MoELayer._routed``), else the break's
    first line."""
    site = re.search(r"debug context: (?:module: \S+, )?qualname: ([\w.<>]+)", reason)
    skipped = re.match(r"Attempted to (call|inline) function marked as skipped", reason)
    return site[1] if skipped and site else reason.splitlines()[0][:120]


def launch(pools: RankPools, config: Config) -> list[dict[str, Any]]:
    """:func:`eager_and_compiled` on the config's ranks, allowed 15 minutes (a first
    compilation on two busy cores takes minutes; later runs hit inductor's on-disk cache)."""
    world = dims_of(config).world_size
    return pools.get(world).call(eager_and_compiled, (config, step_batches(config)),
                                 timeout_s=900)


def check(results: list[dict[str, Any]], loss_tol: float = EXACT_LOSS, tol: float = TOL,
          noise: float = NOISE, param_tol: float | None = None,
          vector_tol: float | None = None) -> None:
    """Compiled equals eager on every rank (losses to ``loss_tol``, gradients to ``tol``,
    parameters to ``param_tol``, default ``tol``, and the 1-D ones, norms and biases, to
    ``vector_tol``, default ``param_tol``); the layers ran compiled, sharing one graph."""
    param_tol = tol if param_tol is None else param_tol
    vector_tol = param_tol if vector_tol is None else vector_tol
    for res in results:
        eager, compiled, who = res["eager"], res["compiled"], f"rank {res['rank']}"
        assert compiled["compiled"] == compiled["layers"] > 0 and eager["compiled"] == 0, who
        assert res["entries"] == 1, f"{who}: {res['entries']} compiled versions of the layer"
        assert compiled["comm"] == eager["comm"], f"{who}: comm counters differ"
        if eager["nodes"]:
            assert "CompiledFunctionBackward" in compiled["nodes"], who
            assert "CompiledFunctionBackward" not in eager["nodes"], who
        for step, (got, want) in enumerate(zip(compiled["losses"], eager["losses"],
                                               strict=True)):
            assert len(got) == len(want)
            for a, b in zip(got, want, strict=True):
                assert abs(a - b) <= loss_tol, f"{who} step {step}: loss {a!r} vs {b!r}"
        for step, (got, want) in enumerate(zip(compiled["grads"], eager["grads"], strict=True)):
            err = rel_err(got, want)
            assert err <= tol, f"{who} step {step}: gradient relative error {err:.3e}"
        params = {k: v.double() for k, v in compiled["params"].items()}
        want = {k: v.double() for k, v in eager["params"].items()}
        assert sorted(params) == sorted(want)
        for key, value in want.items():
            if key.endswith("attn.k.bias"):
                diff = float((params[key] - value).abs().max())
                assert diff <= noise, f"{who} {key}: difference {diff:.3e} > {noise:g}"
                continue
            err = rel_err(params[key], value, floor=FLOOR)
            bound = vector_tol if value.ndim == 1 else param_tol
            assert err <= bound, f"{who} {key}: relative error {err:.3e} > {bound:g}"
    losses = [v for res in results for step in res["eager"]["losses"] for v in step]
    if losses:
        assert max(losses) - min(losses) > 1e-3, "every micro-batch gave the same loss"


def test_single_process_fp64_dropout(rank_pools: RankPools) -> None:
    config = make_config()
    (res,) = launch(rank_pools, config)
    check([res])
    # the only graph breaks: the eager dropout draws (hidden) and dropout attention
    assert set(res["breaks"]) == {"_draw_dropout", "dropout_attention"}


def test_tp2_sp_selective_recompute(rank_pools: RankPools) -> None:
    config = make_config(tp=2, sp=True, recompute="selective")
    results = launch(rank_pools, config)
    check(results)


def test_pp2_1f1b_full_recompute(rank_pools: RankPools) -> None:
    config = make_config(pp=2, recompute="full")
    results = launch(rank_pools, config)
    check(results)


def test_dp2_zero1_overlapped_gathers(rank_pools: RankPools) -> None:
    config = make_config(dp=2, zero=True)
    assert config.parallel.overlap_param_gather
    results = launch(rank_pools, config)
    check(results)
    for res in results:  # eager: a hook per module with parameters; compiled: one per layer
        assert res["eager"]["hooks"][0] == 0 and res["eager"]["hooks"][1] >= 6
        assert res["compiled"]["hooks"] == (2, 0)


@pytest.mark.parametrize(("arch", "precision", "loss_tol", "tol", "param_tol", "vector_tol"),
                         [("llama", "fp32", 1e-5, 1e-5, 1e-5, 1e-5),
                          ("gpt2", "bf16", 5e-3, 5e-2, 0.08, 0.3)])
def test_single_process_low_precision(rank_pools: RankPools, arch: str, precision: str,
                                      loss_tol: float, tol: float, param_tol: float,
                                      vector_tol: float) -> None:
    """The dense path (tp = 1, no dropout, no cp, no selective recompute) has NO graph break,
    in a layer or in the last chunk's final norm + head + loss: one graph each (so no host
    read inside, what training.cuda_graphs needs), for Llama (RoPE, GQA with 2 kv heads,
    SwiGLU, RMSNorm; fp32) and GPT-2 (learned positions, GELU, biases, tied head; bf16).

    fp32: inductor's fused reductions differ from eager's by round-off (~1e-7 relative per
    op), grown by 3 Adam steps (measured: losses equal, gradients <= 1.2e-6, parameters
    <= 2e-6). bf16 (fp32 main grads): inductor keeps fused elementwise intermediates in fp32
    where eager rounds each op to bf16 (measured: losses <= 2e-3 apart, gradients <= 3e-2,
    matrices after 3 steps <= 4e-2). The zero-initialised biases are moved only by lr-sized
    Adam steps, whose direction is the sign of a gradient: where that gradient is within bf16
    round-off of zero the two runs step an element in opposite directions, 2 lr apart, against
    a norm of ~2.5 lr sqrt(n) (measured: <= 0.11 with the sequence-first residual stream,
    0.22 batch-first, where the rounding falls differently; 1-D parameters are held to 0.3,
    matrices to 0.08). The key bias's
    round-off gradient is no longer far below Adam's eps here, so each run moves it by up to
    ~lr per step in its own direction: only that bound (2 x 3 steps x lr) holds for it."""
    config = make_config(precision=precision, dropout=0.0, arch=arch)
    (res,) = launch(rank_pools, config)
    check([res], loss_tol, tol, noise=2 * config.training.steps * config.optim.lr,
          param_tol=param_tol, vector_tol=vector_tol)
    assert res["breaks"] == {}, res["breaks"]  # the dense path: no graph break anywhere
    assert res["entries"] == 1 and res["head_entries"] == 1



def test_build_paths() -> None:
    """build_chunks compiles every layer with training.compile, build_reference never."""
    config = make_config(dropout=0.0, compile=True)
    (chunk,) = build_chunks(config, ProcessGroups.single(), dtype=torch.float64)
    assert all(is_compiled(layer) for layer in chunk.layers.values())
    assert compiled_layers([build_reference(config, torch.float64)]) == 0
    (plain,) = build_chunks(with_compile(config, False), ProcessGroups.single())
    assert compiled_layers([plain]) == 0
    assert max_rel_err(dict(chunk.state_dict()), dict(plain.state_dict())) == 0.0


def test_cli_dry_run_accepts_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["train", "--model.num_layers=2", "--model.hidden_size=32", "--training.steps=2",
            "--training.compile=true", "--dry-run"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing was started" in out
    assert list(tmp_path.iterdir()) == []
    assert main(["train", "--training.compile=maybe", "--dry-run"]) == 2
    assert "training.compile" in capsys.readouterr().err


def test_compile_without_a_cxx_compiler_is_rejected(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(compile=True)
    assert cxx_compiler() is not None and problems(config) == []
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler there
    monkeypatch.delenv("CXX", raising=False)
    assert cxx_compiler() is None
    (found,) = problems(config)
    assert found.startswith("training.compile=true needs a C++ compiler (none of g++")
    assert "training.compile=false" in found
    assert problems(with_compile(config, False)) == []
    monkeypatch.setenv("CXX", "/nowhere/g++")
    assert "$CXX=/nowhere/g++ is not found" in problems(config)[0]
    with pytest.raises(ConfigError, match=r"training\.compile=true needs"):
        validate(config)


def test_compile_with_the_zero_bubble_schedule_is_rejected() -> None:
    """zb_h1's split backward runs a layer's backward node twice with retain_graph; a compiled
    layer's backward frees its donated buffers (and would recompute every gradient twice)."""
    config = make_config(pp=2)
    zb = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                  schedule="zb_h1"))
    assert problems(zb) == [] and problems(with_compile(config, True)) == []
    (found,) = problems(with_compile(zb, True))
    assert "training.compile=true does not go with parallel.schedule='zb_h1'" in found
    assert "'1f1b'" in found and "training.compile=false" in found


def graphs_config(**fields: Any) -> Config:
    """:func:`make_config` (dropout 0) with training.cuda_graphs on a CUDA device, and
    ``fields`` as 'section.field' -> value."""
    config = make_config(dropout=0.0)
    config = dataclasses.replace(config, training=dataclasses.replace(
        config.training, cuda_graphs=True, device="cuda"))
    for key, value in fields.items():
        section, name = key.split("__")
        config = dataclasses.replace(config, **{section: dataclasses.replace(
            getattr(config, section), **{name: value})})
    return config


@pytest.mark.parametrize(("fields", "named"), [
    ({"training__device": "cpu"}, "training.device='cpu'"),
    ({"model__num_experts": 4, "model__moe_ffn_hidden_size": 32}, "model.num_experts=4"),
    ({"parallel__cp": 2}, "parallel.cp=2"),
    ({"parallel__tp": 2}, "parallel.tp=2"),
    ({"parallel__pp": 2}, "parallel.pp=2"),
    ({"model__hidden_dropout": 0.1}, "model.hidden_dropout=0.1"),
    ({"model__attention_dropout": 0.1}, "model.attention_dropout=0.1"),
    ({"training__recompute": "full"}, "training.recompute='none' (it is 'full')"),
    ({"parallel__zero_stage": 3, "parallel__dp": 2}, "ZeRO stage 3"),
])
def test_cuda_graphs_refusals(fields: dict[str, Any], named: str) -> None:
    """Each case where capture cannot work is refused, naming the field and both fixes."""
    assert problems(graphs_config()) == []  # a dense tp = 1 layout on a CUDA device
    found = [p for p in problems(graphs_config(**fields)) if "cuda_graphs" in p]
    assert len(found) == 1, found
    assert named in found[0] and "training.cuda_graphs=false" in found[0]


def test_cuda_graphs_path_choice(capsys: pytest.CaptureFixture[str]) -> None:
    """cuda_graphs compiles every layer in mode 'reduce-overhead' (CUDA graph trees), compile
    alone in the default mode; the compiler is a fake here (no GPU to capture on). The CLI
    refuses it on a machine without a GPU before anything starts."""
    seen: list[tuple[str | None, bool, bool]] = []

    def fake(fn: Any, *, backend: str, mode: str | None, dynamic: bool,
             fullgraph: bool) -> Any:
        seen.append((mode, dynamic, fullgraph))
        return fn

    config = graphs_config()
    assert wants_compile(config.training) and not config.training.compile
    assert compile_mode(config.training) == GRAPH_MODE == "reduce-overhead"
    assert compile_mode(with_compile(config, True).training) == GRAPH_MODE
    plain = dataclasses.replace(config, training=dataclasses.replace(
        config.training, cuda_graphs=False, compile=True))
    assert compile_mode(plain.training) is None and wants_compile(plain.training)
    (chunk,) = build_chunks(with_compile(plain, False), ProcessGroups.single())
    assert compile_layers([chunk], mode=compile_mode(config.training), compiler=fake) == 2
    assert seen == [("reduce-overhead", False, False)] * 3  # the head + loss, 2 layers
    assert getattr(chunk, HEAD_MARK)
    assert compiled_layers([chunk]) == 2
    assert main(["train", "--model.num_layers=2", "--model.hidden_size=32",
                 "--training.cuda_graphs=true", "--training.device=cpu", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "training.cuda_graphs=true needs a CUDA device (training.device='cpu')" in err
