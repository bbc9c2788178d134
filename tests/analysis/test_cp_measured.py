"""The activation model under context parallelism against measurement (issue 16).

Each cp rank runs the model's forward on the full micro-batch (it takes its zigzag rows itself)
inside :class:`~colonnade.analysis.measure.SavedTensorMeter` (autograd's saved-tensor hooks,
each storage once), then the backward; the bytes every layer keeps for backward must match
:func:`colonnade.analysis.activations.layer_bytes` at cp (ring and all_to_all, with and without
recompute), the bytes the cp group moved (CommGroup's wire bytes) must be
:mod:`colonnade.analysis.cp_comm`'s exactly, and the cp2 rank's layer keeps half of the cp1
layer's plus what the model names (the cp attention's own output and RoPE's gathered cos /
sin; selective recompute does not checkpoint the ring).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.analysis.activations import ActivationShape, cp_buffer_bytes, layer_bytes
from colonnade.analysis.cp_comm import cp_comm
from colonnade.analysis.hardware import get_cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.measure import PeakTensorBytes, SavedTensorMeter, relative_error
from colonnade.context_parallel.ring import ring_attention
from colonnade.models.build import build_chunks
from colonnade.models.recompute import RecomputePlan, install
from colonnade.parallel.dims import ParallelDims
from tests.context_parallel.harness import cp_config
from tests.parity import rank_groups

SEQ = 64
TOL = 0.01


def measure(cp: int, kind: str, mode: str, kv_heads: int | None = None,
            attention_dropout: float = 0.0, dropout: float = 0.0,
            a2a: int | None = None) -> dict[str, Any]:
    """Rank body: measured and predicted bytes one layer keeps on this cp rank, and the bytes
    its cp group moved (hierarchical: its two sub-groups, inner size ``a2a``) against
    :func:`~colonnade.analysis.cp_comm.cp_comm`."""
    config = cp_config(cp=cp, cp_attention=kind, seq=SEQ, kv_heads=kv_heads,
                       attention_dropout=attention_dropout, dropout=dropout, cp_a2a_size=a2a)
    groups = rank_groups(ParallelDims(cp=cp), a2a)
    (chunk,) = build_chunks(config, groups, dtype=torch.float64)
    install([chunk], RecomputePlan(mode))
    chunk.train()
    gen = torch.Generator().manual_seed(3)
    b, vocab = config.training.micro_batch_size, config.model.vocab_size
    tokens = torch.randint(0, vocab, (b, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (b, SEQ), generator=gen)
    groups.stats.reset()
    with SavedTensorMeter([chunk]) as meter:
        loss = chunk(tokens, labels, reduction="sum")
    loss.backward()  # the saved tensors are the ones backward uses
    per_layer = meter.per_layer()
    shape = ActivationShape.from_model(config.model, SEQ, b, dtype=torch.float64)
    shape = dataclasses.replace(shape, cp=cp, cp_attention=kind, cp_a2a_size=a2a)
    sent = sum(op["wire_bytes"] for key, op in groups.stats.snapshot().items()
               if key.split("/")[0] in ("cp", "cp_a2a", "cp_ring"))
    lay = Layout(cp=cp, cp_attention=kind, cp_a2a_size=a2a, micro_batch=b, recompute=mode)
    one = cp_comm(Workload.from_config(config), lay, get_cluster("cpu-local"))
    return {"measured": sum(per_layer.values()) / len(per_layer),
            "predicted": layer_bytes(shape, mode), "layers": len(per_layer),
            "sent": sent, "sent_model": len(per_layer) * (one.fwd_bytes + one.bwd_bytes)}


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_cp2_layers_keep_what_the_model_says_and_half_of_cp1(
        run_ranks: Callable[..., list[Any]], mode: str) -> None:
    one = measure(1, "ring", mode)
    assert relative_error(one["measured"], one["predicted"]) <= TOL, one
    for kind in ("ring", "all_to_all"):
        for got in run_ranks(2, measure, 2, kind, mode):
            assert got["layers"] == one["layers"] == 2
            assert relative_error(got["measured"], got["predicted"]) <= TOL, (kind, got)
            assert got["sent"] == got["sent_model"] > 0, (kind, got)  # cp_comm's bytes
            extra = got["predicted"] - one["predicted"] / 2  # output, RoPE rows (the model)
            assert got["measured"] == pytest.approx(one["measured"] / 2 + extra, rel=TOL)


def test_gqa_kv_heads_replicated_by_all_to_all(run_ranks: Callable[..., list[Any]]) -> None:
    """One kv head, cp 2: all_to_all hands each rank the (replicated) kv head over the full
    s; the ring sends its single-head kv blocks.  Saved bytes and moved bytes as modelled."""
    for kind in ("ring", "all_to_all"):
        for got in run_ranks(2, measure, 2, kind, "none", 1):
            assert relative_error(got["measured"], got["predicted"]) <= TOL, (kind, got)
            assert got["sent"] == got["sent_model"] > 0, (kind, got)


def test_hierarchical_layers_keep_what_the_model_says(
        run_ranks: Callable[..., list[Any]]) -> None:
    """cp 4 = a2a 2 x ring 2 with one kv head (replicated over the inner group, so the ring's
    blocks hold 2 s_l rows of one head): saved bytes as modelled and moved bytes equal
    cp_comm's; attention dropout keeps nothing more (its masks are redrawn from global
    positions)."""
    for got in run_ranks(4, measure, 4, "hierarchical", "none", 1, 0.1, 0.0, 2):
        assert relative_error(got["measured"], got["predicted"]) <= TOL, got
        assert got["sent"] == got["sent_model"] > 0, got


def test_all_to_all_with_attention_dropout(run_ranks: Callable[..., list[Any]]) -> None:
    """Attention dropout under cp runs all_to_all with the blockwise kernel on its heads:
    q, k, v, log-sum-exp kept at full s, no output (it is written in [s, b, ...] order)."""
    for got in run_ranks(2, measure, 2, "all_to_all", "none", None, 0.1):
        assert relative_error(got["measured"], got["predicted"]) <= TOL, got


def test_hidden_dropout_masks_are_the_ranks_rows(run_ranks: Callable[..., list[Any]]) -> None:
    """Hidden dropout under cp keeps the two bool masks of the rank's s/cp rows only."""
    one = measure(1, "ring", "none", None, 0.0, 0.1)
    assert relative_error(one["measured"], one["predicted"]) <= TOL, one
    for got in run_ranks(2, measure, 2, "ring", "none", None, 0.0, 0.1):
        assert relative_error(got["measured"], got["predicted"]) <= TOL, got


