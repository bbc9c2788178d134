"""Muon (colonnade/optim/muon.py) against an independent plain-PyTorch Muon written here from
the published algorithm (Keller Jordan's quintic Newton-Schulz; Moonlight's update scale), with
torch.optim.AdamW for the parameters Muon does not take; and its parity across layouts."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from colonnade.checkpoint.export import full_state
from colonnade.checkpoint.optim_state import logical_state
from colonnade.checkpoint.training_state import load_training, save_training
from colonnade.config.sections import (
    Config,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainingConfig,
)
from colonnade.config.validate import resolve
from colonnade.fuzz.compare import rel_err
from colonnade.fuzz.run import global_batch, judge, rank_batches, rank_case
from colonnade.fuzz.space import Case
from colonnade.models.build import build_reference
from colonnade.optim.adamw import decays
from colonnade.optim.clip import clip_coefficient
from colonnade.optim.lr import lr_at
from colonnade.optim.muon import MuonMatrices, muon_matrices, split_matrices
from colonnade.parallel.pool import RankPools
from colonnade.tensor_parallel.sharding import Sharding

STEPS = 3


def tiny(arch: str, **model: object) -> Config:
    """A float64 3-step Muon run of a tiny model (clipping active, warmup, weight decay)."""
    m = ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_heads=4, vocab_size=101,
                    max_seq_len=16, init_std=0.1, **model)  # type: ignore[arg-type]
    return resolve(Config(
        model=m, training=TrainingConfig(steps=STEPS, seq_len=16, micro_batch_size=2,
                                         microbatches=2, precision="fp64"),
        optim=OptimConfig(name="muon", lr=0.02, min_lr=0.002, warmup_steps=1,
                          weight_decay=0.1, clip_grad=0.5)), 1)


MODELS = {
    "gpt2": tiny("gpt2"),
    "llama": tiny("llama", num_kv_heads=2),
    "moe": tiny("llama", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16),
}


def plain_muon_split(name: str, p: torch.Tensor) -> list[torch.Tensor] | None:
    """The published split: 2-D hidden matrices (not embeddings, heads or routers), each
    expert's matrix of an [E, a, b] expert stack; None for AdamW's parameters."""
    if re.search(r"(^|\.)(embedding|embed|head|router)(\.|$)", name):
        return None
    if p.dim() == 3 and ".experts." in name:
        return list(p.unbind(0))
    return [p] if p.dim() == 2 else None


def plain_newton_schulz(g: torch.Tensor) -> torch.Tensor:
    """Five quintic iterations (3.4445, -4.7750, 2.0315) on the wide orientation."""
    x = g.T if g.size(0) > g.size(1) else g
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


def plain_run(config: Config, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """3 steps of the tiny model from ``initial`` with torch.optim.AdamW + a plain Muon loop."""
    o = config.optim
    model = build_reference(config, torch.float64)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for p in named.values():
            p.copy_(initial[p.sharding.key])  # type: ignore[attr-defined]
    muon = {n: p for n, p in named.items() if plain_muon_split(n, p) is not None}
    rest = {n: p for n, p in named.items() if n not in muon}
    decay = {n for n, p in rest.items() if p.dim() > 1 and "bias" not in n}  # experts' [E, f]
    adamw = torch.optim.AdamW(
        [{"params": [p for n, p in rest.items() if n in decay], "weight_decay": o.weight_decay},
         {"params": [p for n, p in rest.items() if n not in decay], "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    momentum = {n: torch.zeros_like(p) for n, p in muon.items()}
    for step in range(STEPS):
        model.zero_grad()
        batches = global_batch(config, step, None)
        for tokens, labels in batches:
            (model(tokens, labels) / len(batches)).backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in named.values()))
        coef = clip_coefficient(float(norm), o.clip_grad)
        lr = lr_at(step, STEPS, o)
        for p in rest.values():
            p.grad.mul_(coef)
        for group in adamw.param_groups:
            group["lr"] = lr
        adamw.step()
        with torch.no_grad():
            for n, p in muon.items():
                g = p.grad * coef
                momentum[n].mul_(o.muon_momentum).add_(g)
                u = g + o.muon_momentum * momentum[n]
                p.mul_(1 - lr * o.weight_decay)
                for w, piece in zip(plain_muon_split(n, p), plain_muon_split(n, u), strict=True):
                    w.sub_(lr * 0.2 * math.sqrt(max(piece.shape)) * plain_newton_schulz(piece))
    return {p.sharding.key: p.detach() for p in named.values()}  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", list(MODELS))
def test_muon_matches_a_plain_pytorch_muon(name: str) -> None:
    """Every parameter's update after 3 float64 steps equals the plain loop's to 1e-12."""
    config = MODELS[name]
    run = rank_case(config, 1, None, config)
    want = plain_run(config, run["initial"])
    initial = run["initial"]
    assert sorted(run["params"]) == sorted(want)
    errs = {k: rel_err(run["params"][k] - initial[k], want[k] - initial[k]) for k in want}
    assert max(errs.values()) <= 1e-12, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    assert min(float((want[k] - initial[k]).abs().max()) for k in want) > 0, "all moved"


LAYOUTS = {  # name: (model, world, parallel fields)
    "pp2": ("llama", 2, {"pp": 2}),
    "pp2-moe-zero3-dp1": ("moe", 2, {"pp": 2, "zero_stage": 3}),
    "dp2": ("gpt2", 2, {"dp": 2}),
    "cp2": ("llama", 2, {"cp": 2}),
    "ep2": ("moe", 2, {"dp": 2, "ep": 2}),
}
"""The layouts whose Muon matrices stay whole on every rank (no tp, no ZeRO sharding over
more than one rank; ZeRO-3 at dp 1 still frees the parameters' storage between gathers: the
local path read experts' shapes from it, fuzz draw 381/13)."""


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_layouts_match_the_single_process_run(rank_pools: RankPools, layout: str) -> None:
    """3 float64 Muon steps: losses, grad norms, gradients and parameters equal the
    single-process run's (fuzz judge, 1e-10); DDP, cp and ep replicas orthogonalise locally."""
    model, world, fields = LAYOUTS[layout]
    base = MODELS[model]
    par = dataclasses.replace(ParallelConfig(), **fields)  # type: ignore[arg-type]
    training = dataclasses.replace(base.training, microbatches=None, global_batch_size=4)
    config = dataclasses.replace(base, parallel=par, training=training)
    verdict = judge(Case(0, 0, config, world, None), rank_pools, hf=False)
    assert verdict.verdict == "match", (verdict.worst, verdict.detail)
    assert verdict.errors["params"] <= 1e-10 and verdict.errors["loss"] <= 1e-10


def _trainer(config: Config, world: int) -> Any:
    """A Trainer of ``config`` on this pool rank (no data: the test feeds global_batch)."""
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime, build_groups

    torch.set_num_threads(1)
    return Trainer(Runtime(config, torch.device("cpu"), build_groups(config, world)), None)


def _train(trainer: Any, count: int) -> None:
    for _ in range(count):
        trainer.train_step(rank_batches(trainer.config, trainer.config, trainer.step, None,
                                        trainer.groups.dp.rank))


def _final(trainer: Any) -> dict[str, torch.Tensor]:
    trainer.ddp.finish_param_gather()
    keep = trainer.groups.dp_cp.rank == 0 and trainer.groups.tp.rank == 0
    return full_state(trainer.chunks, trainer.groups, trainer.ddp) if keep else {}


def _save_and_go_on(config: Config, root: str) -> dict[str, Any]:
    """Train 2 steps, save, train 2 more; the optimizer's state at the save (names per key,
    state_dict copies) and the final parameters."""
    trainer = _trainer(config, 1)
    _train(trainer, 2)
    save_training(trainer, root)
    names = {k: sorted(v) for k, v in logical_state(trainer.optimizer).items()}
    saved = {k: v.clone() for k, v in trainer.optimizer.state_dict().items()
             if isinstance(v, torch.Tensor)}
    _train(trainer, 2)
    return {"names": names, "state": saved, "params": _final(trainer)}


def _load_and_go_on(config: Config, world: int, root: str) -> dict[str, Any]:
    """Resume ``root`` on ``world`` ranks: the optimizer's state_dict right after the load,
    then the parameters after the remaining 2 steps."""
    trainer = _trainer(config, world)
    load_training(trainer, root)
    loaded = {k: v.clone() for k, v in trainer.optimizer.state_dict().items()
              if isinstance(v, torch.Tensor)}
    _train(trainer, 2)
    return {"state": loaded, "params": _final(trainer), "step": trainer.step}


def test_muon_checkpoint_round_trip_and_pp2_reshard(run_ranks: Callable[..., list[Any]],
                                                     tmp_path: Path) -> None:
    """A Muon checkpoint holds momentum (not Adam's moments) for the Muon matrices; loading it
    on one rank restores every optimizer tensor bit for bit, and resuming it at pp2 (other
    flat buffers: the momentum resharded through the logical state) ends where the
    uninterrupted run does (1e-10)."""
    base = dataclasses.replace(MODELS["llama"], training=dataclasses.replace(
        MODELS["llama"].training, steps=4))
    root = str(tmp_path / "ckpt")
    (stayed,) = run_ranks(1, _save_and_go_on, base, root)
    q = "layers.0.attn.q.weight"
    assert stayed["names"][q] == ["momentum"]
    assert stayed["names"]["embedding.word.weight"] == ["exp_avg", "exp_avg_sq"]
    (again,) = run_ranks(1, _load_and_go_on, base, 1, root)
    assert sorted(again["state"]) == sorted(stayed["state"]) and "momentum" in again["state"]
    for name, tensor in stayed["state"].items():
        assert torch.equal(again["state"][name], tensor), name
    pp2 = resolve(dataclasses.replace(base, parallel=ParallelConfig(pp=2)), 2)
    moved = run_ranks(2, _load_and_go_on, pp2, 2, root)
    assert moved[0]["step"] == 4
    got = {k: v for r in moved for k, v in r["params"].items()}
    assert sorted(got) == sorted(stayed["params"])
    assert max(rel_err(got[k], v) for k, v in stayed["params"].items()) <= 1e-10
    assert max(rel_err(again["params"][k], v) for k, v in stayed["params"].items()) <= 1e-12


TABLE_START = "<!-- optimizer table: generated by tests/optim/test_muon.py (update_table) -->"
TABLE_END = "<!-- end of optimizer table -->"
TABLE_MODELS: list[dict[str, Any]] = [
    {"arch": "gpt2", "bias": True},
    {"arch": "qwen3", "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16},
    {"arch": "deepseek_v3", "mla_kv_lora_rank": 16, "mla_q_lora_rank": 24,
     "mla_qk_nope_head_dim": 16, "mla_qk_rope_head_dim": 8, "mla_v_head_dim": 12,
     "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16, "moe_first_dense_layers": 1,
     "moe_router": "sigmoid", "moe_shared_expert_ffn_hidden_size": 16, "mtp_layers": 1},
    {"arch": "gpt_oss", "bias": True, "num_experts": 4, "moe_top_k": 2,
     "moe_ffn_hidden_size": 16, "moe_router_bias": True},
]
"""Tiny models whose parameters, together, include every kind the families have."""


def update_table() -> str:
    """The README's table: each parameter name (``N`` a layer or MTP index) under the update
    optim.name='muon' gives it (:func:`muon_matrices`; AdamW decays what
    :func:`~colonnade.optim.adamw.decays`)."""
    rows: dict[str, list[str]] = {"Muon": [], "Muon, one matrix per expert": [],
                                  "AdamW with weight decay": [], "AdamW, no weight decay": []}
    for fields in TABLE_MODELS:
        model = build_reference(Config(model=ModelConfig(
            num_layers=2, hidden_size=32, num_heads=4, vocab_size=101, max_seq_len=16,
            **fields)))
        for p in model.parameters():
            found = muon_matrices(p)
            kind = (("Muon, one matrix per expert" if found.stacked else "Muon") if found
                    else "AdamW with weight decay" if decays(p) else "AdamW, no weight decay")
            rows[kind].append(re.sub(r"\.\d+\.", ".N.", p.sharding.key))  # type: ignore[attr-defined]
    lines = ["| Update | Parameters (`N`: a layer) |", "|---|---|"]
    lines += [f"| {kind} | {', '.join(f'`{k}`' for k in dict.fromkeys(keys))} |"
              for kind, keys in rows.items()]
    return "\n".join(lines)


def test_readme_optimizer_table_is_muon_matrices() -> None:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    table = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    expected = update_table()
    assert table == expected, f"the README's optimizer table should read:\n{expected}"


def test_split_matrices_cuts_an_expert_stack_per_expert() -> None:
    """A ZeRO-like range [5, 19) of a stacked [3, 2, 4] expert weight is three pieces, one per
    expert matrix, at offsets 0, 8, 16; a dense matrix is one piece; a 1-D one is AdamW's."""
    stack = torch.nn.Parameter(torch.zeros(3, 2, 4))
    stack.sharding = Sharding("layers.0.mlp.experts.up", (6, 2, 4),  # type: ignore[attr-defined]
                              splits=(("ep", 0),))
    assert muon_matrices(stack) == MuonMatrices(3, (2, 4), True)
    assert split_matrices(stack, 5, 19) == [(0, 5, 8, 0), (1, 0, 8, 8), (2, 0, 3, 16)]
    dense = torch.nn.Parameter(torch.zeros(4, 6))
    dense.sharding = Sharding("layers.0.attn.o.weight", (4, 12), dim=1)  # type: ignore[attr-defined]
    assert muon_matrices(dense) == MuonMatrices(1, (4, 12), False)
    assert split_matrices(dense, 3, 7) == [(None, 3, 7, 0)]
    norm = torch.nn.Parameter(torch.zeros(4))
    norm.sharding = Sharding("final_norm.weight", (4,))  # type: ignore[attr-defined]
    assert muon_matrices(norm) is None
