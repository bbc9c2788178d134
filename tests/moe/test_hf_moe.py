"""Hugging Face interop for mixture-of-experts models: random tiny ``MixtralForCausalLM`` and
``Qwen2MoeForCausalLM`` (shared expert + gate, q/k/v biases, a dense first layer, top k not
renormalised) made here, imported, compared logit for logit with transformers, exported back
losslessly, and loaded into an ep2 run (and exported from it) with the same logits."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

VOCAB, SEQ, HIDDEN = 67, 12, 32


def _hf_model(kind: str) -> Any:
    """A random transformers MoE model (no download), every weight randomised."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                  rope_theta=500.0, num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=4,
                                         rms_norm_eps=1e-5)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2MoeConfig(
            **common, intermediate_size=56, moe_intermediate_size=24, num_experts=4,
            shared_expert_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[0],
            decoder_sparse_step=1, qkv_bias=True, rms_norm_eps=1e-6)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 and p.shape[0] == HIDDEN
                                                 else 0.0))
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _save(model: Any, directory: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_import_logits_and_lossless_round_trip(tmp_path: Path, kind: str) -> None:
    """HF -> Colonnade: config mapped, logits equal transformers'; -> HF again: the same
    tensor names and bytes, a config transformers loads, identical logits."""
    from safetensors.torch import load_file

    from colonnade.checkpoint.convert import from_hf
    from colonnade.checkpoint.export import load_exported
    from colonnade.hf_export import to_hf

    model = _hf_model(kind)
    hf_dir = _save(model, tmp_path / "hf")
    from_hf(hf_dir, tmp_path / "ck")
    cfg, ours = load_exported(tmp_path / "ck")
    m = cfg.model
    assert (m.num_experts, m.moe_top_k, m.moe_router) == (4, 2, "softmax")
    assert m.arch == {"mixtral": "mistral", "qwen2_moe": "qwen2"}[kind]
    if kind == "mixtral":
        assert (m.expert_ffn_size, m.moe_norm_topk_prob, m.qkv_bias) == (48, True, False)
    else:
        assert (m.expert_ffn_size, m.ffn_size, m.moe_shared_expert_ffn_hidden_size) == (24, 56, 40)
        assert (m.moe_norm_topk_prob, m.qkv_bias, m.moe_first_dense_layers) == (False, True, 1)
        assert [m.is_moe_layer(i) for i in range(3)] == [False, True, True]
    tokens = _tokens()
    with torch.no_grad():
        ref = model(tokens).logits  # [b, s, V]
        err = float((ours.full_logits(tokens) - ref).abs().max())
    assert err <= 5e-5, f"max |logits diff| {err:.2e}"  # fp32, |logits| ~ 10
    assert float(ref.abs().max()) > 1.0

    out = to_hf(tmp_path / "ck", tmp_path / "hf2")
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    assert any(".experts.3." in k for k in a)  # per-expert layout, as the Hub stores it
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = type(model).from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, ref)


