"""The LR schedule and the FLOP / parameter counts against numbers worked out by hand here.

Every expected value is a literal, with its arithmetic written beside it, so a change in
Colonnade's formulas (an off-by-one in the warmup, a decay that ends a step early, a FLOP term
dropped) fails here even when the code and its own docstring change together.
"""

from __future__ import annotations

import dataclasses

import pytest

from colonnade.config.sections import Config, ModelConfig, OptimConfig, TrainingConfig
from colonnade.models.build import build_reference
from colonnade.models.counts import (
    ArchFacts,
    LayerShape,
    arch_facts,
    embedding_params,
    flops_per_token,
    head_params,
    layer_params,
    param_count,
    step_flops,
)
from colonnade.optim.lr import lr_at

TOTAL = 110
"""training.steps: optimizer steps 0..109."""
BASE = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay="cosine")

# (decay, step, expected LR). lr = 1e-3, min = 1e-4, warmup W = 10, total T = 110.
# warmup (any decay): lr (step + 1) / W.
# cosine / linear: t = (step - W) / (T - W) = (step - 10) / 100.
# wsd (decay_fraction 0.2): D = round(0.2 * 110) = 22 decay steps, t = (step + 1 - 88) / 22.
# inverse_sqrt: lr sqrt(W / (step + 1)), at least min.
CASES = [
    ("cosine", 0, 1e-4),  # 1e-3 * 1 / 10
    ("cosine", 4, 5e-4),  # 1e-3 * 5 / 10
    ("cosine", 9, 1e-3),  # 1e-3 * 10 / 10
    ("cosine", 10, 1e-3),  # t = 0: min + (lr - min) (1 + cos 0) / 2
    ("cosine", 35, 8.681980515339464e-4),  # t = 1/4: 1e-4 + 4.5e-4 (1 + 0.7071067811865476)
    ("cosine", 60, 5.5e-4),  # t = 1/2: 1e-4 + 4.5e-4 (1 + 0)
    ("cosine", 85, 2.318019484660536e-4),  # t = 3/4: 1e-4 + 4.5e-4 (1 - 0.7071067811865476)
    ("cosine", 110, 1e-4),  # t = 1: min
    ("linear", 4, 5e-4),  # warmup as above
    ("linear", 35, 7.75e-4),  # 1e-3 - 9e-4 / 4
    ("linear", 60, 5.5e-4),  # 1e-3 - 9e-4 / 2
    ("linear", 109, 1.09e-4),  # t = 0.99: 1e-3 - 9e-4 * 0.99
    ("constant", 0, 1e-4),  # warmup
    ("constant", 50, 1e-3),
    ("constant", 109, 1e-3),
    ("wsd", 9, 1e-3),  # end of warmup
    ("wsd", 50, 1e-3),  # stable
    ("wsd", 87, 1e-3),  # stable: t = 0
    ("wsd", 88, 9.590909090909091e-4),  # t = 1/22: 1e-3 - 9e-4 / 22
    ("wsd", 98, 5.5e-4),  # t = 11/22: 1e-3 - 9e-4 / 2
    ("wsd", 109, 1e-4),  # t = 1 on the last step
    ("inverse_sqrt", 4, 5e-4),  # warmup
    ("inverse_sqrt", 10, 9.534625892455923e-4),  # 1e-3 sqrt(10 / 11)
    ("inverse_sqrt", 39, 5e-4),  # 1e-3 sqrt(10 / 40)
    ("inverse_sqrt", 999, 1e-4),  # 1e-3 sqrt(10 / 1000) = min
    ("inverse_sqrt", 3999, 1e-4),  # 1e-3 sqrt(10 / 4000) = 5e-5, held at min
]


@pytest.mark.parametrize(("decay", "step", "expected"), CASES)
def test_lr_schedule_matches_hand_values(decay: str, step: int, expected: float) -> None:
    cfg = dataclasses.replace(BASE, decay=decay)
    assert lr_at(step, TOTAL, cfg) == pytest.approx(expected, rel=1e-12, abs=0.0)


def test_wsd_one_minus_sqrt_matches_hand_values() -> None:
    cfg = dataclasses.replace(BASE, decay="wsd", decay_shape="1-sqrt")
    assert lr_at(87, TOTAL, cfg) == pytest.approx(1e-3, rel=1e-12)  # t = 0
    # t = 1/2: 1e-3 - 9e-4 sqrt(1/2) = 1e-3 - 6.363961030678928e-4
    assert lr_at(98, TOTAL, cfg) == pytest.approx(3.636038969321072e-4, rel=1e-12)
    assert lr_at(109, TOTAL, cfg) == pytest.approx(1e-4, rel=1e-12)  # t = 1


def test_no_warmup_starts_at_peak() -> None:
    cfg = dataclasses.replace(BASE, warmup_steps=0)
    assert lr_at(0, TOTAL, cfg) == pytest.approx(1e-3, rel=1e-12)  # t = 0
    # t = 55 / 110 = 1/2: 1e-4 + 4.5e-4
    assert lr_at(55, TOTAL, cfg) == pytest.approx(5.5e-4, rel=1e-12)


