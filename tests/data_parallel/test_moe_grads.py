"""Expert parameters in the data-parallel buffers and the distributed optimizer, proven on a
small stand-in mixture-of-experts model (defined here, test-only) in float64.

The stand-in: z = tanh(W_in x + b); each token goes to expert e = argmax(R x + bias_sel) (R a
fixed buffer, ``bias_sel`` a requires_grad=False parameter like the sigmoid router's
expert_bias), the experts' stacked weights [E, h, h] are split over ep (Sharding splits
(("ep", 0),)) and reached through the differentiable all-to-all of parallel/all_to_all.py;
out = W_out (z + W_e z); loss = mean over tokens of |out|^2. Rank r of dp x cp = D takes its
own tokens; the single-process reference takes micro-batch k of all D ranks concatenated
(L = (1/D) sum_r L_r, every rank holding as many tokens) with torch.optim.AdamW and plain L2
clipping. Checked: the reduced gradients of the first step on every owned piece (dense and
expert), the grad norm of every step, the parameters after 3 AdamW steps, the bytes each
group reduced, overlap evidence, the NaN guard through expert gradients, and that the
requires_grad=False parameter is in no buffer and never changes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from colonnade.config.sections import OptimConfig, ParallelConfig
from colonnade.data_parallel.buffer import ALIGN, FlatBuffers
from colonnade.data_parallel.ddp import DataParallel
from colonnade.optim.clip import clip_coefficient
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.optim.lr import lr_at
from colonnade.parallel.all_to_all import all_to_all, all_to_all_rows, exchange_splits
from colonnade.parallel.comm import CommGroup
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.tensor_parallel.sharding import Sharding

H, E, T, M, STEPS = 8, 4, 12, 2, 3  # hidden, experts, tokens per micro-batch, micro-batches
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.1, clip_grad=0.05)


class StandInMoE(nn.Module):
    """Dense in/out projections around one routed-expert layer (experts split over ep)."""

    def __init__(self, ep: CommGroup) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.ep = ep
        self.local = E // ep.size
        first = max(ep.rank, 0) * self.local

        def param(key: str, value: torch.Tensor, splits: tuple[tuple[str, int], ...] = (),
                  grad: bool = True) -> nn.Parameter:
            p = nn.Parameter(value, requires_grad=grad)
            p.sharding = Sharding(key, tuple(value.shape), splits=splits)  # type: ignore[attr-defined]
            return p

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.5

        self.w_in = param("w_in", rand(H, H))
        self.b = param("b", rand(H))
        self.bias_sel = param("bias_sel", rand(E), grad=False)
        full = rand(E, H, H)
        self.experts = param("experts", full[first:first + self.local].clone(),
                             (("ep", 0),))  # [E_local, h, h]
        self.w_out = param("w_out", rand(H, H))
        self.register_buffer("route", rand(E, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [t, h] -> mean over tokens of |W_out (z + W_e z)|^2 (0-d)."""
        z = torch.tanh(x @ self.w_in.T + self.b)  # [t, h]
        expert = (x @ self.route.T + self.bias_sel).argmax(-1)  # [t] global ids
        dest = expert // self.local  # [t] ep rank holding the expert
        order = torch.argsort(dest, stable=True)  # [t]
        splits = torch.bincount(dest, minlength=self.ep.size).tolist()
        out_splits = exchange_splits(splits, self.ep) if self.ep.size > 1 else splits
        sent = all_to_all(z[order], self.ep, splits, out_splits)  # [t_recv, h]
        ids = (all_to_all_rows(expert[order], self.ep, splits, out_splits)
               if self.ep.size > 1 else expert[order])  # [t_recv]
        w = self.experts[ids - max(self.ep.rank, 0) * self.local]  # [t_recv, h, h]
        y = torch.einsum("toh,th->to", w, sent)  # [t_recv, h]
        back = all_to_all(y, self.ep, out_splits, splits)  # [t, h] in `order`
        y_tok = back[torch.argsort(order)]  # [t, h] token order
        out = (z + y_tok) @ self.w_out.T  # [t, h]
        return out.pow(2).sum(-1).mean()


def data(d: int) -> list[list[list[torch.Tensor]]]:
    """data[step][k][r]: micro-batch k of dp x cp rank r, [T, H] float64."""
    gen = torch.Generator().manual_seed(7)
    return [[[torch.randn(T, H, generator=gen, dtype=torch.float64) for _ in range(d)]
             for _ in range(M)] for _ in range(STEPS)]


def reference(d: int) -> dict[str, Any]:
    """Single-process run: first-step gradients, per-step norms, final parameters."""
    model = StandInMoE(ProcessGroups.single().ep)  # type: ignore[arg-type]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim > 1], "weight_decay": OPTIM.weight_decay},
         {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
        lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    grads, norms = {}, []
    for step, micro in enumerate(data(d)):
        opt.zero_grad()
        for parts in micro:
            (model(torch.cat(parts)) / M).backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))  # type: ignore[union-attr]
        norms.append(float(norm))
        if step == 0:
            grads = {p.sharding.key: p.grad.clone() for p in params}  # type: ignore[attr-defined, union-attr]
        for p in params:
            p.grad.mul_(clip_coefficient(norm, OPTIM.clip_grad))  # type: ignore[union-attr]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, STEPS, OPTIM)
        opt.step()
    final = {p.sharding.key: p.detach().clone() for p in model.parameters()}  # type: ignore[attr-defined]
    return {"grads": grads, "norms": norms, "params": final}


