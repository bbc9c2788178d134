"""GPU-only checks (marker ``gpu``): deselected by default, run with ``pytest -m gpu tests/gpu``
on a machine with a CUDA device (benchmarks/gpu_check.py runs them too).

Each test calls a ``check_*`` function taking the device, so the same assertions can be run on
a CPU by hand when changing them (``check_...(torch.device("cpu"))``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from colonnade.config.sections import Config, ModelConfig
from colonnade.generate import generate, load_for_generation
from colonnade.models.build import build_reference
from tests.gpu.helpers import (
    FUSED_SDPA,
    sdpa_backends,
    tiny_checkpoint,
    train_on_device,
    trainer_on,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def check_bf16_step_tracks_fp32(device: torch.device) -> list[tuple[float, float]]:
    """Three optimizer steps of the tiny Llama in bf16 (fp32 grads) on ``device`` against the
    same model in fp32 on the CPU: every loss within 2% (the bf16 rounding of weights and
    activations), and each step moves the loss the same way in both (every step draws new
    random batches, so the loss need not fall in 3 steps: on an H200 both went
    4.613 -> 4.605 -> 4.637)."""
    bf16 = train_on_device(trainer_on(device, "bf16"), 3)
    fp32 = train_on_device(trainer_on(torch.device("cpu"), "fp32"), 3)
    for got, ref in zip(bf16, fp32, strict=True):
        assert abs(got - ref) <= 0.02 * abs(ref), (bf16, fp32)
    for i in range(len(bf16) - 1):
        assert (bf16[i + 1] - bf16[i]) * (fp32[i + 1] - fp32[i]) > 0, (bf16, fp32)
    return list(zip(bf16, fp32, strict=True))


def check_sdpa_fused_for_bf16_causal(device: torch.device) -> tuple[list[str], list[str]]:
    """bf16 causal attention dispatches to a fused SDPA kernel (flash, memory-efficient or
    cuDNN), never the math path that materialises [b, a, s, s]: for a bare call
    ([2, 8, 256, 64]) and for a tiny Llama's forward (Colonnade's own attention call)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 256, 64, generator=gen).to(device, torch.bfloat16)
               for _ in range(3))
    bare = sdpa_backends(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    cfg = Config(model=ModelConfig(arch="llama", num_layers=2, hidden_size=128, num_heads=2,
                                   num_kv_heads=2, vocab_size=101, max_seq_len=64))
    chunk = build_reference(cfg, torch.bfloat16, device)  # head_dim 64: every kernel's size
    tokens = torch.randint(0, 101, (2, 64), generator=gen).to(device)
    model = sdpa_backends(lambda: chunk(tokens))
    for found in (bare, model):
        assert found and set(found) <= set(FUSED_SDPA), found
    return bare, model


def check_generate(device: torch.device, root: Path) -> list[int]:
    """A saved model loaded onto ``device`` generates greedily what it generates on the CPU
    (fp32: the logits agree to 1e-2, far inside the large-init model's top-2 gaps)."""
    ck = tiny_checkpoint(root)
    on_dev, _ = load_for_generation(ck, device)
    on_cpu, _ = load_for_generation(ck)
    prompt = torch.tensor([[5, 17, 42, 9]])
    assert next(on_dev.parameters()).device.type == device.type
    torch.testing.assert_close(on_dev.full_logits(prompt.to(device)).cpu(),
                               on_cpu.full_logits(prompt), rtol=1e-2, atol=1e-2)
    got = generate(on_dev, prompt, 16, temperature=0.0)
    assert got.device.type == device.type
    want = generate(on_cpu, prompt, 16, temperature=0.0)
    assert torch.equal(got.cpu(), want)
    sampled = generate(on_dev, prompt, 8, temperature=1.0,
                       generator=torch.Generator(device=device).manual_seed(1))
    assert sampled.shape == (1, 12)
    return got[0].tolist()


def check_async_save_round_trip(device: torch.device, root: Path) -> None:
    """An asynchronous checkpoint save of a model on ``device``, with a training step taken
    while the writer may still run, holds the weights at the save point; they load back onto
    the device and onto the CPU bit-exactly, and training continues identically."""
    from colonnade.checkpoint.training_state import load_training, save_training

    trainer = trainer_on(device, "fp32")
    train_on_device(trainer, 2)
    saved = {n: p.detach().cpu().clone() for n, p in trainer.chunks[0].named_parameters()}
    pending = save_training(trainer, root, async_save=True)
    after = train_on_device(trainer, 1)  # moves the weights while the thread may still write
    pending.wait()
    for where in (device, torch.device("cpu")):
        again = trainer_on(where, "fp32")
        meta = load_training(again, root)
        assert meta["step"] == again.step == 2
        for name, p in again.chunks[0].named_parameters():
            assert p.device.type == where.type
            assert torch.equal(p.detach().cpu(), saved[name]), (where, name)
        if where == device:
            assert train_on_device(again, 1) == after


def test_bf16_step_on_cuda_tracks_cpu_fp32() -> None:
    check_bf16_step_tracks_fp32(CUDA)


def test_sdpa_picks_a_fused_kernel_for_bf16_causal() -> None:
    check_sdpa_fused_for_bf16_causal(CUDA)


def test_generate_on_cuda_matches_cpu(tmp_path: Path) -> None:
    check_generate(CUDA, tmp_path)


def test_async_checkpoint_save_of_a_cuda_model_round_trips(tmp_path: Path) -> None:
    check_async_save_round_trip(CUDA, tmp_path)
