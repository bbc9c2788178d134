"""The peer-table workloads, shared by every side-by-side benchmark (one definition, one data).

A :class:`Workload` fixes the model shape and the training hyper-parameters; from it come

* :func:`colonnade_config`: Colonnade's resolved, validated Config for a layout (``extra``
  overrides such as ``--parallel.tp=2``), fp32, no clipping (clip_grad 0), no dropout, a
  constant learning rate (no warmup, no decay), eval off;
* :func:`plain_model`: the same model written in plain ``torch.nn`` ([b, s, h] layout,
  ``nn.Linear`` q / k / v / o and fc / proj (gpt2) or gate / up / down (llama),
  ``F.scaled_dot_product_attention(is_causal=True)``), its weights copied out of Colonnade's
  single-process model (Colonnade's init is layout-independent, so every framework starts from
  the same weights in every layout);
* :func:`plain_optimizer`: ``torch.optim.AdamW`` with Colonnade's parameter groups (weight decay
  on matrices, none on norms and biases), betas and eps; PyTorch's default implementation
  choice (foreach);
* :func:`batches`: the same uniform random tokens for every framework and layout: the global
  batch of step i is fixed, a dp rank takes its contiguous rows of it.

Maths of the plain models (identical to Colonnade's, so losses agree to fp32 rounding):

* gpt2: x = E[tok] + P[pos]; per block x += o(attn(LN1 x)), x += proj(gelu_tanh(fc(LN2 x)))
  with gelu_tanh(z) = z/2 (1 + tanh(sqrt(2/pi)(z + 0.044715 z^3))) (HF GPT-2's gelu_new),
  biases everywhere, head tied to E: logits = LN_f(x) E^T.
* llama: x = E[tok]; per block x += o(attn(RMS1 x)) with RoPE (half-split pairs
  (x_i, x_{i+d/2}), angle pos theta^(-2i/d)) and grouped-query heads, x += down(silu(gate y) *
  up y), y = RMS2 x; untied head; RMSNorm(x) = x / sqrt(mean(x^2) + eps) w.
* loss: mean cross entropy over the b s tokens (:func:`plain_loss`).

Benchmarks check that the first steps' losses agree (:func:`first_loss_check`) before timing.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.config import Config, load_config, resolve, validate
from colonnade.models.build import build_reference

Batch = tuple[torch.Tensor, torch.Tensor]
"""tokens [b, s], labels [b, s] (int64)."""


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: model shape and training hyper-parameters."""

    name: str
    """Key in :data:`WORKLOADS` and the value of the benchmarks' ``--workload``."""
    arch: str
    """Colonnade model.arch: 'gpt2' or 'llama'."""
    hidden: int
    """Model width h."""
    layers: int
    """Transformer layers."""
    heads: int
    """Query heads a (head dim d = h / a)."""
    kv_heads: int
    """Key/value heads (grouped-query attention when < heads)."""
    vocab: int
    """Vocabulary size V."""
    seq_len: int
    """Tokens per sample s (also the position table / RoPE length)."""
    global_batch: int
    """Samples per optimizer step over all dp ranks (tokens/step = global_batch x seq_len)."""
    lr: float
    """Constant AdamW learning rate (no warmup, no decay)."""
    weight_decay: float
    """Decoupled weight decay on matrices (none on norms and biases)."""
    seed: int = 1234
    """Colonnade's training.seed: the initial weights every framework copies."""

    @property
    def tied(self) -> bool:
        """gpt2 ties the head to the word embedding; llama does not."""
        return self.arch == "gpt2"

    @property
    def bias(self) -> bool:
        """gpt2 has biases in every linear layer and LayerNorm; llama none."""
        return self.arch == "gpt2"

    @property
    def tokens_per_step(self) -> int:
        """global_batch x seq_len."""
        return self.global_batch * self.seq_len

    def overrides(self, micro_batch: int, extra: Sequence[str] = ()) -> list[str]:
        """Colonnade ``--section.field=value`` overrides of this workload with ``micro_batch``
        samples per forward; ``extra`` (e.g. ``--parallel.tp=2``) come last and win."""
        return [
            f"--model.arch={self.arch}", f"--model.hidden_size={self.hidden}",
            f"--model.num_layers={self.layers}", f"--model.num_heads={self.heads}",
            f"--model.num_kv_heads={self.kv_heads}", f"--model.vocab_size={self.vocab}",
            f"--model.max_seq_len={self.seq_len}",
            f"--model.tie_embeddings={str(self.tied).lower()}",
            f"--model.bias={str(self.bias).lower()}",
            "--model.hidden_dropout=0", "--model.attention_dropout=0",
            f"--training.seq_len={self.seq_len}", f"--training.micro_batch_size={micro_batch}",
            f"--training.global_batch_size={self.global_batch}", "--training.precision=fp32",
            "--training.steps=1000000", "--training.eval_interval=0", "--training.device=cpu",
            f"--training.seed={self.seed}",
            f"--optim.lr={self.lr}", f"--optim.min_lr={self.lr}", "--optim.warmup_steps=0",
            "--optim.decay=constant", f"--optim.weight_decay={self.weight_decay}",
            "--optim.clip_grad=0",
            *extra,
        ]


