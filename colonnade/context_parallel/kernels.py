"""The attention block kernel of context parallelism: one (query block, key block) pair.

Ring attention computes a query block's attention over the whole sequence one key/value block
at a time. Each block returns its partial output and the log-sum-exp of its scores, and the
partials are combined exactly by the online-softmax merge. For queries q [n, d] (one batch
entry and head), keys k / values v [m, d], the scale c and a boolean mask M (True = attend)::

    S = c q k^T                      [n, m]   (masked entries -inf)
    lse_i = log sum_j exp(S_ij)      [n]      (-inf for a fully masked row)
    P = exp(S - lse)                 [n, m]   (0 on a fully masked row)
    out = P v                        [n, d]   (0 on a fully masked row)

Merge of two partials over disjoint key sets (:func:`merge`)::

    lse = logaddexp(lse1, lse2)
    out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2

With the *final* (merged) ``out`` and ``lse`` of a row, the gradient contribution of one key
block is what an ordinary attention backward computes for that block alone
(:func:`block_backward`), with D_i = sum_d dout_id out_id taken from the final out::

    P = exp(S - lse_final);  dP = dout v^T;  dS = P * (dP - D)
    dq = c dS k;  dk = c dS^T q;  dv = P^T dout

Attention dropout (``drop``: Z = keep / (1 - p) of the block's [b, a, n, m] entries, drawn by
:class:`colonnade.context_parallel.block_dropout.BlockDropout` from the global positions) acts
on the probabilities after the softmax, so the normaliser is untouched and the merge stays
exact: out_blk = (P Z) v with P = exp(S - lse_blk). In backward, with the final out (which is
the dropped output) D_i = sum_d dout_id out_id = sum_j P_ij dP_ij still holds::

    dP = Z * (dout v^T);  dS = P * (dP - D);  dv = (P Z)^T dout

Kernel choice, made in :func:`kernel_kind` only: eager math for any block with dropout (no
fused kernel takes an external keep-mask); else the fused aten CPU flash kernel on CPU (every
floating dtype); on CUDA the aten flash kernel for fp16 / bf16 blocks without a mask and the
aten memory-efficient kernel (additive mask) for fp16 / bf16 / fp32 otherwise; eager math
(fp32 / fp64 scores) for everything else (fp64 on CUDA, odd head sizes). The eager path is
also the tests' oracle. The CUDA branches are not run by the test suite (no GPU there); they
were checked on an H200 (torch 2.11) against the eager math: bf16 rel err <= 4e-3 for out and
every gradient (flash and efficient, GQA, masks with fully masked rows), fp32 < 1e-5, ring at
cp 1 with doc_ids vs fp64 SDPA likewise; a [1, 32, 4096, 128] bf16 causal block took 0.58 ms
fused vs 16 ms eager, with a document mask 2.7 ms (efficient) vs 16 ms.

GQA: k / v have kv heads, q has a = g kv heads (query head h reads kv head h // g). The kernels
expand k / v locally (``repeat_interleave`` over the head dim) and sum dk / dv back per kv
head; the caller never sends expanded tensors.

Causality is top-left aligned: query row i of the block attends key column j iff j <= i (the
ring uses it only on square diagonal blocks).
"""

from __future__ import annotations

import torch

from colonnade.context_parallel import masks

