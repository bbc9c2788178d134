"""ZeRO accounting, Korthikanti et al. activations and the schedules' in-flight factors."""

from __future__ import annotations

import dataclasses

import pytest

from colonnade.analysis.activations import layer_bytes, paper_layer_bytes
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import (
    activation_shape,
    in_flight,
    memory_per_device,
    state_bytes_per_param,
    zero_paper_bytes,
)
from colonnade.analysis.published import TABLE1, ZERO_EXAMPLE
from colonnade.config.sections import ModelConfig
from colonnade.models.counts import LayerShape


def test_zero_paper_figures_exactly() -> None:
    """7.5B parameters, Nd = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB."""
    psi, nd = ZERO_EXAMPLE["params"], ZERO_EXAMPLE["dp"]
    for stage, gb in ZERO_EXAMPLE["gb"].items():
        assert round(zero_paper_bytes(psi, nd, stage) / 1e9, 1) == gb
    with pytest.raises(ValueError, match="stage"):
        zero_paper_bytes(psi, nd, 4)


def test_colonnade_state_bytes() -> None:
    """bf16 weights + fp32 grads + 12 bytes Adam: 18, and 6 + 12/dp with ZeRO-1."""
    w = Workload(model=ModelConfig(), seq_len=128, global_batch=64)
    assert sum(state_bytes_per_param(w, Layout(dp=8))) == 18
    assert sum(state_bytes_per_param(w, Layout(dp=8, zero=1))) == 6 + 12 / 8
    w32 = dataclasses.replace(w, precision="fp32")
    assert sum(state_bytes_per_param(w32, Layout(dp=4, zero=1))) == 8 + 8 / 4


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("kernels", ["cuda", "cpu"])
def test_activations_reduce_to_korthikanti(tp: int, sp: bool, recompute: str,
                                           kernels: str) -> None:
    """GPT, 16-bit, eager attention with dropout: sbh(10 + 24/t + 5as/(ht)) and variants, plus
    what this code keeps beyond the paper: LayerNorm's mean and 1/std (2 norms x 2 x K r b, K
    = 4 on the CUDA path, E on the CPU's) and, under sp, the all-gathered [s, b, h] column
    inputs (2 E s b h (1 - 1/t)), which Megatron's re-gather (sp_regather) does not keep."""
    if sp and tp == 1:
        return
    row = TABLE1[4]
    s, b, h = 2048, 2, row.hidden
    want = paper_layer_bytes(s, b, h, row.heads, tp=tp, sp=sp, recompute=recompute)
    stats = 2 * 2 * (4 if kernels == "cuda" else 2) * (s // tp if sp else s) * b
    gathered = 2 * 2 * s * b * h * (1 - 1 / tp) if sp else 0
    lay = Layout(tp=tp, sp=sp, recompute=recompute, micro_batch=2)
    for regather in (False, True):
        w = dataclasses.replace(row.workload(), kernels=kernels, sp_regather=regather)
        got = layer_bytes(activation_shape(w, lay), recompute)
        assert got == pytest.approx(want + stats + (0 if regather else gathered), rel=1e-12)


def test_flash_attention_drops_the_s_squared_term() -> None:
    w = dataclasses.replace(TABLE1[0].workload(), attention="flash")
    eager = TABLE1[0].workload()
    blockwise = dataclasses.replace(eager, attention="blockwise")
    lay = Layout()
    flash_b = layer_bytes(activation_shape(w, lay))
    eager_b = layer_bytes(activation_shape(eager, lay))
    blockwise_b = layer_bytes(activation_shape(blockwise, lay))
    s, a = 2048, 24
    # eager keeps 5 a s^2 b; flash and blockwise keep the fp32 log-sum-exp (4 a s b); flash's
    # output is a view of the out-proj input without RoPE (gpt2), so it adds nothing
    assert eager_b - flash_b == pytest.approx(5 * a * s * s - 4 * a * s)
    assert blockwise_b == flash_b


def test_in_flight_micro_batches() -> None:
    assert in_flight(Layout(pp=4, schedule="1f1b"), 16) == 4
    assert in_flight(Layout(pp=4, schedule="1f1b"), 2) == 2
    assert in_flight(Layout(pp=4, schedule="gpipe"), 16) == 16
    assert in_flight(Layout(pp=4, vp=2, schedule="interleaved_1f1b"), 16) == 4 * (1 + 3 / 8)
    assert in_flight(Layout(pp=4, schedule="zb_h1"), 16) == 4


def test_first_stage_memory_is_the_whole_model_activation_for_1f1b() -> None:
    """1F1B: p micro-batches x l/p layers = l layers of one micro-batch (Korthikanti)."""
    row = TABLE1[5]
    w = row.workload()
    m = w.shape
    one = layer_bytes(activation_shape(w, Layout(tp=8, pp=4)))
    mem = memory_per_device(w, Layout(tp=8, pp=4, dp=32, micro_batch=1))
    embed_mask = 4 * 2048 * m.hidden  # dropout mask of the embedding, p micro-batches
    assert mem.stage == "first"
    assert mem.activations == pytest.approx(m.layers * one + embed_mask, rel=1e-12)
    inter = memory_per_device(w, Layout(tp=8, pp=4, vp=3, dp=32, schedule="interleaved_1f1b"))
    assert inter.activations == pytest.approx((m.layers * one + embed_mask) * (1 + 3 / 12))


def test_full_recompute_keeps_layer_inputs() -> None:
    w = TABLE1[3].workload()
    m = w.shape
    lay = Layout(tp=8, dp=32, micro_batch=4, recompute="full", sp=True)
    mem = memory_per_device(w, lay)
    inputs = m.layers * 2 * 2048 * 4 * m.hidden / 8
    working = layer_bytes(activation_shape(w, lay))
    logits = 6 * 2048 * 4 * 51200 / 8
    mask = 2048 * 4 * m.hidden / 8
    assert mem.activations == pytest.approx(inputs + working + logits + mask, rel=1e-12)


def test_params_split_by_tp_and_pp() -> None:
    w = Workload(model=ModelConfig(arch="llama", num_layers=8, hidden_size=256, num_heads=8,
                                   vocab_size=1000), seq_len=64, global_batch=8)
    whole = memory_per_device(w, Layout()).params / 2
    from colonnade.models.counts import total_params

    assert whole == total_params(LayerShape.of(w.model))
    split = memory_per_device(w, Layout(tp=2, pp=2)).params / 2
    assert split < whole / 3.5


def test_colonnade_attention_dropout_is_blockwise_and_keeps_no_scores() -> None:
    """A config with attention dropout runs the blockwise kernel (no s x s scores kept, as
    tests/recompute/test_memory.py measures), so the planner predicts it, not 'eager'."""
    from colonnade.config.sections import Config

    model = ModelConfig(arch="gpt2", num_layers=2, hidden_size=64, num_heads=4, vocab_size=100,
                        max_seq_len=128, attention_dropout=0.1, bias=True)
    w = Workload.from_config(Config(model=model), global_batch=4, seq_len=128)
    assert w.attention == "blockwise"
    eager = dataclasses.replace(w, attention="eager")
    s, b, a = 128, 1, 4
    blockwise_b = layer_bytes(activation_shape(w, Layout()))
    eager_b = layer_bytes(activation_shape(eager, Layout()))
    # eager: softmax output, 1-byte dropout mask and output (2E + 1) a s^2 b; blockwise: the
    # fp32 log-sum-exp 4 a s b (E = 4: the default fp32 precision)
    assert w.elem == 4
    assert eager_b - blockwise_b == 9 * a * s * s * b - 4 * a * s * b
    with pytest.raises(ValueError, match="attention='paged'"):
        dataclasses.replace(w, attention="paged")