def ring_peak(b: int, a: int, kv: int, s_l: int, d: int, dtype: torch.dtype) -> int:
    """Rank body: the ring backward's peak of live tensor bytes beyond its outputs."""
    torch.manual_seed(0)
    group = rank_groups(ParallelDims(cp=2)).cp
    q = torch.randn(b, a, s_l, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, kv, s_l, d, dtype=dtype, requires_grad=True) for _ in range(2))
    out = ring_attention(q, k, v, group)
    dout = torch.randn_like(out)
    with PeakTensorBytes() as peak:
        out.backward(dout)
    return peak.peak - peak.current  # what remains are dq, dk, dv


def test_ring_transient_buffers_as_modelled(run_ranks: Callable[..., list[Any]]) -> None:
    """cp_buffer_bytes against the measured peak of ring attention's backward (fp32)."""
    b, a, kv, s_l, d = 2, 8, 2, 512, 32
    x = ActivationShape(seq=2 * s_l, batch=b, hidden=a * d, heads=a, kv_heads=kv, ffn=64,
                        elem=4, cp=2)
    for got in run_ranks(2, ring_peak, b, a, kv, s_l, d, torch.float32):
        assert relative_error(got, cp_buffer_bytes(x)) <= TOL, (got, cp_buffer_bytes(x))
