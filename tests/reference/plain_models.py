"""Plain ``torch.nn`` decoders for the independent reference tests: no Colonnade layer, loss or
helper is used here, so a bug shared by every Colonnade layout cannot hide in both sides.

Layout here is batch-first, as in most PyTorch code: tokens [b, s] -> hidden [b, s, h] ->
logits [b, s, V] -> ``F.cross_entropy`` (mean over labels that are not -100). Colonnade is
sequence-first ([s, b, h]) with separate q / k / v (and gate / up) weights; the name mapping
(:func:`colonnade_names`) and the loaders below translate between the two.

* llama: RMSNorm x / sqrt(mean(x^2) + eps) * w; RoPE with the half-split rotation (pairs
  (x_i, x_{i + d/2}), angle pos * theta^(-2i/d)), as Hugging Face's ``rotate_half``; SwiGLU
  down(silu(gate x) * up x); grouped-query attention (query head j reads kv head
  j // (a / kv)); untied head unless asked.
* gpt2: LayerNorm, learned positions, fused ``c_attn`` [3h, h] (q; k; v rows, GPT-2's
  layout, here as an ``nn.Linear``), tanh-GELU MLP, biases, head tied to the word embedding.

Document reset (optional, ``eod``): a packed row holds documents each ending with the EOD id;
positions restart at 0 after every EOD and a token attends only to earlier tokens of its own
document (derived here row by row in Python, see :func:`documents`).

Dropout (optional): ``keep(site, full_shape, p)`` returns a bool keep-mask of the *full* tensor
in Colonnade's layout ([s, b, h] for hidden sites, [b, a, s, s] for attention probabilities);
this model transposes the hidden masks to [b, s, h] itself and applies x * keep / (1 - p).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KeepFn = Callable[[str, tuple[int, ...], float], torch.Tensor]
"""(site, full shape in Colonnade's layout, p) -> bool keep-mask of that shape."""


@dataclass(frozen=True)
class PlainSpec:
    """Shape of a plain decoder (the same numbers as a Colonnade ModelConfig)."""

    arch: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    max_seq: int
    theta: float = 10000.0
    eps: float = 1e-5
    tie: bool = False
    bias: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    label_smoothing: float = 0.0

    @property
    def head_dim(self) -> int:
        """d = h / a."""
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    """y = x / sqrt(mean_h(x^2) + eps) * w over the last dim."""

    def __init__(self, h: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def documents(tokens: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [b, s] and the may-attend mask [b, 1, s, s] of packed rows: a document
    runs up to and including its EOD token; positions count from 0 within a document."""
    b, s = tokens.shape
    pos = torch.zeros(b, s, dtype=torch.long)
    doc = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        current, start = 0, 0
        for i in range(s):
            pos[r, i], doc[r, i] = i - start, current
            if tokens[r, i] == eod:
                current, start = current + 1, i + 1
    allowed = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for r in range(b):
        for i in range(s):
            for j in range(i + 1):
                allowed[r, 0, i, j] = bool(doc[r, i] == doc[r, j])
    return pos, allowed


def rope(x: torch.Tensor, theta: float, pos: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, n, s, d] at positions ``pos`` [b, s]: pair (x_i, x_{i+d/2}) by angle
    pos * theta^(-2i/d), i < d/2 (angles in float64, then cast to x's dtype)."""
    d = x.shape[3]
    i = torch.arange(d // 2, dtype=torch.float64)
    angle = pos.to(torch.float64)[:, None, :, None] * theta ** (-2.0 * i / d)  # [b, 1, s, d/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class PlainAttention(nn.Module):
    """Causal softmax(q k^T / sqrt(d)) v over heads, written out (no SDPA)."""

    def __init__(self, spec: PlainSpec) -> None:
        super().__init__()
        self.spec = spec
        h, d = spec.hidden, spec.head_dim
        if spec.arch == "gpt2":
            self.c_attn = nn.Linear(h, 3 * h, bias=spec.bias)  # rows: q; k; v
            self.c_proj = nn.Linear(h, h, bias=spec.bias)
        else:
            self.q_proj = nn.Linear(h, spec.heads * d, bias=spec.bias)
            self.k_proj = nn.Linear(h, spec.kv_heads * d, bias=spec.bias)
            self.v_proj = nn.Linear(h, spec.kv_heads * d, bias=spec.bias)
            self.o_proj = nn.Linear(spec.heads * d, h, bias=spec.bias)

    def forward(self, x: torch.Tensor, site: str, keep: KeepFn | None, pos: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]; positions [b, s], may-attend mask [b, 1, s, s]."""
        sp, (b, s, _) = self.spec, x.shape
        d = sp.head_dim
        if sp.arch == "gpt2":
            q, k, v = self.c_attn(x).split(sp.hidden, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, s, sp.heads, d).transpose(1, 2)  # [b, a, s, d]
        k = k.view(b, s, -1, d).transpose(1, 2)  # [b, kv, s, d]
        v = v.view(b, s, -1, d).transpose(1, 2)
        if sp.arch == "llama":
            q, k = rope(q, sp.theta, pos), rope(k, sp.theta, pos)
        rep = sp.heads // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [b, a, s, d]
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)  # [b, a, s, s]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        p = sp.attention_dropout
        if keep is not None and p > 0.0:
            probs = probs * keep(f"{site}.attn_dropout", (b, sp.heads, s, s), p) / (1.0 - p)
        out = (probs @ v).transpose(1, 2).reshape(b, s, sp.heads * d)  # [b, s, a d]
        return self.c_proj(out) if sp.arch == "gpt2" else self.o_proj(out)


class PlainMLP(nn.Module):
    """llama: down(silu(gate x) * up x); gpt2: c_proj(gelu_tanh(c_fc x))."""

    def __init__(self, spec: PlainSpec) -> None:
        super().__init__()
        self.llama = spec.arch == "llama"
        h, f = spec.hidden, spec.ffn
        if self.llama:
            self.gate_proj = nn.Linear(h, f, bias=spec.bias)
            self.up_proj = nn.Linear(h, f, bias=spec.bias)
            self.down_proj = nn.Linear(f, h, bias=spec.bias)
        else:
            self.c_fc = nn.Linear(h, f, bias=spec.bias)
            self.c_proj = nn.Linear(f, h, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.llama:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        y = self.c_fc(x)
        gelu = 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y ** 3)))
        return self.c_proj(gelu)


def _drop(x: torch.Tensor, site: str, p: float, keep: KeepFn | None) -> torch.Tensor:
    """Inverted dropout of x [b, s, h] with the [s, b, h] mask of ``site``."""
    if keep is None or p == 0.0:
        return x
    b, s, h = x.shape
    return x * keep(site, (s, b, h), p).transpose(0, 1) / (1.0 - p)


class PlainBlock(nn.Module):
    """Pre-norm: x + drop(attn(ln_1 x)), then x + drop(mlp(ln_2 x))."""

    def __init__(self, spec: PlainSpec) -> None:
        super().__init__()
        self.spec = spec
        norm: Callable[[], nn.Module] = ((lambda: RMSNorm(spec.hidden, spec.eps))
                                         if spec.arch == "llama"
                                         else (lambda: nn.LayerNorm(spec.hidden, spec.eps)))
        self.ln_1, self.attn, self.ln_2, self.mlp = norm(), PlainAttention(spec), norm(), \
            PlainMLP(spec)

    def forward(self, x: torch.Tensor, index: int, keep: KeepFn | None, pos: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        p, key = self.spec.hidden_dropout, f"layers.{index}"
        a = self.attn(self.ln_1(x), f"{key}.attn", keep, pos, allowed)
        x = x + _drop(a, f"{key}.attn_out", p, keep)
        return x + _drop(self.mlp(self.ln_2(x)), f"{key}.mlp_out", p, keep)


class PlainLM(nn.Module):
    """Embedding (+ learned positions for gpt2), blocks, final norm, head, cross entropy."""

    def __init__(self, spec: PlainSpec) -> None:
        super().__init__()
        self.spec = spec
        self.wte = nn.Embedding(spec.vocab, spec.hidden)
        self.wpe = nn.Embedding(spec.max_seq, spec.hidden) if spec.arch == "gpt2" else None
        self.blocks = nn.ModuleList(PlainBlock(spec) for _ in range(spec.layers))
        self.ln_f = (RMSNorm(spec.hidden, spec.eps) if spec.arch == "llama"
                     else nn.LayerNorm(spec.hidden, spec.eps))
        self.lm_head = None if spec.tie else nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, keep: KeepFn | None = None,
                eod: int | None = None) -> torch.Tensor:
        """Mean cross entropy (with the spec's label smoothing) of tokens [b, s] against labels
        [b, s] (-100: ignored); ``eod``: reset positions and attention at documents."""
        b, s = tokens.shape
        if eod is None:
            pos = torch.arange(s).expand(b, s)
            allowed = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)
        else:
            pos, allowed = documents(tokens, eod)
        x = self.wte(tokens)  # [b, s, h]
        if self.wpe is not None:
            x = x + self.wpe(pos)
        x = _drop(x, "embedding.dropout", self.spec.hidden_dropout, keep)
        for i, block in enumerate(self.blocks):
            x = block(x, i, keep, pos, allowed)
        x = self.ln_f(x)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, head)  # [b, s, V]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               label_smoothing=self.spec.label_smoothing)


def colonnade_names(spec: PlainSpec) -> dict[str, tuple[str, int, int]]:
    """Colonnade parameter name -> (plain name, first row, row count) of the plain tensor.

    A row range is a slice along dim 0 (the fused gpt2 ``c_attn``: q rows [0, h), k [h, 2h),
    v [2h, 3h)); every other entry is the whole tensor (row count -1). Colonnade's names:
    ``embedding.word.weight``, ``embedding.position`` (gpt2), ``layers.i.{attn_norm, mlp_norm}``,
    ``layers.i.attn.{q, k, v, o}``, ``layers.i.mlp.{gate, up, down}``, ``final_norm``,
    ``head.weight`` (untied only: a tied head is the word embedding's parameter).
    """
    out: dict[str, tuple[str, int, int]] = {"embedding.word.weight": ("wte.weight", 0, -1)}
    if spec.arch == "gpt2":
        out["embedding.position"] = ("wpe.weight", 0, -1)
    if not spec.tie:
        out["head.weight"] = ("lm_head.weight", 0, -1)
    norm_params = ("weight",) if spec.arch == "llama" else ("weight", "bias")
    lin_params = ("weight", "bias") if spec.bias else ("weight",)
    if spec.arch == "llama":
        lin = {"attn.q": "attn.q_proj", "attn.k": "attn.k_proj", "attn.v": "attn.v_proj",
               "attn.o": "attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
               "mlp.down": "mlp.down_proj"}
    else:
        lin = {"attn.o": "attn.c_proj", "mlp.up": "mlp.c_fc", "mlp.down": "mlp.c_proj"}
    for p in norm_params:
        out[f"final_norm.{p}"] = (f"ln_f.{p}", 0, -1)
    for i in range(spec.layers):
        ours, theirs = f"layers.{i}", f"blocks.{i}"
        for p in norm_params:
            out[f"{ours}.attn_norm.{p}"] = (f"{theirs}.ln_1.{p}", 0, -1)
            out[f"{ours}.mlp_norm.{p}"] = (f"{theirs}.ln_2.{p}", 0, -1)
        for p in lin_params:
            for a, b in lin.items():
                out[f"{ours}.{a}.{p}"] = (f"{theirs}.{b}.{p}", 0, -1)
            if spec.arch == "gpt2":
                for j, qkv in enumerate("qkv"):
                    out[f"{ours}.attn.{qkv}.{p}"] = (f"{theirs}.attn.c_attn.{p}", j * spec.hidden,
                                                     spec.hidden)
    return out


def _view(t: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    return t if rows < 0 else t[start:start + rows]


def load_from_colonnade(model: PlainLM, params: dict[str, torch.Tensor]) -> None:
    """Copy Colonnade's single-process parameters (name -> tensor) into ``model``; every
    Colonnade name must be mapped and every plain parameter filled."""
    names = colonnade_names(model.spec)
    if set(names) != set(params):
        raise KeyError(f"mapping mismatch: unmapped {sorted(set(params) - set(names))}, "
                       f"missing {sorted(set(names) - set(params))}")
    plain = dict(model.named_parameters())
    filled: set[str] = set()
    with torch.no_grad():
        for ours, (theirs, start, rows) in names.items():
            _view(plain[theirs], start, rows).copy_(params[ours])
            filled.add(theirs)
    if filled != set(plain):
        raise KeyError(f"plain parameters not filled: {sorted(set(plain) - filled)}")


def grads_as_colonnade(model: PlainLM) -> dict[str, torch.Tensor]:
    """The plain model's gradients under Colonnade's names (fused ones split)."""
    plain = dict(model.named_parameters())
    out = {}
    for ours, (theirs, start, rows) in colonnade_names(model.spec).items():
        grad = plain[theirs].grad
        if grad is None:
            raise ValueError(f"{theirs} has no gradient")
        out[ours] = _view(grad, start, rows)
    return out
