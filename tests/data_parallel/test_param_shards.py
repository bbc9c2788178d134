"""ZeRO-3 ParamShards on its own (no DataParallel): a tiny llama on 2 ranks with its parameters
sharded, each rank running its own micro-batches with plain ``param.grad`` (ParamShards frees
a bucket in backward by itself, counting its parameters' gradient arrivals).

Float64 parity, exact: the sharded model's gradients, evaluation logits and (after the shards
are written, as an optimizer does) the next forward equal an unsharded copy's bit for bit,
with and without ``reshard_after_forward``, with full recompute, prefetch 0, 1 and 2.
Memory with ``reshard_after_forward``: no rank ever holds the full parameter set (peak
gathered bytes <= the buckets one module needs at once, :meth:`ParamShards.in_use_bytes`, plus
prefetch + 1 largest buckets, and < the model's bytes); after a step and after an evaluation
forward every bucket's storage is empty. Without it (the micro-batch-window policy) each
bucket is gathered once per step and the whole model is held until end_step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colonnade.config.sections import Config
from colonnade.data_parallel.buffer import FlatBuffers
from colonnade.data_parallel.ddp import chunk_parameters
from colonnade.data_parallel.param_shards import ParamShards
from colonnade.data_parallel.shard_groups import ShardGroups
from colonnade.models.build import build_chunks, build_reference
from colonnade.models.compile import is_compiled
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from tests.data_parallel.common import tiny_config
from tests.parity import TOL, VOCAB, random_steps, rank_groups, rel_err, resolved

BUCKET = 2000
"""Elements per bucket: a tiny llama (~32k parameters) gets about 16 buckets."""


def _config(recompute: str) -> Config:
    base = tiny_config(arch="llama", dp=2, microbatches=2)
    return resolved(dataclasses.replace(
        base, training=dataclasses.replace(base.training, recompute=recompute)))


def _shard_model(config: Config, reshard: bool, prefetch: int
                 ) -> tuple[nn.Module, FlatBuffers, ParamShards]:
    groups = rank_groups(ParallelDims(dp=2))
    model = build_reference(config)
    buffers = FlatBuffers(chunk_parameters([model]), BUCKET, 2, full_grads=False,
                          shard_params=True)
    shards = ParamShards(buffers, ShardGroups(groups.dp_cp), [model],
                         reshard_after_forward=reshard, prefetch=prefetch)
    return model, buffers, shards


def _case(config: Config, reshard: bool, prefetch: int) -> dict[str, Any]:
    """One rank: a sharded model and an unsharded copy (same seed), 2 micro-batches of this
    rank's own data, an evaluation forward, shards halved, one more forward."""
    rank = dist.get_rank()
    ref = build_reference(config)
    model, buffers, shards = _shard_model(config, reshard, prefetch)
    batches = random_steps(1, 4, 2, 16, VOCAB, seed=7)[0][2 * rank:2 * rank + 2]
    versions = [p._version for p in buffers.params]
    for tokens, labels in batches:
        model(tokens, labels).backward()
        ref(tokens, labels).backward()
    after_backward = shards.gathered_bytes
    shards.end_step()
    grads_equal = all(torch.equal(p.grad, q.grad) for p, q in
                      zip(model.parameters(), ref.parameters(), strict=True))
    step_gathers = shards.gathers
    model.eval()
    ref.eval()
    with torch.no_grad():
        logits_equal = torch.equal(model(batches[0][0]), ref(batches[0][0]))
        after_eval = shards.gathered_bytes
        shards.end_step()  # the optimizer runs after the step's sync: nothing gathered
        for view in shards.owned():  # an "optimizer step" on the shards
            view.mul_(0.5)
        for q in ref.parameters():
            q.mul_(0.5)
        halved_equal = torch.equal(model(batches[1][0]), ref(batches[1][0]))
    shards.end_step()
    sizes = [d.untyped_storage().nbytes() for d in buffers.bucket_data]
    item = buffers.bucket_data[0].element_size()
    return dict(grads_equal=grads_equal, logits_equal=logits_equal, halved_equal=halved_equal,
                after_backward=after_backward, after_eval=after_eval, sizes=sizes,
                peak=shards.peak_gathered_bytes, in_use=shards.in_use_bytes(),
                step_gathers=step_gathers,
                largest=max(b.numel for b in buffers.buckets) * item,
                model_bytes=buffers.num_params * item, buffer_bytes=buffers.numel * item,
                buckets=len(buffers.buckets),
                versions_kept=versions == [p._version for p in buffers.params])


