"""``training.tf32``: applied to PyTorch's CUDA matmul/cuDNN settings at start-up (CUDA only),
and the fp32 peak used for MFU follows it (TF32 peak when on, IEEE fp32 peak when off).

No GPU is needed: the settings are process-wide flags that a CPU build also holds, and the
device name is faked.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from colonnade import device as dev
from colonnade.config import load_config
from colonnade.device import apply_tf32, peak_tflops, tf32_enabled

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.fixture
def restore_flags() -> Iterator[None]:
    """Put PyTorch's fp32 precision settings back after the test."""
    matmul = torch.backends.cuda.matmul.fp32_precision
    conv = torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = matmul
    torch.backends.cudnn.conv.fp32_precision = conv


def _flags() -> tuple[str, str]:
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision


def test_apply_tf32_on_cuda_only(restore_flags: None) -> None:
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    apply_tf32(CPU, True)
    assert _flags() == ("ieee", "ieee") and not tf32_enabled()
    apply_tf32(CUDA, True)
    assert _flags() == ("tf32", "tf32") and tf32_enabled()
    apply_tf32(CUDA, False)
    assert _flags() == ("ieee", "ieee") and not tf32_enabled()


@pytest.mark.parametrize(("name", "half", "tf32", "fp32"), [
    ("NVIDIA H100 80GB HBM3", 989.0, 494.7, 67.0),
    ("NVIDIA H200", 989.0, 494.7, 67.0),
    ("NVIDIA H100 PCIe", 756.0, 378.0, 51.2),
    ("NVIDIA A100-SXM4-80GB", 312.0, 156.0, 19.5),
    ("NVIDIA A10", 125.0, 62.5, 31.2),
    ("Tesla V100-SXM2-32GB", 125.0, 15.7, 15.7),
])
def test_peak_follows_tf32(monkeypatch: pytest.MonkeyPatch, restore_flags: None, name: str,
                           half: float, tf32: float, fp32: float) -> None:
    monkeypatch.setattr(dev.torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(CUDA, torch.bfloat16, None) == half
    assert peak_tflops(CUDA, torch.float16, None, tf32=False) == half
    assert peak_tflops(CUDA, torch.float32, None, tf32=True) == tf32
    assert peak_tflops(CUDA, torch.float32, None, tf32=False) == fp32
    assert peak_tflops(CUDA, torch.float64, None) is None
    apply_tf32(CUDA, True)  # tf32=None reads what start-up applied
    assert peak_tflops(CUDA, torch.float32, None) == tf32
    apply_tf32(CUDA, False)
    assert peak_tflops(CUDA, torch.float32, None) == fp32
    assert peak_tflops(CUDA, torch.float32, 123.0) == 123.0  # logging.peak_tflops wins
    assert peak_tflops(CPU, torch.float32, None, tf32=True) is None


def test_init_runtime_applies_training_tf32(monkeypatch: pytest.MonkeyPatch,
                                            restore_flags: None) -> None:
    """The training start-up applies the config field (default on) to a CUDA device."""
    from colonnade.training import setup

    assert load_config(None, []).training.tf32 is True
    monkeypatch.setattr(setup, "pick_device", lambda choice, local_rank=0: CUDA)
    for value, want in (("false", "ieee"), ("true", "tf32")):
        torch.backends.cuda.matmul.fp32_precision = "none"
        rt = setup.init_runtime(load_config(None, [f"--training.tf32={value}"]))
        assert rt.device == CUDA and rt.config.training.tf32 is (value == "true")
        assert _flags() == (want, want)
