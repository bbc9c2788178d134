"""GradShards on its own (one rank, no process group): partial buckets and repeated gradients.

A parameter unused by a micro-batch leaves its bucket incomplete (no hook launches it); a
parameter accumulated twice in one micro-batch arrives while already marked. Both must still
give the exact float64 sum of every micro-batch's gradient in the shard, with the transient
buffers freed at the end (peak bounded by the buckets alive at once).
"""

from __future__ import annotations

import torch
from torch import nn

from colonnade.config.sections import ParallelConfig
from colonnade.data_parallel.buffer import FlatBuffers
from colonnade.data_parallel.grad_shards import GradShards
from colonnade.data_parallel.shard_groups import ShardGroups
from colonnade.parallel.comm import CommGroup, CommStats


def _setup(bucket: int) -> tuple[nn.Linear, nn.Linear, FlatBuffers, GradShards]:
    torch.manual_seed(0)
    a = nn.Linear(4, 4, dtype=torch.float64)
    b = nn.Linear(4, 4, dtype=torch.float64)
    params = [a.weight, a.bias, b.weight, b.bias]
    buffers = FlatBuffers([params], bucket, full_grads=False)
    group = CommGroup("dp_cp", [0], None, CommStats(), 0)
    # one reduce-scatter in flight: a launched buffer is freed at once, so the next bucket's
    # uninitialised buffer likely reuses its memory (stale values where nothing is written)
    return a, b, buffers, GradShards(buffers, ShardGroups(group), ParallelConfig(zero_stage=2),
                                     max_in_flight=1)


def _reference(a: nn.Linear, b: nn.Linear, xs: list[torch.Tensor],
               uses_b: list[bool]) -> dict[str, torch.Tensor]:
    ra, rb = nn.Linear(4, 4, dtype=torch.float64), nn.Linear(4, 4, dtype=torch.float64)
    ra.load_state_dict(a.state_dict())
    rb.load_state_dict(b.state_dict())
    for x, use in zip(xs, uses_b, strict=True):
        (rb(ra(x)) if use else ra(x)).pow(2).sum().backward()
    return {"aw": ra.weight.grad, "ab": ra.bias.grad,
            "bw": rb.weight.grad if rb.weight.grad is not None else torch.zeros(4, 4),
            "bb": rb.bias.grad if rb.bias.grad is not None else torch.zeros(4)}


def _shard_grads(buffers: FlatBuffers, shards: GradShards, a: nn.Linear,
                 b: nn.Linear) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in (("aw", a.weight), ("ab", a.bias), ("bw", b.weight), ("bb", b.bias)):
        slot = buffers.slot(p)
        out[name] = shards.shard[slot.start:slot.end].view_as(p)
    return out


def test_unused_parameter_and_partial_buckets_sum_exactly() -> None:
    """One bucket for all four parameters; micro-batch 2 leaves b unused."""
    for bucket in (10**6, 1):  # one bucket; a bucket per parameter
        a, b, buffers, shards = _setup(bucket)
        xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]
        uses_b = [True, False, True]
        shards.zero_grad()
        for x, use in zip(xs, uses_b, strict=True):
            (b(a(x)) if use else a(x)).pow(2).sum().backward()
        shards.finish()
        got, want = _shard_grads(buffers, shards, a, b), _reference(a, b, xs, uses_b)
        for key in want:
            assert torch.allclose(got[key], want[key].to(got[key]), rtol=1e-14, atol=1e-14), key
        assert all(p.grad is None for p in buffers.params)
        assert shards._live == 0 and shards.peak_transient_bytes > 0
        # every micro-batch launched a's bucket(s); b's partial bucket was launched too
        assert shards.launches >= 3


def test_parameter_accumulated_twice_in_one_micro_batch() -> None:
    """Two backward calls on the same micro-batch (a accumulates twice): the repeat launches
    the first, partial bucket and starts a new one; the sum is still exact."""
    a, b, buffers, shards = _setup(10**6)
    x = torch.randn(3, 4, dtype=torch.float64)
    shards.zero_grad()
    b(a(x)).pow(2).sum().backward()
    a(x).pow(2).sum().backward()
    shards.finish()
    got = _shard_grads(buffers, shards, a, b)
    want = _reference(a, b, [x, x], [True, False])
    for key in want:
        assert torch.allclose(got[key], want[key].to(got[key]), rtol=1e-14, atol=1e-14), key
    assert shards.launches == 2
