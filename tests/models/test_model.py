"""Model shapes, parameter counts, Megatron-style init, causality, and layout-independent init.

Llama: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head. GPT-2: LayerNorm, learned
positions, GELU, biases, tied head. Activations are [s, b, h]; tokens and labels [b, s].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.config import Config, load_config
from colonnade.models.build import build_chunks, build_reference
from colonnade.models.counts import param_count
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups

ARCHS = {
    "llama": ["--model.arch=llama", "--model.num_kv_heads=2"],
    "gpt2": ["--model.arch=gpt2", "--model.tie_embeddings=true", "--model.bias=true"],
}


def tiny(arch: str, *extra: str) -> Config:
    """A 2-layer, h=32, 4-head model with an odd vocabulary (101: padded under tp)."""
    return load_config(None, [*ARCHS[arch], "--model.hidden_size=32", "--model.num_layers=2",
                              "--model.num_heads=4", "--model.vocab_size=101",
                              "--model.max_seq_len=32", "--training.seq_len=16", *extra])


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_parameter_shapes(arch: str) -> None:
    cfg = tiny(arch)
    model = build_reference(cfg)
    shapes = {p.sharding.key: tuple(p.shape) for p in model.parameters()}
    h, d, f, v = 32, 8, cfg.model.ffn_size, 101
    kv = 2 if arch == "llama" else 4
    assert shapes["embedding.word.weight"] == (v, h)
    assert shapes["layers.1.attn.q.weight"] == (4 * d, h)
    assert shapes["layers.1.attn.k.weight"] == (kv * d, h)
    assert shapes["layers.1.attn.v.weight"] == (kv * d, h)
    assert shapes["layers.1.attn.o.weight"] == (h, 4 * d)
    assert shapes["layers.0.mlp.up.weight"] == (f, h)
    assert shapes["layers.0.mlp.down.weight"] == (h, f)
    if arch == "llama":
        assert f == 128  # round_up(8 * 32 / 3, 64)
        assert shapes["layers.0.mlp.gate.weight"] == (f, h)
        assert shapes["head.weight"] == (v, h)
        assert not any(k.endswith("bias") for k in shapes)
        assert "embedding.position.weight" not in shapes
    else:
        assert f == 4 * h
        assert "layers.0.mlp.gate.weight" not in shapes
        assert shapes["embedding.position.weight"] == (32, h)
        assert shapes["layers.0.attn.q.bias"] == (4 * d,)
        assert shapes["final_norm.bias"] == (h,)
        assert "head.weight" not in shapes  # the head *is* the embedding
        assert model.head.weight is model.embedding.word.weight


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("extra", [[], ["--model.num_layers=3", "--model.ffn_hidden_size=40"]])
def test_param_count_matches_metrics(arch: str, extra: list[str]) -> None:
    cfg = tiny(arch, *extra)
    model = build_reference(cfg)
    counted = sum(p.numel() for p in model.parameters())  # tied head counted once
    assert counted == param_count(cfg.model)["total"]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_forward_shapes_and_initial_loss(arch: str) -> None:
    cfg = tiny(arch)
    model = build_reference(cfg, torch.float64)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 101, (3, 16), generator=gen)  # [b, s]
    labels = torch.randint(0, 101, (3, 16), generator=gen)
    logits = model(tokens)  # [s, b, V]
    assert logits.shape == (16, 3, 101) and logits.dtype == torch.float64
    hidden = model.embedding(tokens)
    assert hidden.shape == (3, 16, 32)  # [b, s, h]: batch-first without sp and cp
    assert model.run_layers(hidden).shape == (3, 16, 32)
    full = model.full_logits(tokens)  # [b, s, V]
    torch.testing.assert_close(full, logits.transpose(0, 1))
    loss = model(tokens, labels)
    assert loss.shape == ()
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 101), labels.t().reshape(-1))
    torch.testing.assert_close(loss, ref)
    assert abs(float(loss.detach()) - math.log(101)) < 0.1  # small init: near-uniform predictions
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_causal(arch: str) -> None:
    model = build_reference(tiny(arch), torch.float64)
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 5) % 101
    a, b = model.full_logits(tokens), model.full_logits(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-12)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4


def test_megatron_init_statistics() -> None:
    cfg = load_config(None, ["--model.hidden_size=128", "--model.num_layers=8",
                             "--model.num_heads=4", "--model.vocab_size=512",
                             "--model.init_std=0.05"])
    model = build_reference(cfg)
    params = {p.sharding.key: p for p in model.parameters()}
    scaled = 0.05 / math.sqrt(2 * 8)
    for key, std in [("layers.0.attn.q.weight", 0.05), ("embedding.word.weight", 0.05),
                     ("layers.3.mlp.up.weight", 0.05), ("layers.3.attn.o.weight", scaled),
                     ("layers.5.mlp.down.weight", scaled)]:
        p = params[key].detach()
        assert abs(float(p.mean())) < 0.1 * std, key
        assert float(p.std()) == pytest.approx(std, rel=0.05), key
    assert bool((params["layers.2.attn_norm.weight"] == 1).all())
    # different names draw different values, the same seed the same ones
    assert not torch.equal(params["layers.0.attn.q.weight"], params["layers.1.attn.q.weight"])
    again = {p.sharding.key: p for p in build_reference(cfg).parameters()}
    assert all(torch.equal(again[k], v) for k, v in params.items())
    other = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seed=7))
    moved = {p.sharding.key: p for p in build_reference(other).parameters()}
    assert not torch.equal(moved["layers.0.attn.q.weight"], params["layers.0.attn.q.weight"])


# ----------------------------------------------------------------------------- layouts


def _local_params(arch: str, tp: int, pp: int, sp: bool) -> dict[str, Any]:
    """This rank's parameters (shards) by global name, with their shardings."""
    cfg = tiny(arch, f"--parallel.tp={tp}", f"--parallel.pp={pp}", f"--parallel.sp={sp}")
    groups = ProcessGroups.build(ParallelDims(tp=tp, pp=pp))
    chunks = build_chunks(cfg, groups)
    out: dict[str, Any] = {"tp_rank": groups.tp_rank, "pp_rank": groups.pp_rank, "params": {}}
    for chunk in chunks:
        for p in chunk.parameters():
            out["params"][p.sharding.key] = (p.detach().clone(), p.sharding)
    return out


