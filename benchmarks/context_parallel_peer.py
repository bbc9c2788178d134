"""The peer of benchmarks/context_parallel.py: picotron's ring attention, re-implemented.

torch's experimental context-parallel API (torch.distributed.tensor.experimental
.context_parallel) does not run on CPU (:func:`probe_torch_cp` records why on every run: with
torch 2.13 the default SDPA dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``,
which has no DTensor sharding strategy, NotImplementedError - the CP handlers cover only the
CUDA flash / efficient / cuDNN ops; the math backend fails on a Tensor/DTensor mix in its
decomposition). So the peer is picotron's approach (huggingface/picotron
context_parallel.py, itself after zhuzilin/ring-flash-attention), written here from its
description:

* *contiguous* split: rank r holds rows [r n, (r+1) n), n = s / cp (no causal load balance:
  rank cp-1 computes cp blocks while rank 0 computes one);
* blocks in eager maths (scores materialised: S = q k^T scale [n, n] per head,
  lse = logsumexp_j S, out = exp(S - lse) v), or (``kernel='fused'``) PyTorch's fused CPU
  flash kernel, the one colonnade uses, to compare the algorithms alone;
* partial results merged by log-sum-exp; k/v sent to rank r+1 / received from r-1 with
  ``batch_isend_irecv`` posted before the block's compute and waited after it;
* backward: P = exp(S - lse) recomputed, dV = P^T dO, dS = P (dO V^T - rowsum(dO o O)),
  dQ = dS K scale, dK = dS^T Q scale; the dK/dV accumulators travel with their k/v block and
  come home by one last exchange.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def contiguous_local(x: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """Rows [r n, (r+1) n) of ``x`` along ``dim`` (n = s / cp): picotron's split."""
    n = x.shape[dim] // cp
    return x.narrow(dim, rank * n, n)


def eager_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of attention in eager maths: q [b, a, n, d], k/v [b, a, m, d] ->
    out [b, a, n, d], lse [b, a, n] (at least fp32). S = q k^T scale [b, a, n, m] (causal: the
    diagonal block, j > i masked), lse = logsumexp_j S, out = exp(S - lse) v."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q, k.transpose(-2, -1)).to(acc) * scale  # [b, a, n, m]
    if causal:
        n, m = scores.shape[-2:]
        scores.masked_fill_(torch.ones(n, m, dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [b, a, n]
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype), v)  # [b, a, n, d]
    return out, lse


def eager_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's gradient contributions given the FINAL out / lse [b, a, n(, d)]:
    P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO o O)), dQ = dS K scale,
    dK = dS^T Q scale. Returns dq [b, a, n, d], dk, dv [b, a, m, d]."""
    acc = lse.dtype
    scores = torch.matmul(q, k.transpose(-2, -1)).to(acc) * scale  # [b, a, n, m]
    if causal:
        n, m = scores.shape[-2:]
        scores.masked_fill_(torch.ones(n, m, dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp(scores - lse.unsqueeze(-1))  # [b, a, n, m]
    do = dout.to(acc)
    dv = torch.matmul(p.transpose(-2, -1), do)  # [b, a, m, d]
    delta = (do * out.to(acc)).sum(-1, keepdim=True)  # [b, a, n, 1]
    ds = p * (torch.matmul(do, v.to(acc).transpose(-2, -1)) - delta)  # [b, a, n, m]
    dq = torch.matmul(ds, k.to(acc)) * scale  # [b, a, n, d]
    dk = torch.matmul(ds.transpose(-2, -1), q.to(acc)) * scale  # [b, a, m, d]
    return dq, dk, dv


def fused_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`eager_block` by PyTorch's fused CPU flash kernel (no [n, m] scores kept):
    out [b, a, n, d], lse [b, a, n] (fp32, fp64 for fp64 inputs)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)[:2]
    return out, lse


def fused_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`eager_block_backward` by the fused CPU kernel's backward (given the final
    out / lse it returns exactly this block's contributions)."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    return dq, dk, dv


KERNELS = {"eager": (eager_block, eager_block_backward),
           "fused": (fused_block, fused_block_backward)}
"""The peer's block kernels: picotron's eager maths, or the fused one colonnade also uses."""


def merge_lse(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-merge two partial attentions of the same queries: L = log(e^lse + e^blk_lse),
    out = e^(lse - L) out + e^(blk_lse - L) blk_out ([b, a, n, d], lse [b, a, n])."""
    new = torch.logaddexp(lse, blk_lse)  # [b, a, n]
    merged = (torch.exp(lse - new).unsqueeze(-1) * out.to(new.dtype)
              + torch.exp(blk_lse - new).unsqueeze(-1) * blk_out.to(new.dtype))
    return merged.to(out.dtype), new


