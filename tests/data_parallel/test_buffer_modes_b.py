"""FlatBuffers storage modes of ZeRO-2/3, single process: no gradient buffer
(``full_grads=False``), per-bucket parameter storages with a persistent shard
(``shard_params``), and initial values from a callback for parameters on the meta device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colonnade.data_parallel.buffer import FlatBuffers


def _model(device: str = "cpu") -> nn.Sequential:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(device=device,
                                                                 dtype=torch.float64)
    if device != "meta":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def test_full_grads_false_has_no_gradient_storage() -> None:
    model = _model()
    buffers = FlatBuffers([list(model.parameters())], 50, 2, full_grads=False)
    assert buffers.grad_data is None and buffers.param_data is not None
    assert not any(hasattr(p, "main_grad") for p in model.parameters())


@pytest.mark.parametrize("at_construction", [True, False])
def test_shard_params_keeps_each_ranks_shard(at_construction: bool) -> None:
    """The two ranks' shards concatenated per bucket are the bucket's values (zero padded);
    freeing empties the storage, re-filling it is seen through the parameter views."""
    want = {k: v.clone() for k, v in _model().state_dict().items()}
    shards = []
    for rank in range(2):
        model = _model()
        buffers = FlatBuffers([list(model.parameters())], 100, 2, full_grads=False,
                              shard_params=True, shard_rank=rank if at_construction else None)
        if not at_construction:
            assert buffers.gathered_bytes == buffers.numel * 8  # full until keep_shard
            buffers.keep_shard(rank)
        assert buffers.param_data is None and buffers.gathered_bytes == 0
        assert buffers.shard_data is not None
        assert buffers.shard_data.numel() == buffers.numel // 2
        shards.append([buffers.shard_view(b.index).clone() for b in buffers.buckets])
    for b in buffers.buckets:
        full = buffers.alloc_bucket(b.index)
        full.copy_(torch.cat([shards[0][b.index], shards[1][b.index]]))
    assert buffers.gathered_bytes == buffers.numel * 8
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    for b in buffers.buckets:
        lo, hi = buffers.shard(b, 1)
        assert torch.equal(buffers.shard_view(b.index), buffers.bucket_data[b.index][
            lo - b.start:hi - b.start])
        buffers.free_bucket(b.index)
        assert not buffers.is_gathered(b.index)
    assert buffers.gathered_bytes == 0
    with pytest.raises(ValueError, match="rank 1's shard"):
        buffers.keep_shard(0)


def test_initial_values_fill_meta_parameters_in_place() -> None:
    """Meta-device parameters become buffer views (same Parameter objects, attributes kept),
    holding the values the callback returns, one parameter at a time."""
    model = _model("meta")
    ref = _model()
    values = dict(zip(map(id, model.parameters()), ref.parameters(), strict=True))
    params = list(model.parameters())
    params[0].tag = "kept"  # type: ignore[attr-defined]
    calls = []

    def initial(p: nn.Parameter) -> torch.Tensor:
        calls.append(id(p))
        return values[id(p)].detach()

    buffers = FlatBuffers([params], 100, 2, initial_values=initial)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert params[0].tag == "kept"  # type: ignore[attr-defined]
    assert all(p.device.type == "cpu" and p.requires_grad for p in model.parameters())
    assert sorted(calls) == sorted(map(id, params))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
        slot = buffers.slot(p)
        assert p.data_ptr() == buffers.param_data[slot.start:].data_ptr()  # type: ignore[index]
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(model(x), ref(x))
    sharded_model = _model("meta")
    sharded = FlatBuffers([list(sharded_model.parameters())], 100, 2, full_grads=False,
                          shard_params=True, shard_rank=0,
                          initial_values=lambda p: torch.ones(p.shape, dtype=p.dtype))
    assert sharded.gathered_bytes == 0 and sharded.device.type == "cpu"
    owned = sum(b - a for lo, hi in sharded.owned_ranges(0) for _, a, b in
                sharded.segments(lo, hi))  # parameter elements (ones) in rank 0's shard
    assert int(sharded.shard_data.sum()) == owned > 0  # type: ignore[union-attr]