@pytest.mark.parametrize(("arch", "tp", "pp", "sp"), [
    ("llama", 2, 1, False), ("gpt2", 2, 1, True), ("gpt2", 1, 2, False), ("llama", 1, 2, False),
])
def test_init_identical_across_layouts(run_ranks: Callable[..., list[Any]], arch: str, tp: int,
                                       pp: int, sp: bool) -> None:
    reference = {p.sharding.key: p.detach() for p in build_reference(tiny(arch)).parameters()}
    results = run_ranks(2, _local_params, arch, tp, pp, sp)
    seen: set[str] = set()
    for stage in range(pp):
        ranks = sorted((r for r in results if r["pp_rank"] == stage), key=lambda r: r["tp_rank"])
        for key in ranks[0]["params"]:
            _shard, sharding = ranks[0]["params"][key]
            shards = [r["params"][key][0] for r in ranks]
            if sharding.dim is not None and tp > 1:
                rows = sharding.full_shape[sharding.dim] + sharding.padded_rows
                assert shards[0].shape[sharding.dim] == rows // tp, key
                if shards[0].ndim > 1:  # random weights: every shard is a different slice
                    assert all(not torch.equal(shards[0], s) for s in shards[1:]), key
            full = sharding.unshard(shards)
            ref_key = key  # a tied head's copy carries the embedding's key
            assert torch.equal(full, reference[ref_key]), key
            if sharding.padded_rows:
                pad = shards[-1].narrow(sharding.dim, shards[-1].shape[sharding.dim]
                                        - sharding.padded_rows, sharding.padded_rows)
                assert bool((pad == 0).all()), key
            seen.add(key if key in reference else ref_key)
    assert seen == set(reference)  # every parameter exists in the layout
