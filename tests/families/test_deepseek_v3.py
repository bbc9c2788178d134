"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) through the family harness: multi-head latent
attention (q rank, kv rank, interleaved rope part), a dense first layer, then MoE layers with
the sigmoid router limited to 1 of 2 expert groups, a random selection bias, routed scaling
and a shared expert; transformers' logits, loss, gradients, greedy text and a bit-for-bit round
trip; the single-process run's losses and parameters under each layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from colonnade.config.sections import ModelConfig
from tests.families.harness import Layout, check_layouts, hf_check, randomize, tiny

HF_TINY = {"vocab_size": 67, "hidden_size": 32, "intermediate_size": 48,
           "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
           "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "kv_lora_rank": 16,
           "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
           "max_position_embeddings": 64,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                               "original_max_position_embeddings": 16, "mscale": 1.0,
                               "mscale_all_dim": 0.8},
           "tie_word_embeddings": False, "num_nextn_predict_layers": 0}
"""A tiny DeepSeek-V3: d = 16 + 8 != d_v = 12 (so v's width differs from q's and k's); YaRN
as DeepSeek-V3 has it, with mscale != mscale_all_dim so that both the rope tables' attention
factor and MLA's softmax factor differ from 1."""

MLA = {"mla_kv_lora_rank": 16, "mla_q_lora_rank": 24, "mla_qk_nope_head_dim": 16,
       "mla_qk_rope_head_dim": 8, "mla_v_head_dim": 12}
"""The same attention as Colonnade model fields."""

MOE = {"num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16, "moe_first_dense_layers": 1,
       "moe_router": "sigmoid", "moe_n_group": 2, "moe_topk_group": 1,
       "moe_routed_scaling_factor": 2.5, "moe_shared_expert_ffn_hidden_size": 16}
"""The layout runs' experts (fewer, so ep2 holds two each)."""


def test_deepseek_v3_against_transformers(tmp_path: Path) -> None:
    model = randomize(transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**HF_TINY)))
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers[1:]:  # a selection bias that changes the choice
        layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.3)
    ours = hf_check(model, tmp_path, vocab=67)
    assert (ours.arch, ours.mla_q_lora_rank, ours.mla_v_head_dim, ours.moe_n_group,
            ours.moe_topk_group, ours.moe_routed_scaling_factor,
            ours.moe_shared_expert_ffn_hidden_size, ours.moe_first_dense_layers,
            ours.rope_scaling, ours.rope_mscale_all_dim) == (
        "deepseek_v3", 24, 12, 2, 1, 2.5, 16, 1, "yarn", 0.8)