CASES = [
    dict(reshard=True, prefetch=1, recompute="none"),
    dict(reshard=False, prefetch=1, recompute="none"),
    dict(reshard=True, prefetch=0, recompute="full"),
    dict(reshard=True, prefetch=2, recompute="full"),
    dict(reshard=False, prefetch=2, recompute="full"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: (
    f"{'reshard' if c['reshard'] else 'keep'}-prefetch{c['prefetch']}-{c['recompute']}"))
def test_param_shards_parity_and_memory(run_ranks: Callable[..., list[Any]],
                                        case: dict[str, Any]) -> None:
    config = _config(case["recompute"])
    results = run_ranks(2, _case, config, case["reshard"], case["prefetch"])
    for rank, res in enumerate(results):
        assert res["grads_equal"], f"rank {rank}: gradients differ from the unsharded model"
        assert res["logits_equal"], f"rank {rank}: evaluation logits differ"
        assert res["halved_equal"], f"rank {rank}: writes to owned() not seen by the gather"
        assert res["versions_kept"], f"rank {rank}: a gather bumped a parameter's version"
        assert res["buckets"] >= 8, res["buckets"]
        assert res["sizes"] == [0] * res["buckets"], f"rank {rank}: storage left after step"
        if case["reshard"]:
            assert res["peak"] <= res["in_use"] + (case["prefetch"] + 1) * res["largest"], res
            assert res["peak"] < res["model_bytes"], res
            assert res["after_eval"] == 0, f"rank {rank}: evaluation left buckets gathered"
            assert res["after_backward"] == 0, f"rank {rank}: backward left buckets gathered"
        else:
            # the window policy: each bucket gathered once, held for the whole step
            assert res["step_gathers"] == res["buckets"], res
            assert res["peak"] == res["buffer_bytes"], res


class _Skippy(nn.Module):
    """One module owning two weights in one bucket (one pre-backward hook for both); the
    second is used only when asked (an unused parameter)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.w1 = nn.Parameter(torch.randn(8, 8, generator=gen, dtype=torch.float64))
        self.w2 = nn.Parameter(torch.randn(8, 8, generator=gen, dtype=torch.float64))

    def forward(self, x: torch.Tensor, use_w2: bool) -> torch.Tensor:
        y = torch.tanh(x @ self.w1)  # [4, 8]; its input gradient reads w1
        return y @ self.w2 if use_w2 else y


def _skippy() -> dict[str, Any]:
    """Micro-batch 1 leaves w2 unused (the bucket stays gathered: never complete in a pass);
    micro-batch 2 uses both, and the gradient path reports the bucket at w2's arrival (a
    partial launch) while the node of x @ w1 has still to read w1: it must stay gathered until
    the pass completes it."""
    groups = rank_groups(ParallelDims(dp=2))
    model, ref = _Skippy(), _Skippy()
    buffers = FlatBuffers(chunk_parameters([model]), 10**6, 2, full_grads=False,
                          shard_params=True)
    shards = ParamShards(buffers, ShardGroups(groups.dp_cp), [model],
                         reshard_after_forward=True, prefetch=1)
    hook = model.w2.register_post_accumulate_grad_hook(lambda _p: shards.bucket_backward_done(0))
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    xs = [torch.randn(4, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
    kept, equal = [], True
    for x, use_w2 in zip(xs, (False, True), strict=True):
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        model(x1, use_w2).square().sum().backward()
        ref(x2, use_w2).square().sum().backward()
        equal = equal and torch.equal(x1.grad, x2.grad)
        kept.append(shards.gathered_bytes)
    shards.end_step()
    hook.remove()  # it holds shards from the parameter's C++ state: a cycle no collection frees
    equal = equal and all(torch.equal(p.grad, q.grad) for p, q in
                          zip(model.parameters(), ref.parameters(), strict=True))
    return dict(equal=equal, kept=kept, after=shards.gathered_bytes)


def test_param_shards_unused_parameter_and_partial_report(
        run_ranks: Callable[..., list[Any]]) -> None:
    for res in run_ranks(2, _skippy):
        assert res["equal"], "gradients differ from the unsharded copy"
        assert res["kept"][0] > 0, "a bucket with an unused parameter was freed mid-step"
        assert res["kept"][1] == 0, "the bucket complete in micro-batch 2 was not freed"
        assert res["after"] == 0


def test_param_shards_with_compiled_layers() -> None:
    """training.compile: a compiled layer is one hooked site (its descendants none: a hook
    inside the graph would be traced), the gathers stay outside the compiled graphs, and the
    losses and gradients equal the eager unsharded model's (float64; compiled kernels may
    reorder sums: within TOL)."""
    base = tiny_config(arch="llama", dp=1, microbatches=2)
    config = resolved(dataclasses.replace(
        base, training=dataclasses.replace(base.training, compile=True)))
    torch.set_num_threads(1)
    single = ProcessGroups.single()
    (model,) = build_chunks(config, single)
    ref = build_reference(config)
    buffers = FlatBuffers(chunk_parameters([model]), BUCKET, 1, full_grads=False,
                          shard_params=True)
    shards = ParamShards(buffers, ShardGroups(single.dp_cp), [model],
                         reshard_after_forward=True, prefetch=1)
    layers = list(model.layers.values())
    assert all(is_compiled(layer) for layer in layers)
    sites = [site.module for site in shards.sites]
    assert all(any(s is layer for s in sites) for layer in layers)
    assert not any(m is s for layer in layers for m in layer.modules() if m is not layer
                   for s in sites)
    for tokens, labels in random_steps(1, 2, 2, 16, VOCAB, seed=7)[0]:
        loss, want = model(tokens, labels), ref(tokens, labels)
        assert rel_err(loss.detach(), want.detach()) <= TOL
        loss.backward()
        want.backward()
        assert shards.gathered_bytes == 0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) <= TOL
