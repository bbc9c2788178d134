"""MuonClip's q/k logit clipping (optim.qk_clip_threshold, colonnade/optim/qk_clip.py).

* Single process, float64, 2 steps of 2 micro-batches: the Trainer with clipping against the
  same Trainer without it whose weights the test clips by hand after each update, from the
  logit maxima it computes itself (each attention layer's input captured, q and k projected,
  rotated and multiplied in plain torch, causal mask, max over micro-batches); grouped-query
  attention (4 query heads on 2 key heads) with q/k biases, document resets (a per-sample
  mask) and a sliding window on the second layer. tau splits the heads: some are
  clipped at every step and some are not (asserted), and the logged qk_clipped equals the
  hand count.
* tp2 and dp2 ZeRO-1 (and dp2 ZeRO-3: the master is the persistent shard) against that
  single-process run through the fuzzer's judge (loss, grad norm, every gathered gradient per
  step, parameters: 1e-10).
* The validator refuses cp > 1, MLA, q/k norm and out-of-range values, naming the fields.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from colonnade.config.load import ConfigError
from colonnade.config.sections import (
    Config,
    DataConfig,
    OptimConfig,
    ParallelConfig,
    TrainingConfig,
)
from colonnade.config.validate import problems, resolve
from colonnade.fuzz.compare import TOL
from colonnade.fuzz.run import global_batch, judge
from colonnade.fuzz.space import Case
from colonnade.parallel.pool import RankPools
from tests.parity import resolved, tiny_model

TAU = 4.0
"""Splits the heads of :func:`qk_config`'s model at both steps (asserted below)."""
ALPHA = 0.4
"""An uneven split, so a swapped q / k exponent shows."""
LR = 0.1
"""Large enough that the second update raises logits past tau again."""
EOD = 7
"""End-of-document token: attention does not cross documents (a per-sample mask)."""
WINDOW = 12
"""Sliding window of the second layer (the first attends causally)."""


def qk_config(parallel: ParallelConfig, microbatches: int = 2, tau: float = TAU,
              optimizer: str = "adamw") -> Config:
    """A llama with GQA and q/k biases, float64, 2 steps, clipping at ``tau`` after
    ``optimizer``'s update ('muon': MuonClip)."""
    model = dataclasses.replace(tiny_model("llama", layers=2, hidden=32, heads=4, kv_heads=2,
                                           bias=True, init_std=0.2), rope_theta=100.0,
                                sliding_window=WINDOW, sliding_window_layers=(1,))
    training = TrainingConfig(steps=2, seq_len=16, micro_batch_size=2, microbatches=microbatches,
                              precision="fp64", seed=5, eval_interval=0, device="cpu")
    optim = OptimConfig(name=optimizer, lr=LR, min_lr=1e-3, warmup_steps=0, decay="constant",
                        qk_clip_threshold=tau, qk_clip_alpha=ALPHA)
    data = DataConfig(reset_attention_mask=True)
    return Config(model=model, parallel=parallel, training=training, optim=optim, data=data)