CPU_FLASH = "cpu_flash"
CUDA_FLASH = "cuda_flash"
CUDA_EFFICIENT = "cuda_efficient"
EAGER = "eager"


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the log-sum-exp (and of the merge's accumulation): fp64 for fp64 inputs, fp32
    otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def kernel_kind(device: str, dtype: torch.dtype, head_dim: int, masked: bool,
                dropout: bool = False) -> str:
    """The ONE place the block kernel is chosen (see the module doc): dropout -> eager math;
    CPU -> aten CPU flash; CUDA fp16 / bf16 unmasked -> flash; CUDA fp16 / bf16 / fp32
    otherwise -> memory-efficient (head_dim % 8 == 0 and <= 256 for both); anything else ->
    eager math."""
    if dropout:
        return EAGER
    if device == "cpu" and dtype in (torch.float64, torch.float32, torch.bfloat16,
                                     torch.float16):
        return CPU_FLASH
    if device != "cuda" or head_dim % 8 or head_dim > 256:
        return EAGER
    if dtype in (torch.float16, torch.bfloat16) and not masked:
        return CUDA_FLASH
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return CUDA_EFFICIENT
    return EAGER


def _fused_kind(q: torch.Tensor, mask: torch.Tensor | None, drop: torch.Tensor | None) -> str:
    """:func:`kernel_kind` of a block (causality is native to every kernel)."""
    return kernel_kind(q.device.type, q.dtype, q.shape[-1], mask is not None, drop is not None)


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, kv, m, d] -> [b, heads, m, d]: kv head j serves query heads j g .. j g + g - 1."""
    kv = x.shape[1]
    if heads % kv:
        raise ValueError(f"query heads {heads} must be a multiple of kv heads {kv}")
    return x if kv == heads else x.repeat_interleave(heads // kv, dim=1)


def reduce_kv(dx: torch.Tensor, kv: int) -> torch.Tensor:
    """[b, a, m, d] -> [b, kv, m, d]: sum the gradients of each kv head's g query heads."""
    b, a, m, d = dx.shape
    return dx if a == kv else dx.view(b, kv, a // kv, m, d).sum(dim=2)


def full_mask(n: int, m: int, causal: bool, mask: torch.Tensor | None,
              device: torch.device) -> torch.Tensor | None:
    """Boolean [.., n, m] mask (True = attend) combining ``mask`` (broadcastable to
    [b, 1, n, m]) and top-left causality; None when nothing is masked."""
    tri = masks.band(torch.arange(n, device=device), torch.arange(m, device=device),
                     None) if causal else None  # [n, m], j <= i
    if mask is None:
        return tri
    return mask if tri is None else mask & tri


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask -> additive bias of ``dtype`` (0 where True, -inf where False)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill(~mask, float("-inf"))


def _dead_rows(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Rows with no key to attend: bool [.., n] (None when there is no mask)."""
    return None if mask is None else ~mask.any(dim=-1)


def eager_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  mask: torch.Tensor | None, scale: float, drop: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference math: q [b, a, n, d], k / v [b, kv, m, d] -> (out [b, a, n, d] in q's dtype,
    lse [b, a, n] in :func:`lse_dtype`); scores in the lse dtype. ``drop`` [b, a, n, m]:
    keep / (1 - p) multiplying the probabilities (dropout; lse is the undropped one)."""
    acc = lse_dtype(q.dtype)
    a, n, m = q.shape[1], q.shape[2], k.shape[2]
    kf, vf = expand_kv(k, a).to(acc), expand_kv(v, a).to(acc)
    s = torch.matmul(q.to(acc), kf.transpose(-1, -2)) * scale  # [b, a, n, m]
    allowed = full_mask(n, m, causal, mask, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [b, a, n]
    p = torch.exp(s - _finite(lse).unsqueeze(-1))  # [b, a, n, m]
    if drop is not None:
        p = p * drop
    out = torch.matmul(p, vf)  # [b, a, n, d]
    return out.to(q.dtype), lse


def eager_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                   mask: torch.Tensor | None, scale: float, drop: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference gradient of one block given the final out / lse (module doc); ``drop`` as
    in :func:`eager_forward`."""
    acc = lse_dtype(q.dtype)
    a, n, m, kv = q.shape[1], q.shape[2], k.shape[2], k.shape[1]
    qf, kf, vf = q.to(acc), expand_kv(k, a).to(acc), expand_kv(v, a).to(acc)
    do = dout.to(acc)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [b, a, n, m]
    allowed = full_mask(n, m, causal, mask, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.exp(s - _finite(lse.to(acc)).unsqueeze(-1))  # [b, a, n, m]
    dp = torch.matmul(do, vf.transpose(-1, -2))  # [b, a, n, m]
    kept = p if drop is None else p * drop  # P Z
    if drop is not None:
        dp = dp * drop
    big_d = (do * out.to(acc)).sum(dim=-1, keepdim=True)  # [b, a, n, 1]
    ds = p * (dp - big_d)
    dq = torch.matmul(ds, kf) * scale  # [b, a, n, d]
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale  # [b, a, m, d]
    dv = torch.matmul(kept.transpose(-1, -2), do)  # [b, a, m, d]
    return dq.to(q.dtype), reduce_kv(dk, kv).to(k.dtype), reduce_kv(dv, kv).to(v.dtype)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (fully masked rows) replaced by 0, so exp(S - lse) is 0 there, not NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _efficient_bias(q: torch.Tensor, m: int, allowed: torch.Tensor | None) -> torch.Tensor:
    """Additive bias [b, a, n, m] for the CUDA efficient kernel: its rows padded to a multiple
    of 16 elements in memory (the kernel's alignment), broadcast over batch / heads."""
    b, a, n, _ = q.shape
    if allowed is None:
        allowed = torch.ones(n, m, dtype=torch.bool, device=q.device)
    padded = torch.zeros(*allowed.shape[:-1], -(-m // 16) * 16, dtype=q.dtype, device=q.device)
    padded[..., :m].masked_fill_(~allowed, float("-inf"))
    return padded[..., :m].expand(b, a, n, m)


def _efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       allowed: torch.Tensor | None, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA memory-efficient kernel (fp16 / bf16 / fp32, any mask); k / v already expanded.
    Its lse comes padded to a multiple of 32 rows: sliced to [b, a, n]."""
    n = q.shape[2]
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _efficient_bias(q, k.shape[2], allowed), True, 0.0, False, scale=scale)
    out, lse = res[0], res[1][:, :, :n]
    dead = _dead_rows(allowed)
    if dead is not None:  # like the CPU kernel: lse 0 for a row with no key
        lse = lse.masked_fill(dead, float("-inf"))
    return out, lse


def _efficient_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, allowed: torch.Tensor | None,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA memory-efficient backward; lse already finite. The kernel reads lse padded to a
    multiple of 32 rows, and (seen on an H200 with torch 2.11, fp16 / bf16) needs ``out`` in
    the [b, n, a, d] memory layout its forward writes: a [b, a, n, d]-contiguous out gives
    wrong dq / dk."""
    n = q.shape[2]
    lse = torch.nn.functional.pad(lse.float(), (0, -(-n // 32) * 32 - n))  # [b, a, n32]
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # [b, a, n, d] view of [b, n, a, d]
    zero = torch.zeros((), dtype=torch.int64)  # dropout 0: the philox state is unused
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, _efficient_bias(q, k.shape[2], allowed), out, lse, zero, zero, 0.0,
        [True, True, True, False], False, scale=scale)
    return dq, dk, dv


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  mask: torch.Tensor | None, scale: float, drop: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: q [b, a, n, d], k / v [b, kv, m, d], ``mask`` bool broadcastable
    to [b, 1, n, m] (True = attend) or None, ``drop`` [b, a, n, m] keep / (1 - p) or None ->
    (out [b, a, n, d], lse [b, a, n] fp32 / fp64). Fully masked rows: out 0, lse -inf."""
    kind = _fused_kind(q, mask, drop)
    if kind == EAGER:
        return eager_forward(q, k, v, causal=causal, mask=mask, scale=scale, drop=drop)
    a = q.shape[1]
    ke, ve = expand_kv(k, a), expand_kv(v, a)
    if kind == CUDA_FLASH:  # not run by the test suite; checked once on an H200
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, ke, ve, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    allowed = full_mask(q.shape[2], k.shape[2], causal, mask, q.device)
    if kind == CUDA_EFFICIENT:
        return _efficient_forward(q, ke, ve, allowed, scale)
    if mask is None:  # the kernel's own (top-left) causality: no [n, m] bias, ~4x faster
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, ke, ve, 0.0, causal, scale=scale)
        return out, lse
    assert allowed is not None
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, ke, ve, 0.0, False, attn_mask=_additive(allowed, q.dtype), scale=scale)
    dead = _dead_rows(allowed)
    assert dead is not None  # the CPU kernel reports lse 0 for a row with no key
    return out, lse.masked_fill(dead, float("-inf"))


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                   mask: torch.Tensor | None, scale: float, drop: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient contribution of one key block: dout / out [b, a, n, d] and lse [b, a, n] the
    FINAL (merged) output and log-sum-exp of the query rows, ``drop`` the forward's ->
    (dq [b, a, n, d], dk [b, kv, m, d], dv [b, kv, m, d]). Rows with lse -inf get zero
    gradients."""
    kind = _fused_kind(q, mask, drop)
    if kind == EAGER:
        return eager_backward(dout, q, k, v, out, lse, causal=causal, mask=mask, scale=scale,
                              drop=drop)
    a, kv = q.shape[1], k.shape[1]
    ke, ve = expand_kv(k, a), expand_kv(v, a)
    lse = _finite(lse)
    if kind == CUDA_FLASH:  # not run by the test suite; checked once on an H200
        # dense (not varlen): no cumulative lengths; dropout 0: the philox state is unused
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse.float(), None, None, q.shape[2], k.shape[2], 0.0,
            causal, empty, empty, scale=scale)
    elif kind == CUDA_EFFICIENT:
        allowed = full_mask(q.shape[2], k.shape[2], causal, mask, q.device)
        dq, dk, dv = _efficient_backward(dout, q, ke, ve, out, lse, allowed, scale)
    elif mask is None:  # the kernel's own causality, as in block_forward
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, causal, scale=scale)
    else:
        allowed = full_mask(q.shape[2], k.shape[2], causal, mask, q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, False, attn_mask=_additive(allowed, q.dtype),
            scale=scale)
    return dq, reduce_kv(dk, kv), reduce_kv(dv, kv)


def merge(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partials over disjoint key sets (module doc):
    out / out_blk [b, a, n, d], lse / lse_blk [b, a, n] -> (out in ``out``'s dtype, lse).
    -inf safe: a row that is -inf in both stays out 0, lse -inf, with no NaN."""
    new = torch.logaddexp(lse, lse_blk)  # [b, a, n]
    safe = _finite(new)
    w1 = torch.exp(lse - safe).unsqueeze(-1)  # [b, a, n, 1]
    w2 = torch.exp(lse_blk - safe).unsqueeze(-1)
    acc = new.dtype
    merged = w1 * out.to(acc) + w2 * out_blk.to(acc)
    return merged.to(out.dtype), new