def _ep2_logits(hf_dir: str, out_dir: str, tp: int = 1, etp: int = 1) -> torch.Tensor | None:
    """Rank side (2 ranks, ep=2: each rank holds 2 of the 4 experts of every MoE layer; with
    ``tp`` = 2 the dense weights are tp-split too, sp on, ep folded into tp; with ``etp`` = 2
    ep = 1 and every expert's f is split over the two ranks instead): load the HF dir,
    forward the same tokens on both ranks (tokens cross ranks in the all-to-all), return rank
    0's logits [b, s, V]; then export the live run to ``out_dir``."""
    from colonnade.checkpoint.hf import load_hf_into_chunks, read_hf
    from colonnade.config.sections import Config, ParallelConfig, TrainingConfig
    from colonnade.config.validate import resolve
    from colonnade.hf_export import write_hf_from_run
    from colonnade.models.build import build_chunks
    from colonnade.parallel.dims import ParallelDims
    from colonnade.parallel.groups import ProcessGroups

    torch.set_num_threads(1)
    model_cfg, _ = read_hf(hf_dir)
    from colonnade.tensor_parallel import mappings as mp

    par = ParallelConfig(ep=2 // etp, expert_tp=etp, tp=tp, sp=tp > 1)
    cfg = resolve(Config(model=model_cfg, parallel=par, training=TrainingConfig(precision="fp32")),
                  world_size=2)
    groups = ProcessGroups.build(ParallelDims.from_config(cfg.parallel, 2), experts=True)
    (chunk,) = build_chunks(cfg, groups)
    expert = chunk.get_parameter("layers.1.mlp.experts.gate")
    assert expert.shape[:2] == (4 // par.ep, model_cfg.expert_ffn_size // etp)  # [E/ep, f/etp]
    load_hf_into_chunks([chunk], groups, hf_dir)
    chunk.eval()
    with torch.no_grad():
        y = mp.gather_last(chunk(_tokens()), groups.tp)  # [s, b, V']
        logits = y.transpose(0, 1)[..., :VOCAB].contiguous()  # [b, s, V]
    write_hf_from_run(out_dir, cfg.model, [chunk], groups)
    return logits if groups.world.rank == 0 else None


@pytest.mark.parametrize(("kind", "tp", "etp"), [("mixtral", 1, 1), ("qwen2_moe", 1, 1),
                                                 ("qwen2_moe", 2, 1), ("qwen2_moe", 1, 2)])
def test_ep2_load_and_live_export(run_ranks: Callable[..., list[Any]], tmp_path: Path,
                                  kind: str, tp: int, etp: int) -> None:
    """An imported model split over ep2 (or over expert tp 2) gives transformers' logits;
    exporting the live run writes back the original tensors."""
    from safetensors.torch import load_file

    model = _hf_model(kind)
    hf_dir = _save(model, tmp_path / "hf")
    with torch.no_grad():
        ref = model(_tokens()).logits
    out = [r for r in run_ranks(2, _ep2_logits, str(hf_dir), str(tmp_path / "live"), tp, etp)
           if r is not None]
    err = float((out[0] - ref).abs().max())
    assert err <= 5e-5, f"max |logits diff| {err:.2e}"  # fp32, |logits| ~ 10
    a = load_file(str(hf_dir / "model.safetensors"))
    b = load_file(str(tmp_path / "live" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_what_hf_cannot_express_is_refused() -> None:
    """A sigmoid router, capacity, or a Qwen2-MoE layer pattern HF cannot say: named."""
    from colonnade.checkpoint.hf import hf_config_from_model
    from colonnade.config.sections import ModelConfig

    base = dict(arch="llama", num_layers=4, hidden_size=32, num_heads=4, num_experts=4)
    with pytest.raises(ValueError, match="moe_router='sigmoid'"):
        hf_config_from_model(ModelConfig(**base, moe_router="sigmoid"))
    with pytest.raises(ValueError, match="moe_capacity_factor"):
        hf_config_from_model(ModelConfig(**base, moe_capacity_factor=1.0))
    qwen = dict(base, moe_shared_expert_ffn_hidden_size=8, moe_shared_expert_gate=True,
                moe_layer_freq=2)
    with pytest.raises(ValueError, match="moe_first_dense_layers=2"):
        hf_config_from_model(ModelConfig(**qwen, moe_first_dense_layers=2))
    ok = hf_config_from_model(ModelConfig(**qwen, moe_first_dense_layers=3))
    assert ok["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (ok["decoder_sparse_step"], ok["mlp_only_layers"]) == (2, [1])
    assert hf_config_from_model(ModelConfig(**base))["architectures"] == ["MixtralForCausalLM"]


def _init_from_logits(source: str) -> torch.Tensor | None:
    """Rank side (2 ranks, ep=2): a Trainer whose model comes from ``checkpoint.init_from``
    (an HF directory or the Colonnade checkpoint converted from it), weights loaded by
    ``init_weights``; rank 0's logits [b, s, V]."""
    from colonnade.checkpoint.finetune import init_weights, with_init_from
    from colonnade.config.sections import (
        CheckpointConfig,
        Config,
        ParallelConfig,
        TrainingConfig,
    )
    from colonnade.config.validate import resolve, validate
    from colonnade.parallel.dims import ParallelDims
    from colonnade.parallel.groups import ProcessGroups
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    torch.set_num_threads(1)
    cfg = Config(checkpoint=CheckpointConfig(init_from=source), parallel=ParallelConfig(ep=2),
                 training=TrainingConfig(precision="fp32", seq_len=SEQ, micro_batch_size=2,
                                         eval_interval=0))
    cfg = validate(resolve(with_init_from(cfg), 2), 2)
    groups = ProcessGroups.build(ParallelDims.from_config(cfg.parallel, 2), experts=True)
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups), None)
    init_weights(trainer, source)
    (chunk,) = trainer.chunks
    chunk.eval()
    with torch.no_grad():
        logits = chunk(_tokens()).transpose(0, 1)[..., :VOCAB].contiguous()  # [b, s, V]
    return logits if groups.world.rank == 0 else None


def test_cli_convert_and_init_from_ep2(run_ranks: Callable[..., list[Any]],
                                       tmp_path: Path) -> None:
    """``colonnade convert --from-hf / --to-hf`` on Qwen2-MoE, and ``--init-from`` of both the
    HF directory and the converted checkpoint into an ep2 run: transformers' logits."""
    from safetensors.torch import load_file

    from colonnade.cli import main

    model = _hf_model("qwen2_moe")
    hf_dir = _save(model, tmp_path / "hf")
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "o")]) == 0
    a = load_file(str(hf_dir / "model.safetensors"))
    b = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        ref = model(_tokens()).logits
    for source in (hf_dir, tmp_path / "ck"):
        out = [r for r in run_ranks(2, _init_from_logits, str(source)) if r is not None]
        err = float((out[0] - ref).abs().max())
        assert err <= 5e-5, f"{source.name}: max |logits diff| {err:.2e}"


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_float64_logits(tmp_path: Path, kind: str) -> None:
    """In float64 too (transformers' eager experts; its grouped_mm has no fp64). Both routers
    take softmax in fp32 (ours of fp32 logits, transformers' of fp64 logits cast to fp32), so
    the routing weights agree to ~1e-7 relative and the logits to ~1e-6 (|logits| ~ 6)."""
    from colonnade.checkpoint.convert import from_hf
    from colonnade.checkpoint.export import load_exported

    model = _hf_model(kind)
    from_hf(_save(model, tmp_path / "hf"), tmp_path / "ck")
    model.set_experts_implementation("eager")
    model = model.double()
    _, ours = load_exported(tmp_path / "ck", dtype=torch.float64)
    tokens = _tokens()
    with torch.no_grad():
        ref = model(tokens).logits  # [b, s, V] float64
        err = float((ours.full_logits(tokens) - ref).abs().max())
    assert ref.dtype == torch.float64 and float(ref.abs().max()) > 1.0
    assert err <= 2e-5, f"max |logits diff| {err:.2e}"


def test_greedy_generation_with_kv_cache_matches_transformers(tmp_path: Path) -> None:
    """``colonnade generate``'s path on an imported Mixtral (KV cache: one position through the
    MoE layers per step) gives transformers' greedy tokens, and the same without the cache."""
    from colonnade.checkpoint.convert import from_hf
    from colonnade.checkpoint.export import load_exported
    from colonnade.generate import generate

    model = _hf_model("mixtral")
    from_hf(_save(model, tmp_path / "hf"), tmp_path / "ck")
    _, ours = load_exported(tmp_path / "ck")
    prompt = _tokens()[:, :4]  # [2, 4]
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = generate(ours, prompt, 8, temperature=0.0)
    assert torch.equal(got, want), (got, want)
    assert torch.equal(generate(ours, prompt, 8, temperature=0.0, use_cache=False), want)
