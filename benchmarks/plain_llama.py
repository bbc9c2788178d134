"""A plain PyTorch Llama training loop: the baseline the GPU benchmark sets Colonnade against.

No Colonnade code: ``nn.Module`` blocks (RMSNorm, RoPE, grouped-query attention through
``F.scaled_dot_product_attention`` (causal, fused on a GPU), SwiGLU), every block compiled with
``torch.compile`` (regional, as torchtitan does), fp32 parameters with bf16 autocast on a GPU,
AdamW with ``fused=True``. Run as a script it prints one JSON line:

    python benchmarks/plain_llama.py --layers 8 --hidden 4096 --heads 32 --kv-heads 8 \
        --ffn 14336 --vocab 128256 --seq 8192 --batch 1 --steps 8 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """One pre-norm Llama layer on x [b, s, h]."""

    def __init__(self, h: int, heads: int, kv: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv, self.d = heads, kv, h // heads
        self.n1, self.n2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.qkv = nn.Linear(h, (heads + 2 * kv) * self.d, bias=False)
        self.o = nn.Linear(heads * self.d, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, -1, self.d).split(
            [self.heads, self.kv, self.kv], dim=2)  # [b, s, n, d] each
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)  # [b, heads, s, d]
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)  # [b, s, ffn] each
        return x + self.down(F.silu(g) * u)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head of x [b, s, n, d] by angles [s, d/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None], sin[None, :, None]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).type_as(x)


class Llama(nn.Module):
    """Embedding, ``layers`` blocks, final norm, untied head; returns the mean token loss."""

    def __init__(self, layers: int, h: int, heads: int, kv: int, ffn: int, vocab: int,
                 seq: int, theta: float = 500000.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h, heads, kv, ffn) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(h, eps=1e-5), nn.Linear(h, vocab, bias=False)
        d = h // heads
        inv = theta ** (-torch.arange(0, d, 2).float() / d)
        ang = torch.outer(torch.arange(seq).float(), inv)  # [s, d/2]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # [b, s, h]
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(self.norm(x))  # [b, s, V]
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def free_device_memory() -> None:
    """Hand the CUDA caching allocator's blocks back (no-op without a GPU)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
        batch: int, steps: int, device: str, warm: int = 2, compile: bool = True
        ) -> dict[str, float]:
    """Train ``steps`` steps on random tokens; medians of the steps after ``warm``."""
    dev = torch.device(device)
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    model = Llama(layers, hidden, heads, kv_heads, ffn, vocab, seq).to(dev)
    if compile:
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    amp = dev.type == "cuda"
    times, losses = [], []
    for _ in range(steps):
        data = torch.randint(0, vocab, (batch, seq + 1), device=dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # the one host sync per step
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[warm:] or times)
    n = sum(p.numel() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
    return {"tokens_per_s": batch * seq / step_s, "step_s": step_s, "params": n,
            "first_loss": losses[0], "last_loss": losses[-1], "peak_mem_gib": peak,
            "first_step_s": times[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 2), ("hidden", 64), ("heads", 4), ("kv-heads", 2),
                          ("ffn", 128), ("vocab", 256), ("seq", 32), ("batch", 2),
                          ("steps", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    print(json.dumps(run(a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab, a.seq,
                         a.batch, a.steps, a.device, compile=not a.no_compile)))


if __name__ == "__main__":
    main()