class RingExchange:
    """Post: send tensors to rank r+1 and receive same-shaped ones from r-1 (default group,
    ``batch_isend_irecv``); ``wait`` returns them and adds the blocked seconds to ``waited``."""

    def __init__(self) -> None:
        self.waited = 0.0
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def post(self, tensors: list[torch.Tensor], tag: int) -> Callable[[], list[torch.Tensor]]:
        """Start the exchange; the returned function waits for it."""
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        bufs = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]  # contiguous
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, tag=tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, prev, tag=tag) for b in bufs]
        works = dist.batch_isend_irecv(ops)

        def wait() -> list[torch.Tensor]:
            start = time.perf_counter()
            for w in works:
                w.wait()
            self.waited += time.perf_counter() - start
            return bufs

        return wait


class PicotronRingAttention(torch.autograd.Function):
    """The peer's ring attention on contiguous rows (see the module doc); q/k/v [b, a, n, d];
    ``kernel`` a key of :data:`KERNELS`."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                ex: RingExchange, kernel: str) -> torch.Tensor:
        r, cp = ex.rank, ex.size
        block = KERNELS[kernel][0]
        out = lse = None
        kb, vb = k, v
        for step in range(cp):  # holds the k/v block of rank r - step
            wait = ex.post([kb, vb], 0) if step + 1 < cp else None
            if step <= r:  # causal: later ranks' keys are all masked
                blk = block(q, kb, vb, scale, step == 0)
                out, lse = blk if out is None else merge_lse(out, lse, *blk)
            if wait is not None:
                kb, vb = wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.ex, ctx.kernel = scale, ex, kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ex: RingExchange = ctx.ex
        r, cp = ex.rank, ex.size
        block_backward = KERNELS[ctx.kernel][1]
        dq = torch.zeros(q.shape, dtype=lse.dtype)
        kb, vb, wait_dkv = k, v, None
        for step in range(cp):
            wait_kv = ex.post([kb, vb], 0) if step + 1 < cp else None
            dk = dv = None
            if step <= r:  # (always at step 0)
                dq_b, dk, dv = block_backward(dout, q, kb, vb, out, lse, ctx.scale, step == 0)
                dq += dq_b
            if wait_dkv is not None:  # the accumulators of the block now held
                dk_in, dv_in = wait_dkv()
                dk = dk_in if dk is None else dk + dk_in
                dv = dv_in if dv is None else dv + dv_in
            assert dk is not None and dv is not None
            if wait_kv is not None:
                kb, vb = wait_kv()
            wait_dkv = ex.post([dk, dv], 1)
        assert wait_dkv is not None
        dk, dv = wait_dkv()  # our own block's, home after a full turn
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def probe_torch_cp() -> str | None:
    """Rank function: torch's experimental context_parallel on a tiny causal SDPA (forward);
    None if it runs, else the errors (default backend; math backend)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    errors = []
    for backend in (None, SDPBackend.MATH):
        q, k, v = (torch.randn(1, 2, 8 * dist.get_world_size(), 8) for _ in range(3))
        try:
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                if backend is None:
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                else:
                    with sdpa_kernel(backend):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return None
        except Exception as err:  # recorded, not raised: the answer is the error
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            errors.append(f"{backend or 'default'}: {type(err).__name__}: {first[:300]}")
    return "; ".join(errors)