WORKLOADS: dict[str, Workload] = {
    # issue 19's "GPT-2 tiny": 2048 tokens/step
    "gpt2-tiny": Workload(name="gpt2-tiny", arch="gpt2", hidden=256, layers=4, heads=4,
                          kv_heads=4, vocab=1024, seq_len=128, global_batch=16, lr=1e-3,
                          weight_decay=0.1),
    # configs/tiny-llama.toml's shapes (seq 64, micro 8 x 2 micro-batches = 16 samples)
    "llama-tiny": Workload(name="llama-tiny", arch="llama", hidden=64, layers=4, heads=4,
                           kv_heads=2, vocab=2048, seq_len=64, global_batch=16, lr=1e-3,
                           weight_decay=0.1),
}
"""The issue's workloads by name."""


def colonnade_config(w: Workload, micro_batch: int, world: int = 1,
                     extra: Sequence[str] = ()) -> Config:
    """Colonnade's Config of ``w`` on ``world`` ranks (resolved and validated); the layout comes
    from ``extra`` (dp is derived: world / (tp pp cp))."""
    return validate(resolve(load_config(None, w.overrides(micro_batch, extra)), world), world)


# ----------------------------------------------------------------------------- plain model


class RMSNorm(nn.Module):
    """y = x / sqrt(mean_h(x^2) + eps) w on x [..., h] (Colonnade's formula, eager ops)."""

    def __init__(self, h: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq: int, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [seq, d/2] of angles pos theta^(-2i/d) (computed in float64, stored fp32)."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)  # [seq, d/2]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) of x [b, n, s, d] by cos / sin [s, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class PlainBlock(nn.Module):
    """Pre-norm decoder block on x [b, s, h] -> [b, s, h] (gpt2 or llama, see the module
    docstring). Head counts are read from the projections' output width at run time (``view``
    with -1 heads), so a column-parallel q / k / v holding a/tp heads works unchanged."""

    def __init__(self, w: Workload, eps: float, theta: float) -> None:
        super().__init__()
        h, d, llama = w.hidden, w.hidden // w.heads, w.arch == "llama"
        self.d, self.llama, self.gqa = d, llama, w.kv_heads != w.heads
        norm = (lambda: RMSNorm(h, eps)) if llama else (lambda: nn.LayerNorm(h, eps))
        self.attn_norm, self.mlp_norm = norm(), norm()
        self.q = nn.Linear(h, w.heads * d, bias=w.bias)
        self.k = nn.Linear(h, w.kv_heads * d, bias=w.bias)
        self.v = nn.Linear(h, w.kv_heads * d, bias=w.bias)
        self.o = nn.Linear(w.heads * d, h, bias=w.bias)
        if llama:
            ffn = -(-(8 * h // 3) // 64) * 64  # Colonnade's SwiGLU width round_up(8h/3, 64)
            self.gate = nn.Linear(h, ffn, bias=False)
            self.up = nn.Linear(h, ffn, bias=False)
            self.down = nn.Linear(ffn, h, bias=False)
            cos, sin = rope_tables(w.seq_len, d, theta)
            self.register_buffer("cos", cos, persistent=False)  # [S, d/2]
            self.register_buffer("sin", sin, persistent=False)
        else:
            self.fc = nn.Linear(h, 4 * h, bias=True)
            self.proj = nn.Linear(4 * h, h, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.attn_norm(x)  # [b, s, h]
        b, s, _ = y.shape  # y's: under sequence parallelism x may hold s/tp rows, y all s
        q = self.q(y).view(b, s, -1, self.d).transpose(1, 2)  # [b, a, s, d]
        k = self.k(y).view(b, s, -1, self.d).transpose(1, 2)  # [b, kv, s, d]
        v = self.v(y).view(b, s, -1, self.d).transpose(1, 2)  # [b, kv, s, d]
        if self.llama:
            cos, sin = self.cos[:s], self.sin[:s]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))  # [b, s, h]
        y = self.mlp_norm(x)
        if self.llama:
            return x + self.down(F.silu(self.gate(y)) * self.up(y))
        return x + self.proj(F.gelu(self.fc(y), approximate="tanh"))


class PlainModel(nn.Module):
    """tokens [b, s] -> logits [b, s, V]: ``embed`` (+ ``pos`` for gpt2), ``blocks``, ``norm``,
    ``head`` (its weight IS ``embed.weight`` when tied).

    For pipeline cuts a stage may set ``embed`` (and ``pos``) or ``norm`` / ``head`` to None:
    without ``embed`` the input is the hidden state [b, s, h]; without ``head`` the output is
    the hidden state after the blocks."""

    def __init__(self, w: Workload, eps: float = 1e-5, theta: float = 10000.0) -> None:
        super().__init__()
        self.workload = w
        h = w.hidden
        self.embed: nn.Embedding | None = nn.Embedding(w.vocab, h)
        self.pos: nn.Embedding | None = nn.Embedding(w.seq_len, h) if w.arch == "gpt2" else None
        self.blocks = nn.ModuleList(PlainBlock(w, eps, theta) for _ in range(w.layers))
        self.norm: nn.Module | None = RMSNorm(h, eps) if w.arch == "llama" else nn.LayerNorm(h, eps)
        self.head: nn.Linear | None = nn.Linear(h, w.vocab, bias=False)
        if w.tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            s = x.shape[1]
            x = self.embed(x)  # [b, s, h]
            if self.pos is not None:
                x = x + self.pos.weight[:s]
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x  # [b, s, h]
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x)  # [b, s, V]


def plain_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits [b, s, V] against labels [b, s] (a scalar)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def colonnade_state(w: Workload) -> dict[str, torch.Tensor]:
    """Colonnade's single-process initial weights of ``w``, keyed by global parameter name
    (``Sharding.key``; a tied head appears once, as ``embedding.word.weight``)."""
    chunk = build_reference(colonnade_config(w, w.global_batch))
    return {p.sharding.key: p.detach().clone() for p in chunk.parameters()}


def plain_names(w: Workload) -> dict[str, str]:
    """Colonnade parameter name -> plain parameter name (every parameter of both sides)."""
    out = {"embedding.word.weight": "embed.weight", "final_norm.weight": "norm.weight"}
    if w.arch == "gpt2":
        out |= {"embedding.position.weight": "pos.weight", "final_norm.bias": "norm.bias"}
    if not w.tied:
        out["head.weight"] = "head.weight"
    mlp = {"up": "fc", "down": "proj"} if w.arch == "gpt2" else \
        {"gate": "gate", "up": "up", "down": "down"}
    for i in range(w.layers):
        ours, theirs = f"layers.{i}", f"blocks.{i}"
        suffixes = ("weight", "bias") if w.bias else ("weight",)
        for p in suffixes:
            for n in ("attn_norm", "mlp_norm"):
                out[f"{ours}.{n}.{p}"] = f"{theirs}.{n}.{p}"
            for n in "qkvo":
                out[f"{ours}.attn.{n}.{p}"] = f"{theirs}.{n}.{p}"
            for a, b in mlp.items():
                out[f"{ours}.mlp.{a}.{p}"] = f"{theirs}.{b}.{p}"
    return out


def plain_model(w: Workload, seed: int | None = None) -> PlainModel:
    """The plain model of ``w`` with Colonnade's initial weights (training.seed ``seed``,
    default ``w.seed``); raises if any parameter of either side is left unmapped."""
    if seed is not None and seed != w.seed:
        w = Workload(**{**w.__dict__, "seed": seed})
    state = colonnade_state(w)
    cfg = colonnade_config(w, w.global_batch).model
    model = PlainModel(w, cfg.norm_eps, cfg.rope_theta)
    names = plain_names(w)
    ours = dict(model.named_parameters())  # a tied head is listed once, as embed.weight
    if set(names) != set(state) or set(names.values()) != set(ours):
        raise KeyError(f"name mapping mismatch: colonnade {sorted(set(state) ^ set(names))}, "
                       f"plain {sorted(set(ours) ^ set(names.values()))}")
    with torch.no_grad():
        for key, name in names.items():
            ours[name].copy_(state[key])
    return model


def plain_optimizer(model: nn.Module, w: Workload) -> torch.optim.AdamW:
    """torch AdamW with Colonnade's groups: decay on matrices (ndim > 1), none on norms and
    biases; lr, betas, eps from Colonnade's defaults / ``w``; foreach (PyTorch's default)."""
    o = colonnade_config(w, w.global_batch).optim
    params = list(model.parameters())
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim > 1], "weight_decay": w.weight_decay},
         {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
        lr=w.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)


