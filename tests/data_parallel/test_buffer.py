"""Flat buffers and buckets: backward order, bucket boundaries, padding, views, isolation,
and the hook path: none on one fp32/fp64 rank, bf16 folding into main_grad, and on two ranks
the sync only in the last pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from colonnade.config.sections import ParallelConfig
from colonnade.data_parallel import ALIGN, DataParallel, FlatBuffers
from colonnade.models.params import grad_of
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.dims import ParallelDims
from colonnade.tensor_parallel.sharding import Sharding
from tests.parity import rank_groups


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


def test_one_rank_fp64_has_no_hooks_and_accumulates_in_place() -> None:
    """One rank, fp64: no hook, nothing launched, nothing copied; autograd keeps the first
    pass's gradient and adds the next two into it, and the optimizer reads that tensor
    (``step_grads``, one range per parameter); no flat gradient buffer exists at all."""
    lin = nn.Linear(4, 3, dtype=torch.float64)
    group = CommGroup("dp_cp", [0], None, CommStats(), 0)
    ddp = DataParallel([lin], group, ParallelConfig(bucket_size=1))
    assert not ddp.hooked and ddp.direct_grads and ddp.buffers.grad_data is None
    assert not hasattr(lin.weight, "main_grad")
    assert ddp.memory_bytes()["grads"] == 15 * 8  # autograd's fp64 gradients, 12 + 3
    assert all(not p._post_accumulate_grad_hooks for p in lin.parameters())  # type: ignore
    x = torch.randn(5, 4, dtype=torch.float64)
    ddp.zero_grad()
    assert lin.weight.grad is None
    sync = ddp.grad_sync_hook(3)
    first = None
    for k in range(3):
        sync(k)
        lin(x).sum().backward()
        first = first or lin.weight.grad.data_ptr()  # type: ignore[union-attr]
        assert lin.weight.grad.data_ptr() == first, "later passes add in place"  # type: ignore
        assert ddp.launched_in_backward == 0
    ddp.finish_grad_sync()
    assert lin.weight.grad.data_ptr() == first, "the optimizer reads autograd's tensor"  # type: ignore
    want = 3 * torch.ones(5, 3, dtype=torch.float64).t() @ x  # d/dW sum(xW^T+b), 3 passes
    torch.testing.assert_close(lin.weight.grad, want)
    torch.testing.assert_close(lin.bias.grad, torch.full((3,), 15.0, dtype=torch.float64))
    ranges, grads = ddp.owned_ranges(), ddp.step_grads()
    assert [hi - lo for lo, hi in ranges] == [12, 3]
    assert [g.data_ptr() for g in grads] == [lin.weight.grad.data_ptr(),
                                             lin.bias.grad.data_ptr()]  # type: ignore[union-attr]
    assert group.stats.snapshot() == {}, "no collective was entered"


def _two_rank_accumulation() -> dict[str, Any]:
    """Rank side: 3 passes with sync on the last; then one pass too many after a launch."""
    groups = rank_groups(ParallelDims(dp=2))
    torch.manual_seed(0)
    lin = nn.Linear(4, 3, dtype=torch.float64)
    ddp = DataParallel([lin], groups.dp_cp, ParallelConfig(bucket_size=1))
    x = torch.full((5, 4), float(groups.dp_cp.rank + 1), dtype=torch.float64)
    sync = ddp.grad_sync_hook(3)
    launched = []
    for k in range(3):
        sync(k)
        lin(x).sum().backward()
        launched.append(ddp.launched_in_backward)
    ddp.finish_grad_sync()
    out: dict[str, Any] = {"hooked": ddp.hooked, "launched": launched,
                           "weight": lin.weight.main_grad.clone()}  # type: ignore[attr-defined]
    ddp.zero_grad()
    ddp.grad_sync_hook(1)(0)
    lin(x).sum().backward()
    try:
        lin(x).sum().backward()
        out["error"] = ""
    except RuntimeError as err:
        out["error"] = str(err)
    ddp.finish_grad_sync()
    return out


def test_two_ranks_launch_only_in_the_last_pass(run_ranks: Callable[..., list[Any]]) -> None:
    """dp2, fp64: hooks mark readiness only in the last pass (2 buckets launched then), the
    averaged gradient is 3 x mean over ranks; a second accumulation into a launched bucket
    (it would race the reduction) is an error naming the fix."""
    results = run_ranks(2, _two_rank_accumulation)
    # d/dW sum(x W^T + b) over 5 rows of value c: 5c per entry; mean of c = 1, 2 is 1.5
    want = torch.full((3, 4), 3 * 5 * 1.5, dtype=torch.float64)
    for res in results:
        assert res["hooked"] and res["launched"] == [0, 0, 2]
        torch.testing.assert_close(res["weight"], want, rtol=0, atol=0)
        assert "arrived after its bucket" in res["error"]


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


@pytest.mark.parametrize(("dtype", "zero"), [(torch.float64, False), (torch.float64, True),
                                             (torch.bfloat16, False)])
def test_buffer_is_never_zeroed_yet_stale_gradients_never_count(dtype: torch.dtype,
                                                                 zero: bool) -> None:
    """The flat buffer keeps the last step's values (no zeroing pass). The step's gradient
    (``grad_of``) is autograd's own tensor (fp64, direct gradients), or copied over the stale
    values (fp64 ZeRO-1 on one rank: by the sync, no hook; bf16: by the hook); a parameter
    without a gradient this step reads zero after the sync, whatever its buffer held (direct
    gradients: no buffer, a zero tensor)."""
    used, unused = nn.Linear(4, 3, dtype=dtype), nn.Linear(4, 2, dtype=dtype)
    group = CommGroup("dp_cp", [0], None, CommStats(), 0)
    ddp = DataParallel([nn.ModuleList([used, unused])], group,
                       ParallelConfig(bucket_size=4, use_distributed_optimizer=zero))
    assert ddp.hooked == (dtype == torch.bfloat16)
    assert ddp.direct_grads == (dtype == torch.float64 and not zero)
    x = torch.ones(5, 4, dtype=dtype)
    for step in range(2):
        ddp.zero_grad()
        assert (ddp.buffers.grad_data is None) == ddp.direct_grads
        if step and ddp.buffers.grad_data is not None:
            ddp.buffers.grad_data.fill_(123.0)  # stale values from a previous step
        for _ in range(2):
            used(x).sum().backward()
        ddp.finish_grad_sync()
        torch.testing.assert_close(grad_of(used.weight),
                                   torch.full((3, 4), 10.0, dtype=ddp.buffers.grad_dtype))
        torch.testing.assert_close(grad_of(used.bias),
                                   torch.full((3,), 10.0, dtype=ddp.buffers.grad_dtype))
        for p in unused.parameters():
            got = grad_of(p)
            assert got is not None and torch.count_nonzero(got) == 0


def test_grad_hooks_do_not_keep_their_owner_alive() -> None:
    """``hook_grads`` calls the owner's method after each gradient while the owner lives, and
    holds it weakly: a hook lives in the parameter's C++ state, where a strong reference
    would make parameter -> hook -> owner -> buffers -> parameter a cycle that no collection
    frees (every Trainer of a test process kept its model and process groups for good)."""
    import gc
    import weakref

    class Owner:
        def __init__(self, buffers: FlatBuffers) -> None:
            self.buffers, self.seen = buffers, []
            buffers.hook_grads(self.on_grad)

        def on_grad(self, param: nn.Parameter) -> None:
            self.seen.append(tuple(param.shape))

    layer = nn.Linear(3, 2)
    owner = Owner(FlatBuffers([list(layer.parameters())], bucket_size=64))
    layer(torch.ones(1, 3)).sum().backward()
    assert sorted(owner.seen) == [(2,), (2, 3)]
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None
    layer(torch.ones(1, 3)).sum().backward()  # the hooks outlive their owner harmlessly
