"""Muon (colonnade/optim/muon.py) against an independent plain-PyTorch Muon written here from
the published algorithm (Keller Jordan's quintic Newton-Schulz; Moonlight's update scale), with
torch.optim.AdamW for the parameters Muon does not take; and its parity across layouts."""

from __future__ import annotations

import math
import re

import pytest
import torch

from colonnade.config.sections import Config, ModelConfig, OptimConfig, TrainingConfig
from colonnade.config.validate import resolve
from colonnade.fuzz.compare import rel_err
from colonnade.fuzz.run import global_batch, rank_case
from colonnade.models.build import build_reference
from colonnade.optim.clip import clip_coefficient
from colonnade.optim.lr import lr_at

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
    rest = [p for n, p in named.items() if n not in muon]
    adamw = torch.optim.AdamW(
        [{"params": [p for p in rest if p.dim() > 1], "weight_decay": o.weight_decay},
         {"params": [p for p in rest if p.dim() <= 1], "weight_decay": 0.0}],
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
        for p in rest:
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