def local_slice(p: nn.Parameter, full: torch.Tensor, ep: CommGroup) -> torch.Tensor:
    """This rank's piece of a full reference tensor (experts: its ep block of dim 0)."""
    if "ep" in p.sharding.split_axes:  # type: ignore[attr-defined]
        n = full.shape[0] // ep.size
        return full[max(ep.rank, 0) * n:(max(ep.rank, 0) + 1) * n]
    return full


def rank_moe(dp: int, ep: int, zero: bool, overlap: bool, avg: bool,
             nan: bool = False, shard: int | None = None) -> dict[str, Any]:
    """Rank body: train the stand-in through DataParallel + DistributedOptimizer; errors
    against the reference computed here (every rank has the same reference). ``shard``:
    hybrid sharding's zero_shard_size (dense buckets only; experts shard over expert-dp)."""
    torch.set_num_threads(1)
    groups = ProcessGroups.build(ParallelDims(dp=dp, ep=ep), experts=True,
                                 zero_shard_size=shard)
    assert groups.ep is not None and groups.expert_dp is not None
    model = StandInMoE(groups.ep)
    cfg = ParallelConfig(dp=dp, ep=ep, use_distributed_optimizer=zero, bucket_size=40,
                         overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                         average_in_collective=avg, zero_shard_size=shard)
    ddp = DataParallel([model], groups.dp_cp, cfg, expert_group=groups.expert_dp,
                       shard_group=groups.shard_group, replicate_group=groups.zero_replicate)
    opt = DistributedOptimizer(ddp, OPTIM, groups, STEPS, "fp64")
    ref = reference(dp)
    r = groups.dp_cp.rank
    grad_err, norms, infos = 0.0, [], []
    sel_before = model.bias_sel.detach().clone()
    for step, micro in enumerate(data(dp)):
        if step == STEPS - 1:
            groups.stats.reset()
        opt.zero_grad()
        sync = ddp.grad_sync_hook(M)
        for k, parts in enumerate(micro):
            sync(k)
            (model(parts[r]) / M).backward()
        if nan and step == 0 and r == 0:
            model.experts.main_grad.view(-1)[0] = float("nan")  # type: ignore[attr-defined]
        ddp.finish_grad_sync()
        if step == 0 and not nan:
            grad_err = first_step_error(ddp, ref["grads"], groups.ep)
        info = opt.step()
        ddp.finish_param_gather()
        norms.append(info["grad_norm"])
        infos.append(info)
    param_err = max(float((p.detach() - local_slice(p, ref["params"][p.sharding.key],  # type: ignore[attr-defined]
                                                     groups.ep)).abs().max())
                    for p in model.parameters())
    ops = {k: v.payload_bytes for k, v in groups.stats.ops.items()}
    expert_numel = sum(b.numel for b in ddp.buckets if b.expert)
    return {"grad_err": grad_err, "param_err": param_err, "norms": norms,
            "ref_norms": ref["norms"], "ops": ops, "expert_numel": expert_numel,
            "dense_numel": sum(b.numel for b in ddp.buckets if not b.expert),
            "launched": ddp.launched_in_backward, "buckets": len(ddp.buckets),
            "kinds": sorted({b.expert for b in ddp.buckets}),
            "in_buffers": any(p is model.bias_sel for p in ddp.buffers.params),
            "sel_changed": not torch.equal(sel_before, model.bias_sel.detach()),
            "skipped": [i["skipped"] for i in infos], "edp": groups.expert_dp.size}


def first_step_error(ddp: DataParallel, grads: dict[str, torch.Tensor], ep: CommGroup) -> float:
    """Largest |reduced main_grad - reference gradient| over this rank's owned pieces."""
    err = 0.0
    assert ddp.buffers.grad_data is not None
    for lo, hi in ddp.owned_ranges():
        for p, a, b in ddp.buffers.segments(lo, hi):
            start = ddp.buffers.slot(p).start
            want = local_slice(p, grads[p.sharding.key], ep).reshape(-1)[a - start:b - start]  # type: ignore[attr-defined]
            err = max(err, float((ddp.buffers.grad_data[a:b] - want).abs().max()))
    return err


LAYOUTS = [  # dp (= dp x cp ranks), ep, ZeRO-1, overlap, average_in_collective
    (2, 2, False, True, False),  # edp 1: expert grads only rescaled by 1/D
    (4, 2, False, True, False),  # edp 2 != D 4: the divisor must be D
    (4, 2, True, True, False),
    (4, 2, True, False, False),
    (4, 2, False, False, True),
    (4, 2, True, True, True),
    (2, 1, True, True, False),  # edp = dp_cp (shared process group)
    (4, 4, True, True, False),
]


