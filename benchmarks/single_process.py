"""Colonnade's single-process training step against a plain nanoGPT-style PyTorch loop.

    .venv/bin/python benchmarks/single_process.py [--sizes tiny,small] [--rounds 11]
                                                  [--device cpu] [--json PATH]

Both sides train the SAME Llama-style model (the plain one is written here, [b, s, h] layout,
nn.Linear layers, and starts from weights copied out of Colonnade's model), on the SAME
micro-batches, with torch.optim.AdamW (decay on matrices only), global-norm clipping at 1.0 and
gradient accumulation over two micro-batches. Colonnade runs ``Trainer.train_step`` (the path
``colonnade train`` takes). The two are interleaved in rounds of a few steps; the report gives
median tokens/s of each side and Colonnade's overhead = plain / colonnade - 1 (target <= 5%),
by wall clock and by this thread's CPU time (robust on a shared machine; torch runs on one
thread by default here so that the CPU time is the whole cost).
Before timing, the first step's losses of both sides are checked to agree.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.config import Config, load_config, resolve, validate
from colonnade.device import synchronize
from colonnade.models.blocks import rope_tables
from colonnade.optim.lr import lr_at
from colonnade.parallel.groups import ProcessGroups
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime

RESULTS = Path(__file__).resolve().parent / "results" / "single_process.json"
SIZES: dict[str, list[str]] = {
    # the demo's model size: per-step Python overhead is most visible here
    "tiny": ["--model.hidden_size=64", "--model.num_layers=4", "--model.num_heads=4",
             "--model.num_kv_heads=2", "--model.vocab_size=2048", "--training.seq_len=64",
             "--training.micro_batch_size=8"],
    "small": ["--model.hidden_size=256", "--model.num_layers=4", "--model.num_heads=8",
              "--model.num_kv_heads=4", "--model.vocab_size=4096", "--training.seq_len=128",
              "--training.micro_batch_size=8"],
}


# ----------------------------------------------------------------------------- the plain model


class PlainBlock(nn.Module):
    """Pre-norm Llama block on [b, s, h]: RMSNorm, RoPE GQA attention, SwiGLU MLP."""

    def __init__(self, h: int, heads: int, kv: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv, self.d, self.eps = heads, kv, h // heads, eps
        self.attn_norm, self.mlp_norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.q = nn.Linear(h, heads * self.d, bias=False)
        self.k = nn.Linear(h, kv * self.d, bias=False)
        self.v = nn.Linear(h, kv * self.d, bias=False)
        self.o = nn.Linear(heads * self.d, h, bias=False)
        self.gate = nn.Linear(h, ffn, bias=False)
        self.up = nn.Linear(h, ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.norm(x, self.attn_norm)
        q = self.q(y).view(b, s, self.heads, self.d).transpose(1, 2)  # [b, a, s, d]
        k = self.k(y).view(b, s, self.kv, self.d).transpose(1, 2)  # [b, kv, s, d]
        v = self.v(y).view(b, s, self.kv, self.d).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv != self.heads)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        y = self.norm(x, self.mlp_norm)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class PlainLlama(nn.Module):
    """Embedding, blocks, final RMSNorm, untied head; forward returns the mean loss."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        m = cfg.model
        self.embed = nn.Embedding(m.vocab_size, m.hidden_size)
        self.blocks = nn.ModuleList(PlainBlock(m.hidden_size, m.num_heads, m.kv_heads,
                                               m.ffn_size, m.norm_eps)
                                    for _ in range(m.num_layers))
        self.final_norm = nn.Parameter(torch.ones(m.hidden_size))
        self.head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)
        cos, sin = rope_tables(m, None, torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.eps = m.norm_eps

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embed(tokens)  # [b, s, h]
        cos, sin = self.cos[:s], self.sin[:s]
        for block in self.blocks:
            x = block(x, cos, sin)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.final_norm
        logits = self.head(x)  # [b, s, V]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))

    @torch.no_grad()
    def copy_from(self, state: dict[str, torch.Tensor]) -> None:
        """Load Colonnade's full tensors (keyed by global name)."""
        self.embed.weight.copy_(state["embedding.word.weight"])
        self.head.weight.copy_(state["head.weight"])
        self.final_norm.copy_(state["final_norm.weight"])
        for i, blk in enumerate(self.blocks):
            pre = f"layers.{i}."
            blk.attn_norm.copy_(state[pre + "attn_norm.weight"])
            blk.mlp_norm.copy_(state[pre + "mlp_norm.weight"])
            for name in ("q", "k", "v", "o"):
                getattr(blk, name).weight.copy_(state[f"{pre}attn.{name}.weight"])
            for name in ("gate", "up", "down"):
                getattr(blk, name).weight.copy_(state[f"{pre}mlp.{name}.weight"])


class PlainLoop:
    """nanoGPT's step: accumulate micro-batches, clip, set the LR, AdamW, zero grads."""

    def __init__(self, cfg: Config, state: dict[str, torch.Tensor], device: torch.device) -> None:
        self.cfg = cfg
        self.model = PlainLlama(cfg).to(device)
        self.model.copy_from(state)
        params = list(self.model.parameters())
        o = cfg.optim
        self.opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim > 1], "weight_decay": o.weight_decay},
             {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        self.step = 0

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        total = 0.0
        for tokens, labels in batches:
            loss = self.model(tokens, labels) / len(batches)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip_grad)
        lr = lr_at(self.step, self.cfg.training.steps, self.cfg.optim)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return total


