"""Sampling text from an exported model: KV cache, temperature, top-k, top-p."""

from __future__ import annotations

import torch

from colonnade.models.gpt import ModelChunk


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the top-k logits and the smallest set whose probability reaches top_p ([b, V])."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before a token already reaches p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def generate(model: ModelChunk, prompt: torch.Tensor, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             use_cache: bool = True, generator: torch.Generator | None = None,
             eod: int | None = None) -> torch.Tensor:
    """Extend prompt [b, s0] by up to ``max_new_tokens``; temperature 0 means greedy.

    With ``use_cache`` each new token runs one position through the layers against cached keys
    and values; without it the whole sequence is recomputed every step (same result).
    """
    model.eval()
    limit = model.cfg.max_seq_len
    if prompt.shape[1] + max_new_tokens > limit:
        max_new_tokens = max(0, limit - prompt.shape[1])
    tokens = prompt
    caches = model.new_caches(prompt.shape[0], limit) if use_cache else None
    pending = prompt
    for _ in range(max_new_tokens):
        logits = model.full_logits(pending if use_cache else tokens, caches)[:, -1]  # [b, V]
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
        pending = nxt
        if eod is not None and bool((nxt == eod).all()):
            break
    return tokens
