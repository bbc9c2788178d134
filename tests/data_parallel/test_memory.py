"""Optimizer-state bytes per rank (ZeRO's P_os) and the flat-buffer layout, in one process.

Building the buffers and the optimizer does not communicate, so a CommGroup that only claims
dp ranks (no process group behind it) lets one process build what dp rank r would build.

bf16 model, fp32 masters and moments: 12 bytes per optimizer element (precision-aware states:
bf16 moments and / or no master, the formula of analysis.memory). Without ZeRO-1 every
rank holds all P parameters: exactly 12 P bytes. With ZeRO-1 each rank holds 1/dp of every
bucket, padded to a multiple of dp x ALIGN elements: 12 (P + pad) / dp bytes with
0 <= pad < buckets x dp x ALIGN, i.e. at most 12 (P / dp + buckets x ALIGN).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import (
    layer_muon_params,
    memory_per_device,
    optimizer_bytes_per_element,
    stage_state_bytes,
)
from colonnade.data_parallel import ALIGN, DataParallel
from colonnade.models.build import build_reference
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.optim.muon import muon_matrices
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.groups import ProcessGroups
from tests.data_parallel.common import tiny_config


def _build(dp: int, rank: int, zero: bool, bucket: int, precision: str = "bf16",
           state: str = "fp32", master: str = "fp32", name: str = "adamw"
           ) -> tuple[DataParallel, DistributedOptimizer, int]:
    config = tiny_config(dp=1, precision=precision, zero=zero, bucket=bucket)
    model = build_reference(config)
    params = sum(p.numel() for p in model.parameters())
    group = CommGroup("dp_cp", list(range(dp)), None, CommStats(), rank)
    par = dataclasses.replace(config.parallel, use_distributed_optimizer=zero)
    ddp = DataParallel([model], group, par)
    optim = dataclasses.replace(config.optim, state_dtype=state, master_dtype=master,
                                name=name)
    opt = DistributedOptimizer(ddp, optim, ProcessGroups.single(), 3, precision)
    return ddp, opt, params


STATES = [("bf16", "fp32", "fp32", 12), ("bf16", "bf16", "fp32", 8), ("bf16", "fp32", "bf16", 8),
          ("bf16", "bf16", "bf16", 4), ("fp32", "fp32", "fp32", 8), ("fp32", "bf16", "fp32", 4)]
"""(precision, optim.state_dtype, optim.master_dtype, AdamW's optimizer bytes per element)."""


def _muon_owned(ddp: DataParallel) -> int:
    """Owned elements of Muon matrices (optim.muon.muon_matrices), padding excluded."""
    return sum(b - a for lo, hi in ddp.owned_ranges()
               for p, a, b in ddp.buffers.segments(lo, hi) if muon_matrices(p) is not None)


@pytest.mark.parametrize("name", ["adamw", "muon"])
@pytest.mark.parametrize(("precision", "state", "master", "per_element"), STATES,
                         ids=["-".join(s[:3]) for s in STATES])
def test_state_bytes_follow_the_formula(precision: str, state: str, master: str,
                                        per_element: int, name: str) -> None:
    """Measured state_bytes() of one process and of each rank of dp2 ZeRO-1 (two buckets)
    equal the formula of analysis.memory (optimizer_bytes_per_element:
    master 4 or 0, plus 2 x state bytes per AdamW element, padding included, 1 x per
    Muon-matrix element) summed over the owned elements; with AdamW that is the planner's
    ZeRO-1 O/S per parameter, up to the padding; the tensors have the configured dtypes."""
    assert optimizer_bytes_per_element(precision, state, master) == per_element
    muon_o = optimizer_bytes_per_element(precision, state, master, muon=True)
    layouts = ((1, 0, False), (2, 0, True), (2, 1, True))
    for dp, rank, zero in layouts:
        ddp, opt, params = _build(dp, rank, zero, 5000, precision, state, master, name)
        owned = sum(hi - lo for lo, hi in ddp.owned_ranges())
        assert owned == ((params + ddp.buffers.padding) // dp if zero else params)
        muon = _muon_owned(ddp) if name == "muon" else 0
        assert (muon > owned // 2) == (name == "muon")
        assert opt.state_bytes() == per_element * (owned - muon) + muon_o * muon
        assert opt.exp_avg_flat.dtype == (torch.bfloat16 if state == "bf16" else torch.float32)
        assert (opt.master_flat is not None) == (2 * muon_o - per_element == 4)  # M = 4
        if name == "adamw" and zero:
            _, _, o_per_param = stage_state_bytes(precision, 1, 2, state, master)
            assert (o_per_param * params <= opt.state_bytes()
                    <= o_per_param * (params + 2 * ALIGN * len(ddp.buckets)))


@pytest.mark.parametrize("dp", [2, 4, 8])
@pytest.mark.parametrize("bucket", [1, 5000, 10**9], ids=["per_param", "mid", "one"])
def test_zero1_state_bytes(dp: int, bucket: int) -> None:
    """Every rank: 12 x (P + pad) / dp bytes, pad bounded; the shards tile the buffer."""
    owned: list[tuple[int, int]] = []
    for rank in range(dp):
        ddp, opt, params = _build(dp, rank, True, bucket)
        pad = ddp.buffers.padding
        buckets = len(ddp.buckets)
        assert 0 <= pad < buckets * dp * ALIGN
        assert (params + pad) % dp == 0
        assert opt.state_bytes() == 12 * (params + pad) // dp
        assert 12 * params / dp <= opt.state_bytes() <= 12 * (params / dp + buckets * ALIGN)
        owned += ddp.owned_ranges()
        assert all(lo % ALIGN == 0 for lo, _ in ddp.owned_ranges()), "ranges must be aligned"
    owned.sort()
    assert owned[0][0] == 0 and owned[-1][1] == ddp.buffers.numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(owned)), "gap or overlap"


def test_zero1_memory_shrinks_with_dp() -> None:
    """The one-bucket layout: dp=8 holds ~1/8 of the dp=1 state (within the padding)."""
    _, opt1, params = _build(1, 0, True, 10**9)
    _, opt8, _ = _build(8, 3, True, 10**9)
    assert opt1.state_bytes() == 12 * params
    assert 12 * params / 8 <= opt8.state_bytes() <= 12 * params / 8 + 12 * ALIGN


@pytest.mark.parametrize("dp", [2, 4])
def test_ddp_state_bytes(dp: int) -> None:
    """Without ZeRO-1: no padding, every rank holds 12 x P bytes."""
    ddp, opt, params = _build(dp, 1, False, 5000)
    assert ddp.buffers.padding == 0
    assert opt.state_bytes() == 12 * params
    assert ddp.owned_ranges() == [(0, params)]


def test_fp32_model_keeps_no_master_copy() -> None:
    """fp32 params are their own masters: 8 bytes (moments) per element."""
    config = tiny_config(dp=1, precision="fp32")
    model = build_reference(config)
    params = sum(p.numel() for p in model.parameters())
    group = CommGroup("dp_cp", [0], None, CommStats(), 0)
    ddp = DataParallel([model], group, config.parallel)
    opt = DistributedOptimizer(ddp, config.optim, ProcessGroups.single(), 3, "fp32")
    assert opt.state_bytes() == 8 * params
    # one rank: autograd's fp32 gradients are read directly, no flat gradient buffer exists
    assert ddp.direct_grads and ddp.buffers.grad_data is None
    assert ddp.memory_bytes()["grads"] == 4 * params


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_planner_optimizer_bytes_equal_the_measured(arch: str, name: str) -> None:
    """The planner's optimizer bytes of one process (memory_per_device: AdamW's O for every
    parameter, Muon's for layer_muon_params of each layer) equal state_bytes() of the built
    optimizer, bf16 model with bf16 states; the Muon count equals muon_matrices' own."""
    config = tiny_config(arch=arch, dp=1, precision="bf16")
    optim = dataclasses.replace(config.optim, state_dtype="bf16", name=name)
    config = dataclasses.replace(config, optim=optim)
    model = build_reference(config)
    group = CommGroup("dp_cp", [0], None, CommStats(), 0)
    ddp = DataParallel([model], group, config.parallel)
    opt = DistributedOptimizer(ddp, optim, ProcessGroups.single(), 3, "bf16")
    w = Workload.from_config(config)
    muon = sum(p.numel() for p in model.parameters() if muon_matrices(p) is not None)
    assert layer_muon_params(w.shape, 1) * config.model.num_layers == muon
    assert memory_per_device(w, Layout.from_config(config, 1)).optimizer == opt.state_bytes()