# ----------------------------------------------------------------------------- measurement


def make_config(size: str, device: str) -> Config:
    args = [*SIZES[size], "--model.arch=llama", "--model.max_seq_len=256",
            "--training.microbatches=2", "--training.steps=1000", "--training.precision=fp32",
            f"--training.device={device}", "--optim.warmup_steps=10"]
    return validate(resolve(load_config(None, args), 1), 1)


def make_batches(cfg: Config, count: int, device: torch.device) -> list[list[Any]]:
    """``count`` steps of micro-batches of random tokens (identical for both sides)."""
    gen = torch.Generator().manual_seed(0)
    tr, v = cfg.training, cfg.model.vocab_size
    steps = []
    for _ in range(count):
        step = []
        for _ in range(int(tr.microbatches or 1)):
            seq = torch.randint(0, v, (tr.micro_batch_size, tr.seq_len + 1), generator=gen)
            step.append((seq[:, :-1].to(device), seq[:, 1:].to(device)))
        steps.append(step)
    return steps


def timed(fn: Any, batches: list[list[Any]], device: torch.device) -> tuple[float, float]:
    """Wall-clock and this thread's CPU seconds for one pass over ``batches``.

    On a shared CPU machine the CPU time is the robust measure: it ignores time spent
    descheduled by other processes (torch runs single-threaded here, see --threads).
    """
    synchronize(device)
    start, cpu = time.perf_counter(), time.thread_time()
    for b in batches:
        fn(b)
    synchronize(device)
    return time.perf_counter() - start, time.thread_time() - cpu


def bench_size(size: str, rounds: int, steps_per_round: int, device: torch.device
               ) -> dict[str, Any]:
    cfg = make_config(size, device.type)
    trainer = Trainer(Runtime(cfg, device, ProcessGroups.single()))
    state = {p.sharding.key: p.detach().clone() for p in trainer.chunks[0].parameters()}
    plain = PlainLoop(cfg, state, device)
    batches = make_batches(cfg, steps_per_round, device)
    # same model, same data: the first step's loss must agree
    first_ours = trainer.train_step(batches[0])["loss"]
    first_plain = plain.train_step(batches[0])
    if not math.isclose(first_ours, first_plain, rel_tol=1e-4):
        raise AssertionError(f"losses differ: colonnade {first_ours} vs plain {first_plain}")
    for b in batches:  # warm-up
        trainer.train_step(b)
        plain.train_step(b)
    tokens = steps_per_round * int(cfg.training.global_batch_size or 1) * cfg.training.seq_len
    times: dict[str, list[tuple[float, float]]] = {"colonnade": [], "plain": []}
    for r in range(rounds):
        pair = [("colonnade", trainer.train_step), ("plain", plain.train_step)]
        if r % 2:
            pair.reverse()  # alternate who goes first
        for name, fn in pair:
            times[name].append(timed(fn, batches, device))
    out: dict[str, Any] = {"size": size, "params": sum(v.numel() for v in state.values()),
                           "tokens_per_step": tokens // steps_per_round,
                           "first_loss": {"colonnade": first_ours, "plain": first_plain},
                           "rounds": rounds, "steps_per_round": steps_per_round}
    for clock, i in (("wall", 0), ("cpu", 1)):
        ours = [tokens / t[i] for t in times["colonnade"]]
        theirs = [tokens / t[i] for t in times["plain"]]
        ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
        out[clock] = {"colonnade_tokens_per_s": statistics.median(ours),
                      "plain_tokens_per_s": statistics.median(theirs),
                      "overhead": statistics.median(theirs) / statistics.median(ours) - 1.0,
                      "median_pairwise_overhead": statistics.median(ratios) - 1.0}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,small")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--steps", type=int, default=2, help="steps per round and side")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1 makes CPU time meaningful; 0: torch default)")
    p.add_argument("--json", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    records = []
    print(f"{'size':<6} {'params':>9} {'tok/step':>8} {'clock':>5} {'colonnade tok/s':>16} "
          f"{'plain tok/s':>12} {'overhead':>9} {'pairwise':>9}")
    for size in args.sizes.split(","):
        rec = bench_size(size, args.rounds, args.steps, device)
        records.append(rec)
        for clock in ("wall", "cpu"):
            r = rec[clock]
            print(f"{size:<6} {rec['params']:>9,} {rec['tokens_per_step']:>8} {clock:>5} "
                  f"{r['colonnade_tokens_per_s']:>16,.0f} {r['plain_tokens_per_s']:>12,.0f} "
                  f"{100 * r['overhead']:>8.1f}% {100 * r['median_pairwise_overhead']:>8.1f}%")
    out = {"device": str(device), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "target_overhead": 0.05, "results": records}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