@pytest.mark.parametrize(("dp", "ep", "zero", "overlap", "avg"), LAYOUTS)
def test_moe_grads_parity(run_ranks: Any, dp: int, ep: int, zero: bool, overlap: bool,
                          avg: bool) -> None:
    results = run_ranks(dp, rank_moe, dp, ep, zero, overlap, avg)
    for res in results:
        assert res["grad_err"] < 1e-12, res["grad_err"]
        assert res["param_err"] < 1e-12, res["param_err"]
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-12, abs=0)
        assert res["norms"][0] > OPTIM.clip_grad  # clipping is active
        assert res["kinds"] == [False, True]
        assert not res["in_buffers"] and not res["sel_changed"]
        assert res["skipped"] == [0.0] * STEPS
        ops, edp = res["ops"], res["edp"]
        kind = "reduce_scatter" if zero else "all_reduce"
        assert ops.get(f"dp_cp/{kind}/grad_bucket") == 8 * res["dense_numel"]
        if edp > 1:
            assert ops.get(f"expert_dp/{kind}/expert_grad_bucket") == 8 * res["expert_numel"]
        assert not any(k.startswith("expert_dp") for k in ops) or edp > 1
        assert not any("expert_grad" in k and not k.startswith("expert_dp/") for k in ops)
        if zero and edp > 1:
            assert ops["expert_dp/all_gather/expert_param_bucket"] == 8 * res[
                "expert_numel"] // edp
        if overlap:
            assert res["launched"] == res["buckets"]


def test_moe_hybrid_sharding(run_ranks: Any) -> None:
    """ZeRO-1 with zero_shard_size=2 on dp4 x ep2: dense buckets shard over pairs and are
    summed over the replicate group, expert buckets shard over expert-dp (2): same numbers."""
    for res in run_ranks(4, rank_moe, 4, 2, True, True, False, False, 2):
        assert res["grad_err"] < 1e-12 and res["param_err"] < 1e-12
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-12, abs=0)
        assert res["ops"]["zero_shard/reduce_scatter/grad_bucket"] == 8 * res["dense_numel"]
        assert res["ops"]["expert_dp/reduce_scatter/expert_grad_bucket"] == 8 * res[
            "expert_numel"]


def test_moe_nan_in_expert_grad_skips_everywhere(run_ranks: Any) -> None:
    """A NaN in one rank's expert gradient (before the reduction) skips the step on every
    rank, ZeRO-1 over expert-dp included."""
    for zero in (False, True):
        results = run_ranks(4, rank_moe, 4, 2, zero, False, False, True)
        for res in results:
            assert res["skipped"] == [1.0, 0.0, 0.0]
            assert res["norms"][0] != res["norms"][0]  # NaN


def test_expert_params_need_expert_group() -> None:
    groups = ProcessGroups.single()
    assert groups.ep is not None
    model = StandInMoE(groups.ep)
    with pytest.raises(ValueError, match="experts=True"):
        DataParallel([model], groups.dp_cp, ParallelConfig())
    ddp = DataParallel([model], groups.dp_cp, ParallelConfig(bucket_size=40),
                       expert_group=groups.expert_dp)
    assert [b.expert for b in ddp.buckets].count(True) >= 1
    assert all(all(("ep" in p.sharding.split_axes) == b.expert for p in b.params)  # type: ignore[attr-defined]
               for b in ddp.buckets)


def test_expert_region_layout() -> None:
    """Each chunk: its dense parameters, then its expert parameters, each kind filling its
    buckets across layers in backward order; expert buckets padded for expert-dp shards."""
    def param(key: str, n: int, expert: bool) -> nn.Parameter:
        p = nn.Parameter(torch.zeros(2, n))
        p.sharding = Sharding(key, (2, n), splits=(("ep", 0),) if expert else ())  # type: ignore[attr-defined]
        return p

    d1, e1, d2, e2 = param("d1", 3, False), param("e1", 5, True), param("d2", 7, False), \
        param("e2", 11, True)
    buffers = FlatBuffers([[d1, e1, d2, e2]], bucket_size=10**6, shard_count=4,
                          expert_shard_count=2)
    assert [(b.expert, b.params) for b in buffers.buckets] == [(False, [d2, d1]),
                                                               (True, [e2, e1])]
    dense, expert = buffers.buckets
    assert (dense.numel, expert.numel) == (4 * ALIGN, 2 * ALIGN)
    assert (dense.first, expert.first) == (0, 1)
    assert buffers.owned_ranges(3, 1) == [(3 * ALIGN, 4 * ALIGN), (5 * ALIGN, 6 * ALIGN)]
    assert buffers.owned_ranges(3, 0) == [(3 * ALIGN, 5 * ALIGN)]  # merged across kinds
    assert buffers.shard(expert, 1) == (4 * ALIGN + ALIGN, 4 * ALIGN + 2 * ALIGN)