# ----------------------------------------------------------------------------- by hand


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [b, s, n, d] rotated at positions 0 .. s-1: pairs (i, i + d/2), w_i = theta^(-2i/d)."""
    s, d = x.shape[1], x.shape[-1]
    w = theta ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)  # [d/2]
    ang = torch.arange(s, dtype=x.dtype)[:, None] * w  # [s, d/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # [s, 1, d/2]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def hand_logit_max(x: torch.Tensor, tokens: torch.Tensor, w: dict[str, torch.Tensor],
                   heads: int, kv: int, theta: float, window: int | None) -> torch.Tensor:
    """max over b, i and j allowed of q_h(i) . k_g(h)(j) / sqrt(d) per query head h: [heads];
    allowed: j <= i, i - j < window, no EOD of ``tokens`` [b, s] in positions j .. i - 1."""
    b, s, _ = x.shape
    q = (x @ w["qw"].T + w["qb"]).view(b, s, heads, -1)  # [b, s, a, d]
    k = (x @ w["kw"].T + w["kb"]).view(b, s, kv, -1)  # [b, s, kv, d]
    d = q.shape[-1]
    q, k = rope(q, theta), rope(k, theta).repeat_interleave(heads // kv, dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)  # [b, a, s, s]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    ok = (j <= i) & (i - j < (window or s))  # [s, s]
    ends = torch.cat([torch.zeros(b, 1, dtype=torch.long), (tokens == EOD).long()[:, :-1]], 1)
    doc = ends.cumsum(1)  # [b, s]: EODs before each position
    ok = ok & (doc[:, :, None] == doc[:, None, :])  # [b, s, s]
    return logits.masked_fill(~ok[:, None], -math.inf).amax(dim=(0, 2, 3))


@torch.no_grad()
def clip_by_hand(attn: Any, s_max: torch.Tensor, tau: float, alpha: float) -> int:
    """Scale the rows of W_q, b_q (per query head) and W_k, b_k (per key head: its group's
    largest logit) as MuonClip says; returns the query heads clipped."""
    heads, kv = attn.heads, attn.kv_heads
    d, group = attn.q.weight.shape[0] // heads, heads // kv
    for h in range(heads):
        if s_max[h] > tau:
            f = (tau / float(s_max[h])) ** alpha
            attn.q.weight[h * d:(h + 1) * d] *= f
            attn.q.bias[h * d:(h + 1) * d] *= f
    for g in range(kv):
        top = float(s_max[g * group:(g + 1) * group].max())
        if top > tau:
            f = (tau / top) ** (1.0 - alpha)
            attn.k.weight[g * d:(g + 1) * d] *= f
            attn.k.bias[g * d:(g + 1) * d] *= f
    return int((s_max > tau).sum())


def rank_hand_check(config: Config) -> dict[str, Any]:
    """Pool rank (world 1): the clipping Trainer against the unclipped one clipped by hand."""
    from colonnade.models.blocks import Attention, DocReset
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime, build_groups

    torch.set_num_threads(1)
    groups = build_groups(config, 1)
    off = dataclasses.replace(config, optim=dataclasses.replace(config.optim,
                                                                qk_clip_threshold=0.0))
    clip = Trainer(Runtime(config, torch.device("cpu"), groups), None)
    ref = Trainer(Runtime(off, torch.device("cpu"), groups), None)
    for chunk in clip.chunks + ref.chunks:
        chunk.doc_reset = DocReset(EOD, positions=False, attention=True)
    layers = [m for c in ref.chunks for m in c.modules() if isinstance(m, Attention)]
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
    for i, attn in enumerate(layers):
        attn.register_forward_pre_hook(lambda _m, args, i=i: inputs[i].append(args[0].clone()))
    counts, logged, maxima = [], [], []
    m, o = config.model, config.optim
    for step in range(config.training.steps):
        batches = global_batch(config, step, EOD)
        before = [{"qw": a.q.weight.detach().clone(), "qb": a.q.bias.detach().clone(),
                   "kw": a.k.weight.detach().clone(), "kb": a.k.bias.detach().clone()}
                  for a in layers]
        for seen in inputs.values():
            seen.clear()
        ref.train_step(batches)
        count = 0
        for i, attn in enumerate(layers):
            window = WINDOW if i == 1 else None
            s_max = torch.stack([hand_logit_max(x, tokens, before[i], attn.heads, attn.kv_heads,
                                                m.rope_theta, window)
                                 for x, (tokens, _) in zip(inputs[i], batches, strict=True)])
            s_max = s_max.amax(0)
            maxima.append(s_max.tolist())
            count += clip_by_hand(attn, s_max, o.qk_clip_threshold, o.qk_clip_alpha)
        counts.append(count)
        logged.append(clip.train_step(batches)["qk_clipped"])
    got = dict(clip.chunks[0].named_parameters())
    with torch.no_grad():
        err = max(float((got[k] - p).norm() / p.norm())
                  for k, p in ref.chunks[0].named_parameters())
    return {"counts": counts, "logged": logged, "err": err, "maxima": maxima,
            "heads": sum(a.heads for a in layers)}


def test_single_process_matches_hand_clipping(run_ranks: Any) -> None:
    config = resolved(qk_config(ParallelConfig()))
    (res,) = run_ranks(1, rank_hand_check, config)
    assert res["logged"] == res["counts"], res
    assert all(0 < c < res["heads"] for c in res["counts"]), res  # some clipped, some not
    assert res["err"] <= 1e-12, res


# ----------------------------------------------------------------------------- parity


LAYOUTS = {
    "tp2-muonclip": (ParallelConfig(tp=2), 2, 2, "muon"),
    "dp2-zero1-muonclip": (ParallelConfig(zero_stage=1), 1, 2, "muon"),
    "dp2-zero3": (ParallelConfig(zero_stage=3), 1, 2, "adamw"),
    "tp2sp-pp2": (ParallelConfig(tp=2, sp=True, pp=2), 2, 4, "adamw"),
}
"""name -> (parallel, micro-batches per dp rank, world, optimizer): every reference is the
single-process run of the same optimizer (2 micro-batches of the same global batch); the
Muon layouts are MuonClip with the distributed Muon exchange (tp and ZeRO split matrices)."""


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_match_single_process(rank_pools: RankPools, name: str) -> None:
    parallel, micro, world, optimizer = LAYOUTS[name]
    config = qk_config(parallel, micro, optimizer=optimizer)
    verdict = judge(Case(0, 0, config, world, EOD), rank_pools, hf=False)
    assert verdict.verdict == "match", (verdict.verdict, verdict.worst, verdict.detail)
    assert verdict.errors["params"] <= TOL and verdict.errors["grads"] <= TOL, verdict.errors


# ----------------------------------------------------------------------------- validator


def test_validator_refuses_what_is_not_supported() -> None:
    base = qk_config(ParallelConfig())
    cases = {
        "parallel.cp=2": dataclasses.replace(base, parallel=ParallelConfig(cp=2)),
        "multi-head latent attention": dataclasses.replace(base, model=dataclasses.replace(
            base.model, arch="deepseek_v3", mla_kv_lora_rank=16, mla_qk_nope_head_dim=8,
            mla_qk_rope_head_dim=8, mla_v_head_dim=8, num_kv_heads=None, bias=False)),
        "model.arch='qwen3'": dataclasses.replace(base, model=dataclasses.replace(
            base.model, arch="qwen3")),
        "optim.qk_clip_alpha=1.5": dataclasses.replace(base, optim=dataclasses.replace(
            base.optim, qk_clip_alpha=1.5)),
        "optim.qk_clip_threshold=-1": dataclasses.replace(base, optim=dataclasses.replace(
            base.optim, qk_clip_threshold=-1.0)),
    }
    for needle, config in cases.items():
        found = [p for p in problems(resolve(config, 2 if "cp" in needle else 1))
                 if "qk_clip" in p]
        assert len(found) == 1 and needle in found[0], (needle, found)
        assert "set " in found[0] or "must be" in found[0], found
    off = dataclasses.replace(base, parallel=ParallelConfig(cp=2), optim=dataclasses.replace(
        base.optim, qk_clip_threshold=0.0))
    assert not [p for p in problems(resolve(off, 2)) if "qk_clip" in p]
    with pytest.raises(ConfigError, match=r"parallel\.cp=2"):
        resolved(cases["parallel.cp=2"], 2)


def test_log_line_shows_clipped_heads() -> None:
    from colonnade.training.metrics import format_line

    assert "qk_clipped 5" in format_line({"step": 1, "loss": 2.0, "qk_clipped": 5.0})
    assert "qk_clipped" not in format_line({"step": 1, "loss": 2.0})
