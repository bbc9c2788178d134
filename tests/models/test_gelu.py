"""colonnade.gelu: GPT-2's tanh GELU by its sigmoid form on CPU equals aten's to rounding
forward, bit for bit backward (aten's gelu_backward of the same saved input), and every other
case (bf16, under torch.compile) is aten's F.gelu itself."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from colonnade.gelu import GeluTanh, gelu_tanh
from tests.models.test_compile import graph_nodes


def _aten(z: torch.Tensor) -> torch.Tensor:
    return F.gelu(z, approximate="tanh")


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    """Large, small, zero, signed and saturated values: [4, 1024]."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 1024, generator=g, dtype=torch.float64) * 4
    z[0, :6] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0])
    return z.to(dtype)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.float64, 1e-14)])
def test_forward_is_aten_to_rounding_and_backward_bit_for_bit(dtype: torch.dtype,
                                                             tol: float) -> None:
    z = _inputs(dtype)
    ours = z.clone().requires_grad_()
    theirs = z.clone().requires_grad_()
    y, ref = gelu_tanh(ours), _aten(theirs)
    assert type(y.grad_fn).__name__ == "GeluTanhBackward"  # the sigmoid form ran
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    assert y[0, 4] == 40.0 and y[0, 5] == 0.0  # saturated: z and 0
    dy = torch.randn(z.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y.backward(dy.to(dtype))
    ref.backward(dy.to(dtype))
    assert torch.equal(ours.grad, theirs.grad)
    with torch.no_grad():  # no autograd node, the same values
        assert torch.equal(gelu_tanh(z), y.detach())


def test_gradcheck() -> None:
    z = _inputs(torch.float64)[:, :16].clone().requires_grad_()
    assert torch.autograd.gradcheck(GeluTanh.apply, (z,))


def test_other_dtypes_and_compiled_graphs_use_aten() -> None:
    z = _inputs(torch.bfloat16).requires_grad_()
    assert torch.equal(gelu_tanh(z), _aten(z))
    assert type(gelu_tanh(z).grad_fn).__name__ != "GeluTanhBackward"
    z32 = _inputs(torch.float32).requires_grad_()
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        y = gelu_tanh(z32)
    assert torch.equal(y, _aten(z32))
    assert type(y.grad_fn).__name__ == "GeluBackward0"


def test_gpt2_takes_it_and_trains_as_with_aten() -> None:
    """The GPT-2 model's MLP runs GeluTanh (float32, CPU), and its loss and gradients are those
    of the same model with aten's GELU to fp32 rounding."""
    from colonnade.config import load_config
    from colonnade.models import mlps
    from colonnade.models.build import build_reference

    cfg = load_config(None, ["--model.arch=gpt2", "--model.hidden_size=32",
                             "--model.num_layers=2", "--model.num_heads=4",
                             "--model.vocab_size=64", "--model.max_seq_len=16",
                             "--training.seq_len=16"])
    torch.manual_seed(0)
    model = build_reference(cfg, torch.float32).train()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    runs = {}
    for name, act in (("ours", gelu_tanh), ("aten", _aten)):
        model.zero_grad(set_to_none=True)
        with mock.patch.object(mlps, "gelu_tanh", act):
            loss = model(tokens, tokens, reduction="sum")
        if name == "ours":
            assert "GeluTanhBackward" in graph_nodes(loss)
        loss.backward()
        runs[name] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(runs["ours"][0], runs["aten"][0], rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(runs["ours"][1], runs["aten"][1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)

