"""Flat buffers and buckets: backward order, bucket boundaries, padding, views, isolation,
and the single-rank hook path (accumulation into main_grad, sync only on the last pass)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colonnade.config.sections import ParallelConfig
from colonnade.data_parallel import ALIGN, DataParallel, FlatBuffers
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.tensor_parallel.sharding import Sharding


def _params(*sizes: int, names: tuple[str, ...] = ()) -> list[nn.Parameter]:
    out = []
    for i, n in enumerate(sizes):
        p = nn.Parameter(torch.full((n,), float(i + 1)))
        key = names[i] if i < len(names) else f"p{i}"
        p.sharding = Sharding(key, (n,))  # type: ignore[attr-defined]
        out.append(p)
    return out


def test_backward_order_and_bucket_boundaries() -> None:
    """Params [a=10, b=20, c=30, d=5], bucket 25: backward order d, c | b, a (>= 25 closes)."""
    a, b, c, d = _params(10, 20, 30, 5)
    buf = FlatBuffers([[a, b, c, d]], bucket_size=25)
    assert [buf.slot(p).start for p in (d, c, b, a)] == [0, 5, 35, 55]
    assert [(k.start, k.end) for k in buf.buckets] == [(0, 35), (35, 65)]
    assert [len(k.params) for k in buf.buckets] == [2, 2]
    assert buf.padding == 0 and buf.numel == 65


def test_bucket_per_param_and_one_bucket() -> None:
    ps = _params(3, 4, 5)
    assert len(FlatBuffers([ps], bucket_size=1).buckets) == 3
    assert len(FlatBuffers([_params(3, 4, 5)], bucket_size=10**9).buckets) == 1


def test_buckets_do_not_span_chunks() -> None:
    first, second = _params(4, 4), _params(4, 4)
    buf = FlatBuffers([first, second], bucket_size=10**9)
    assert [k.chunk for k in buf.buckets] == [1, 0], "last chunk's grads are ready first"
    assert all(buf.slot(p).bucket == 0 for p in second)


@pytest.mark.parametrize("shards", [2, 3, 4])
def test_padding_gives_equal_aligned_shards(shards: int) -> None:
    buf = FlatBuffers([_params(100, 7, 250, 1)], bucket_size=120, shard_count=shards)
    for bucket in buf.buckets:
        assert bucket.numel % (shards * ALIGN) == 0
        assert bucket.numel - sum(p.numel() for p in bucket.params) < shards * ALIGN
        ranges = [buf.shard(bucket, r) for r in range(shards)]
        assert ranges[0][0] == bucket.start and ranges[-1][1] == bucket.end
        assert len({hi - lo for lo, hi in ranges}) == 1
        assert all(lo % ALIGN == 0 for lo, _ in ranges)


def test_params_become_views_with_values_kept() -> None:
    ps = _params(6, 9)
    buf = FlatBuffers([ps], bucket_size=4, shard_count=2)
    for i, p in enumerate(ps):
        assert torch.equal(p.detach(), torch.full_like(p, float(i + 1)))
        assert p.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()
        assert p.main_grad.untyped_storage().data_ptr() == (  # type: ignore[attr-defined]
            buf.grad_data.untyped_storage().data_ptr())
    assert float(buf.param_data.sum()) == 6 * 1 + 9 * 2, "padding stays zero"


def test_isolated_params_get_their_own_bucket() -> None:
    ps = _params(8, 8, 8, names=("embedding.word.weight", "x", "y"))
    buf = FlatBuffers([ps], bucket_size=10**9, shard_count=2,
                      isolate=frozenset({"embedding.word.weight"}))
    assert [len(k.params) for k in buf.buckets] == [2, 1]
    assert buf.buckets[1].params[0] is ps[0]


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="bucket_size"):
        FlatBuffers([_params(3)], bucket_size=0)
    mixed = [*_params(3), nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    with pytest.raises(ValueError, match="dtypes"):
        FlatBuffers([mixed], bucket_size=10)


def test_accumulation_and_sync_only_on_last_microbatch() -> None:
    """One rank: grads add into main_grad over 3 passes; buckets launch only in the last."""
    lin = nn.Linear(4, 3, dtype=torch.float64)
    group = CommGroup("dp_cp", [0], None, CommStats(), 0)
    ddp = DataParallel([lin], group, ParallelConfig(bucket_size=1))
    x = torch.randn(5, 4, dtype=torch.float64)
    ddp.zero_grad()
    sync = ddp.grad_sync_hook(3)
    for k in range(3):
        sync(k)
        lin(x).sum().backward()
        assert lin.weight.grad.data_ptr() == lin.weight.main_grad.data_ptr(), (  # type: ignore
            "fp64 model: autograd accumulates straight into the flat buffer")
        assert ddp.launched_in_backward == (2 if k == 2 else 0)
    ddp.finish_grad_sync()
    want = 3 * torch.ones(5, 3, dtype=torch.float64).t() @ x  # d/dW sum(xW^T+b), 3 passes
    torch.testing.assert_close(lin.weight.main_grad, want)  # type: ignore[attr-defined]
    torch.testing.assert_close(lin.bias.main_grad,  # type: ignore[attr-defined]
                               torch.full((3,), 15.0, dtype=torch.float64))


def test_low_precision_grads_fold_into_fp32_main_grad() -> None:
    """bf16 model: each pass's bf16 grad is added into the fp32 main_grad and freed."""
    lin = nn.Linear(4, 3, bias=False, dtype=torch.bfloat16)
    group = CommGroup("dp_cp", [0], None, CommStats(), 0)
    ddp = DataParallel([lin], group, ParallelConfig())
    assert lin.weight.main_grad.dtype == torch.float32  # type: ignore[attr-defined]
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    for _ in range(2):
        lin(x).sum().backward()
        assert lin.weight.grad is None
    ddp.finish_grad_sync()
    torch.testing.assert_close(lin.weight.main_grad,  # type: ignore[attr-defined]
                               torch.full((3, 4), 4.0))


def test_gradient_after_launch_is_an_error() -> None:
    """A second accumulation into an already launched bucket would race the reduction."""
    lin = nn.Linear(2, 2, dtype=torch.float64)
    group = CommGroup("dp_cp", [0], None, CommStats(), 0)
    ddp = DataParallel([lin], group, ParallelConfig(bucket_size=1))
    ddp.grad_sync_hook(1)(0)
    x = torch.ones(1, 2, dtype=torch.float64)
    lin(x).sum().backward()
    assert ddp.launched_in_backward == 2
    with pytest.raises(RuntimeError, match="arrived after its bucket"):
        lin(x).sum().backward()