# ----------------------------------------------------------------------------- data and checks


def batches(w: Workload, steps: int, micro_batch: int, seed: int = 0, *, dp: int = 1,
            rank: int = 0) -> list[list[Batch]]:
    """Per step, dp rank ``rank``'s micro-batches of ``micro_batch`` samples.

    Step i's global batch is ids [global_batch, s + 1] drawn uniformly from one stream seeded
    by ``seed`` (tokens = ids[:, :-1], labels = ids[:, 1:]); rank r takes rows
    [r G/dp, (r + 1) G/dp) and splits them into G / (dp micro_batch) micro-batches, so every
    layout of the same workload trains on the same samples."""
    per_rank = w.global_batch // dp
    if per_rank * dp != w.global_batch or per_rank % micro_batch:
        raise ValueError(f"global batch {w.global_batch} is not dp {dp} x a multiple of "
                         f"micro-batch {micro_batch}")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, w.vocab, (w.global_batch, w.seq_len + 1), generator=gen)
        mine = ids[rank * per_rank:(rank + 1) * per_rank]  # [G/dp, s + 1]
        out.append([(m[:, :-1].contiguous(), m[:, 1:].contiguous())
                    for m in mine.split(micro_batch)])
    return out


def first_loss_check(colonnade_loss: float, plain_loss: float, tol: float = 1e-6) -> None:
    """Raise unless |colonnade - plain| <= tol max(1, |plain|): the same model, weights and
    data give the same loss (fp32 rounding is ~1e-7 relative)."""
    if not math.isfinite(colonnade_loss) or \
            abs(colonnade_loss - plain_loss) > tol * max(1.0, abs(plain_loss)):
        raise AssertionError(f"first-step losses differ beyond {tol:g}: colonnade "
                             f"{colonnade_loss!r} vs plain {plain_loss!r}")


def plain_train_step(model: nn.Module, opt: torch.optim.Optimizer, step: list[Batch]) -> float:
    """The plain loop's training step: accumulate the mean loss over the micro-batches
    (each scaled by 1/m), AdamW step, zero grads (set to None); returns the step's mean loss."""
    total = torch.zeros(())
    for tokens, labels in step:
        loss = plain_loss(model(tokens), labels) / len(step)
        loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(total)


def main() -> int:
    """Check that Colonnade and the plain loop agree for 3 steps on every workload."""
    from colonnade.parallel.groups import ProcessGroups
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    torch.set_num_threads(1)
    for w in WORKLOADS.values():
        micro = w.global_batch // 2
        trainer = Trainer(Runtime(colonnade_config(w, micro), torch.device("cpu"),
                                  ProcessGroups.single()))
        model = plain_model(w)
        opt = plain_optimizer(model, w)
        for i, step in enumerate(batches(w, 3, micro)):
            ours, theirs = trainer.train_step(step)["loss"], plain_train_step(model, opt, step)
            first_loss_check(ours, theirs)
            print(f"{w.name:<11} step {i + 1}: colonnade {ours:.7f} plain {theirs:.7f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