def _with_mtp(model: Any, hf_dir: Path) -> Any:
    """Add a random multi-token-prediction module to the saved folder of ``model`` (layer 3 of
    a 3-layer model, as DeepSeek-V3's layer 61: an MoE decoder layer plus enorm, hnorm,
    eh_proj, shared_head.norm, embed_tokens and shared_head.head) and set
    num_nextn_predict_layers = 1. Returns the layer (transformers' class, in memory)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg = model.config
    layer = randomize(DeepseekV3DecoderLayer(cfg, layer_idx=3), seed=1)
    gen = torch.Generator().manual_seed(2)
    layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.3)
    h, v = cfg.hidden_size, cfg.vocab_size
    extra = {n: torch.randn(shape, generator=gen) * 0.3 + (1.0 if n.endswith("norm") else 0.0)
             for n, shape in (("enorm", (h,)), ("hnorm", (h,)), ("eh_proj", (h, 2 * h)),
                              ("shared_head.norm", (h,)), ("embed_tokens", (v, h)),
                              ("shared_head.head", (v, h)))}
    tensors = load_file(str(hf_dir / "model.safetensors"))
    state = {f"model.layers.3.{k}": t for k, t in layer.state_dict().items()}
    tensors |= {k: t.contiguous() for k, t in revert_weight_conversion(model, state).items()}
    tensors |= {f"model.layers.3.{n}.weight": t for n, t in extra.items()}
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    layer.extra = extra
    return layer


def test_mtp_against_transformers_layers(tmp_path: Path) -> None:
    """A DeepSeek-V3 folder with one MTP module (what DeepSeek's checkpoint holds as layer 61):
    imported, its MTP loss (sum over the valid positions of CE(head(norm(layer(W_eh [enorm(
    Emb(t_{i+1})); hnorm(h_i)]))), t_{i+2})) equals the same composition of transformers' own
    decoder layer in float64; exported bit for bit. A folder whose config says
    num_nextn_predict_layers=1 but holds no MTP weights (transformers saves none) is read
    without MTP."""
    from safetensors.torch import load_file

    from colonnade.checkpoint.convert import from_hf
    from colonnade.checkpoint.export import load_exported
    from colonnade.fuzz.hf_twin import float64_softmax, float64_twin, rms_norm_fp64
    from colonnade.hf_export import to_hf
    from colonnade.models.counts import param_count
    from colonnade.models.mtp import mtp_loss, shifted
    from tests.families.harness import save_hf

    model = randomize(transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**HF_TINY)))
    plain = save_hf(model, tmp_path / "plain")
    (plain / "config.json").write_text((plain / "config.json").read_text().replace(
        '"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1'))
    from_hf(plain, tmp_path / "ck0")
    plain_cfg = load_exported(tmp_path / "ck0")[0].model
    assert plain_cfg.mtp_layers == 0
    hf_dir = save_hf(model, tmp_path / "hf")
    layer = _with_mtp(model, hf_dir)
    from_hf(hf_dir, tmp_path / "ck")
    config, ours = load_exported(tmp_path / "ck", dtype=torch.float64)
    assert config.model.mtp_layers == 1
    held = sum(p.numel() for p in ours.parameters())  # the counter's mtp entry included
    assert held == param_count(config.model)["total"] > param_count(plain_cfg)["total"]
    out = to_hf(tmp_path / "ck", tmp_path / "hf2")
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    tokens = torch.randint(0, 67, (2, 13), generator=torch.Generator().manual_seed(5))
    tokens, labels = tokens[:, :-1], tokens[:, 1:]
    ours.train()
    x = ours.run_layers(ours.embedding(tokens))
    mine = mtp_loss(ours.mtp, ours.final_norm(x), tokens, labels, ours.rope, None, 0.0)
    theirs = float64_twin(model, config.model).train()
    ref_layer = type(layer)(theirs.config, layer_idx=3)
    ref_layer.load_state_dict(layer.state_dict())
    ref_layer = ref_layer.double().train()
    for module in ref_layer.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = rms_norm_fp64.__get__(module)
    w = {n: t.double() for n, t in layer.extra.items()}
    eps = theirs.config.rms_norm_eps

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    with float64_softmax():
        h = theirs.model(tokens).last_hidden_state  # [b, s, h], after the final norm
        e = w["embed_tokens"][shifted(tokens, 1, 0)]  # [b, s, h]
        y = torch.cat([rms(e, w["enorm"]), rms(h, w["hnorm"])], -1) @ w["eh_proj"].T
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)
        y = ref_layer(y, position_embeddings=theirs.model.rotary_emb(y, pos))
        logits = rms(y, w["shared_head.norm"]) @ w["shared_head.head"].T  # [b, s, V]
        ref = torch.nn.functional.cross_entropy(
            logits.reshape(-1, 67), shifted(labels, 1, -100).reshape(-1), reduction="sum")
    err = float(((mine - ref).abs() / ref.abs()).detach())
    assert err <= 1e-10, err


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_mla_activation_bytes_match_the_planner(dtype: torch.dtype) -> None:
    """The bytes an MLA layer keeps for backward, measured, equal the planner's model to the
    byte without recompute and with selective and full recompute (v padded to d: the fused
    kernel, no s x s probabilities)."""
    from colonnade.analysis.activations import ActivationShape, chunk_layer_bytes
    from tests.recompute.harness import measured_layer_bytes, tiny_config

    base = tiny_config("llama", layers=2, dropout=0.0, seq=32)
    config = dataclasses.replace(base, model=dataclasses.replace(
        base.model, arch="deepseek_v3", num_kv_heads=None, **MLA))
    m, tr = config.model, config.training
    shape = ActivationShape.from_model(m, tr.seq_len, tr.micro_batch_size, dtype=dtype)
    for plan, got in measured_layer_bytes(config, dtype):
        assert got == chunk_layer_bytes(shape, plan, m.num_layers) / m.num_layers, plan


def _cp_layer_bytes(cp: int, kind: str, mode: str) -> tuple[float, float]:
    """Rank side: (measured, planned) bytes one MLA layer keeps on this cp rank (seq 64)."""
    from colonnade.analysis.activations import ActivationShape, layer_bytes
    from colonnade.analysis.measure import SavedTensorMeter
    from colonnade.models.build import build_chunks
    from colonnade.models.recompute import RecomputePlan, install
    from colonnade.parallel.dims import ParallelDims
    from tests.context_parallel.harness import cp_config
    from tests.parity import rank_groups

    config = cp_config(cp=cp, cp_attention=kind, seq=64)
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, arch="deepseek_v3", num_kv_heads=None, **MLA))
    (chunk,) = build_chunks(config, rank_groups(ParallelDims(cp=cp)), dtype=torch.float64)
    install([chunk], RecomputePlan(mode))
    chunk.train()
    gen = torch.Generator().manual_seed(3)
    b, vocab = config.training.micro_batch_size, config.model.vocab_size
    tokens, labels = (torch.randint(0, vocab, (b, 64), generator=gen) for _ in range(2))
    with SavedTensorMeter([chunk]) as meter:
        loss = chunk(tokens, labels, reduction="sum")
    loss.backward()
    per_layer = meter.per_layer()
    shape = dataclasses.replace(ActivationShape.from_model(
        config.model, 64, b, dtype=torch.float64), cp=cp, cp_attention=kind)
    return sum(per_layer.values()) / len(per_layer), layer_bytes(shape, mode)


def test_mla_cp_activation_bytes_match_the_planner(run_ranks: Callable[..., list[Any]]) -> None:
    """Under cp2 an MLA layer keeps what the planner says: ring to the byte (selective
    recompute does not checkpoint it), all_to_all within 64 B; RoPE's gathered cos / sin at
    d_r."""
    for mode in ("none", "selective"):
        for kind in ("ring", "all_to_all"):
            for measured, planned in run_ranks(2, _cp_layer_bytes, 2, kind, mode):
                assert abs(measured - planned) <= (0 if kind == "ring" else 64), (
                    kind, mode, measured, planned)


def _rank_params(model: ModelConfig, tp: int) -> tuple[int, int, int]:
    """Rank side: parameters a tp rank of ``model`` holds (one stage), its largest layer
    parameter and the parameters of its largest layer module (attention or MLP)."""
    from colonnade.config.sections import Config, ParallelConfig
    from colonnade.models.build import build_chunks
    from tests.recompute.harness import rank_groups

    config = Config(model=model, parallel=ParallelConfig(tp=tp))
    (chunk,) = build_chunks(config, rank_groups(config), dtype=torch.float32)
    layer = chunk.layers["0"]
    modules = [sum(p.numel() for p in mod.parameters()) for mod in (layer.attn, layer.mlp)]
    return (sum(p.numel() for p in chunk.parameters()),
            max(p.numel() for p in layer.parameters()), max(modules))


def test_planner_stage_params_of_mla_under_tp(run_ranks: Callable[..., list[Any]]) -> None:
    """The planner's parameters per tp rank count MLA's replicated down projections and latent
    norms whole (h (r_q + r + d_r) + r_q + r per layer) and split the rest, and its largest
    layer parameter and module (ZeRO-2/3 bucket and gather sizes) are MLA's: equal to a built
    tp2 rank's."""
    from colonnade.analysis.layout import Layout as PlanLayout
    from colonnade.analysis.memory import largest_module, largest_param, stage_params
    from colonnade.models.counts import LayerShape

    model = dataclasses.replace(_model(), vocab_size=68)  # no vocabulary padding at tp2
    held = run_ranks(2, _rank_params, model, 2)
    shape, lay = LayerShape.of(model), PlanLayout(tp=2)
    assert held[0] == held[1]
    assert held[0] == (stage_params(shape, lay, "only"), largest_param(shape, lay, "middle"),
                       largest_module(shape, lay, "middle"))


def _stage_params(model: ModelConfig) -> int:
    """Rank side: parameters this pp2 rank of ``model`` holds."""
    from colonnade.config.sections import Config, ParallelConfig
    from colonnade.models.build import build_chunks
    from tests.recompute.harness import rank_groups

    config = Config(model=model, parallel=ParallelConfig(pp=2))
    chunks = build_chunks(config, rank_groups(config), dtype=torch.float32)
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


def test_planner_counts_mtp_on_the_last_stage(run_ranks: Callable[..., list[Any]]) -> None:
    """pp2 with one multi-token-prediction module: the planner's parameters of the first and
    last stages (the module's layer, W_eh, norms, own embedding and head on the last; with
    experts its MoE layer's router, shared and routed experts too) equal a built rank's."""
    from colonnade.analysis.layout import Layout as PlanLayout
    from colonnade.analysis.memory import stage_params
    from colonnade.analysis.moe import (
        MoEShape,
        expert_params_per_rank,
        moe_nonexpert_delta_per_rank,
    )
    from colonnade.models.counts import LayerShape

    for model in (_model(mtp_layers=1), _model(**MOE, mtp_layers=1)):
        held = run_ranks(2, _stage_params, model)
        x, shape = MoEShape.of(model), LayerShape.of(model)
        planned = [stage_params(shape, PlanLayout(pp=2), stage)
                   + moe_nonexpert_delta_per_rank(x, 2, 1, stage)
                   + expert_params_per_rank(x, 2, 1, stage) for stage in ("first", "last")]
        assert held == planned, (model.moe, held, planned)


def test_deepseek_v3_config_refusals() -> None:
    """The validator names each field: MLA widths missing, MLA fields on another arch, a group
    limit on the softmax router, more experts than the eligible groups hold."""
    from colonnade.config.sections import Config
    from colonnade.config.validate import problems

    def found(**model: Any) -> str:
        return "\n".join(problems(Config(model=ModelConfig(**model))))

    assert "model.mla_kv_lora_rank=0 must be >= 1" in found(arch="deepseek_v3")
    assert "model.mla_* fields are set but model.arch='llama'" in found(mla_kv_lora_rank=16)
    assert "model.num_kv_heads=2: multi-head latent attention" in found(
        arch="deepseek_v3", num_kv_heads=2, **MLA)
    assert "model.moe_n_group=2: group-limited routing is built for" in found(
        num_experts=4, moe_n_group=2)
    assert "model.moe_top_k=4 exceeds the experts of model.moe_topk_group=1" in found(
        num_experts=4, moe_top_k=4, moe_router="sigmoid", moe_n_group=2)
    assert found(arch="deepseek_v3", **MLA, **MOE) == ""


def _model(**changes: Any) -> ModelConfig:
    return tiny(ModelConfig(arch="deepseek_v3", num_layers=2, hidden_size=32, num_heads=4,
                            ffn_hidden_size=48, **MLA), **changes)


def test_mla_layouts(run_ranks: Callable[..., list[Any]]) -> None:
    """Dense DeepSeek-V3 (MLA + SwiGLU): tp2 without sp (the replicated down projections'
    partial gradients), pp2 1F1B and (4 layers) interleaved, dp2 ZeRO-3, cp2 ring and
    all_to_all (v padded to d)."""
    check_layouts(run_ranks, _model(), [
        Layout(tp=2), Layout(pp=2), Layout(dp=2, zero=3), Layout(cp=2),
        Layout(cp=2, cp_attention="all_to_all")])
    check_layouts(run_ranks, _model(num_layers=4),
                  [Layout(pp=2, vp=2, schedule="interleaved_1f1b")])


def test_deepseek_v3_moe_layouts(run_ranks: Callable[..., list[Any]]) -> None:
    """DeepSeek-V3 with experts and one multi-token-prediction module (an MoE layer with its
    own embedding and head, on the last stage): tp2 + sp, pp2, cp2, dp2 ZeRO-1, ep2 with both
    dispatchers, tp2 + sp with expert tp 2 (the folding's default: expert tp groups = tp
    groups; the shared expert stays tp-split)."""
    check_layouts(run_ranks, _model(**MOE, mtp_layers=1, mtp_loss_weight=0.3), [
        Layout(tp=2, sp=True), Layout(pp=2), Layout(cp=2), Layout(dp=2, zero=1),
        Layout(dp=2, ep=2), Layout(dp=2, ep=2, dispatcher="all_gather"),
        Layout(tp=2, sp=True, expert_tp=2)])


def test_deepseek_v3_preset_count_and_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    """configs/deepseek-v3.toml: 671,026,419,200 parameters (transformers' meta-device count of
    DeepseekV3ForCausalLM plus its 58 x 256 e_score_correction_bias buffers, which Colonnade
    holds as parameters without gradient; no multi-token-prediction module), 37,552,297,472
    active; `train --dry-run` prints both."""
    from colonnade.checkpoint.hf import hf_config_from_model
    from colonnade.cli import main
    from colonnade.config.load import load_config
    from colonnade.models.counts import active_param_count, param_count

    path = Path(__file__).resolve().parents[2] / "configs" / "deepseek-v3.toml"
    model = load_config(path).model
    total, active = 671_026_419_200, 37_552_297_472
    assert (param_count(model)["total"], active_param_count(model)) == (total, active)
    hf = hf_config_from_model(model)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items()
                                               if k != "architectures"})
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(cfg)
    biases = sum(b.numel() for n, b in theirs.named_buffers()
                 if n.endswith("e_score_correction_bias"))
    assert (theirs.num_parameters(), biases) == (total - 58 * 256, 58 * 256)
    assert main(["train", "--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "671,026,419,200 parameters total, 37,552,297,472 active per token" in out
    assert main(["train", "--config", str(path), "--model.mtp_layers=1", "--dry-run"]) == 0
    out = capsys.readouterr().out  # the MTP module (layer 61): 13,463,426,304 more
    assert "684,489,845,504 parameters total, 40,093,756,160 active per token" in out