LLAMA = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=128, vocab_size=100, max_seq_len=64)
GPT2 = ModelConfig(arch="gpt2", num_layers=2, hidden_size=32, num_heads=4, vocab_size=50,
                   max_seq_len=16, tie_embeddings=True, bias=True)


def test_flops_per_token_llama_hand_count() -> None:
    """Colonnade's convention (its docstring): forward = 2 x matmul parameters (layers and
    head) + attention 2 x 2 s h per layer (q k^T and p v, causal half not discounted);
    training = 3 x forward. Equivalently 6 N + 12 L s h with N the matmul parameters.

    h = 64, a = 4, kv = 2, d = 16, f = 128, L = 2, V = 100, s = 32:
      q  h x a d  = 64 x 64 = 4096     k  h x kv d = 64 x 32 = 2048
      v  2048                          o  a d x h  = 4096
      gate, up, down  3 x 64 x 128 = 24576        -> 36864 matmul parameters per layer
      per layer forward: 2 x 36864 = 73728, attention 2 x 2 x 32 x 64 = 8192 -> 81920
      layers 2 x 81920 = 163840; head 2 x 100 x 64 = 12800 -> forward 176640
      training 3 x 176640 = 529920 = 6 x (2 x 36864 + 6400) + 12 x 2 x 32 x 64
    """
    assert flops_per_token(LLAMA, 32) == 529920
    assert 6 * (2 * 36864 + 6400) + 12 * 2 * 32 * 64 == 529920


def test_flops_per_token_gpt2_hand_count() -> None:
    """h = 32, a = 4, f = 4h = 128, L = 2, V = 50, s = 16, tied head (still a matmul), biases
    and positions not counted (no matmul):
      attention q, k, v, o  4 x 32 x 32 = 4096; MLP 2 x 32 x 128 = 8192 -> 12288 per layer
      per layer forward 2 x 12288 + 2 x 2 x 16 x 32 = 24576 + 2048 = 26624
      layers 53248; head 2 x 50 x 32 = 3200 -> forward 56448; training 169344
    """
    assert flops_per_token(GPT2, 16) == 169344


@pytest.mark.parametrize(("cfg", "expected"), [
    # llama: embedding 100 x 64 = 6400; per layer 12288 + 24576 + 2 norms x 64 = 36992;
    # head 6400 + final norm 64 -> 6400 + 73984 + 6464 = 86848
    (LLAMA, {"embedding": 6400, "layers": 73984, "head": 6464, "total": 86848}),
    # gpt2: embedding 50 x 32 + positions 16 x 32 = 2112; per layer 12288 matmul + biases
    # (q, k, v 96 + o 32 + fc 128 + proj 32 = 288) + 2 LayerNorms x 64 = 12704;
    # tied head 0 + final LayerNorm 64 -> 2112 + 25408 + 64 = 27584
    (GPT2, {"embedding": 2112, "layers": 25408, "head": 64, "total": 27584}),
])
def test_param_count_hand_count_and_model(cfg: ModelConfig, expected: dict[str, int]) -> None:
    assert param_count(cfg) == expected
    model = build_reference(Config(model=cfg, training=TrainingConfig(precision="fp32")))
    assert sum(p.numel() for p in model.parameters()) == expected["total"]


def test_facts_come_from_the_layer_spec() -> None:
    """llama: SwiGLU (3 matrices), RMSNorm (no bias), RoPE; gpt2: GELU (2), LayerNorm, learned."""
    assert arch_facts(LLAMA) == ArchFacts(mlp_matrices=3, norm_has_bias=False, positions="rope")
    assert arch_facts(GPT2) == ArchFacts(mlp_matrices=2, norm_has_bias=True,
                                         positions="learned")


def test_counts_follow_the_facts_of_a_mixed_architecture() -> None:
    """Rope + LayerNorm + a gated MLP (a mix no preset has), biases, untied head.

    h = 32, a = 4, kv = 2, d = 8, h_kv = 16, f = 64, L = 2, V = 50, s = 16:
      matrices q 32 x 32 = 1024, k, v 32 x 16 = 512 each, o 1024; MLP 3 x 32 x 64 = 6144
        -> 9216 per layer
      biases q, k, v 32 + 16 + 16 = 64, o 32, gate and up 2 x 64 = 128, down 32 -> 256
      two LayerNorms 2 x (32 + 32) = 128 -> layer 9600, layers 19200
      embedding 50 x 32 = 1600 (RoPE: no position table); head 1600 + final LayerNorm 64
      total 1600 + 19200 + 1664 = 22464
      FLOPs per token: layer forward 2 x 9216 + 4 x 16 x 32 = 20480, layers 40960, head
      2 x 32 x 50 = 3200 -> forward 44160, training 3 x 44160 = 132480
    """
    facts = ArchFacts(mlp_matrices=3, norm_has_bias=True, positions="rope")
    m = LayerShape(facts=facts, layers=2, hidden=32, heads=4, q_hidden=32, kv_hidden=16,
                   ffn=64, vocab=50, max_seq_len=16, tied=False, bias=True, hidden_dropout=False,
                   attention_dropout=False)
    assert layer_params(m) == 9600
    assert embedding_params(m) == 1600 and head_params(m) == 1664
    assert 2 * layer_params(m) + embedding_params(m) + head_params(m) == 22464
    assert step_flops(m, 16, 1, "none") == 132480 * 16
