"""With every parallel degree 1 the model is an ordinary PyTorch model and costs no more.

* No machinery is entered at tp = 1: a forward and backward of the tiny GPT-2 and Llama call
  no :class:`~colonnade.parallel.comm.CommGroup` method, apply no autograd Function of
  :mod:`colonnade.tensor_parallel.mappings` (nor the vocab-parallel cross entropy), draw no
  dropout mask, and leave no Python autograd node in the graph (but the CPU GELU's, below).
* Op count: the aten operators of one forward + backward (counted by a ``TorchDispatchMode``,
  views and other metadata-only ops aside) are at most those of the same model written in
  plain PyTorch ([b, s, h], ``nn.Linear``, ``F.scaled_dot_product_attention``,
  ``F.cross_entropy``) plus :data:`LAYOUT_COPIES_PER_LAYER` per layer: the price of Colonnade's
  [s, b, h] activations, whose q / k / v gradients from SDPA's backward (laid out [b, s, n, d])
  are copied into [s, b, n d] order for the projection's matmuls (RoPE's backward absorbs the
  copies of q and k), and :data:`LOSS_EXTRA_OPS`. GPT-2's GELU on CPU is Colonnade's own
  kernel choice (:mod:`colonnade.gelu`, tested against aten's in ``tests/models/test_gelu.py``):
  its three passes and one Python autograd node (:data:`CPU_GELU_OPS`, ``GeluTanhBackward``)
  stand for aten's one ``gelu`` and are not machinery.
* The plain model is the same model: its loss and gradients equal Colonnade's in float64.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from colonnade.config import Config, load_config
from colonnade.models.blocks import rope_tables
from colonnade.models.build import build_reference
from colonnade.models.gpt import ModelChunk
from colonnade.parallel import rng
from colonnade.parallel.comm import CommGroup
from colonnade.tensor_parallel import cross_entropy, mappings

LAYERS, BATCH, SEQ, VOCAB = 2, 2, 16, 128

LAYOUT_COPIES_PER_LAYER = 3
"""Extra copies per layer allowed over the plain model (q, k, v gradients, see the module
docstring); nothing else may be extra."""

LOSS_EXTRA_OPS = 2
"""Extra ops allowed in the loss: the [s, b] copy of the labels [b, s] (int64, b s elements)
and the sum of the per-token losses (the plain model asks ``F.cross_entropy`` for the sum)."""

CPU_GELU_OPS = Counter({"addcmul": 1, "mul_": 2, "sigmoid_": 1})
"""The ops of one :func:`colonnade.gelu.gelu_tanh` forward on CPU (aten: one ``gelu``); its
backward is aten's ``gelu_backward``, as the plain model's."""

METADATA_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze",
    "squeeze", "slice", "select", "split", "split_with_sizes", "chunk", "detach", "alias",
    "as_strided", "unbind",
})
"""Ops that make a view (no data moved); they are not counted."""


def config(arch: str) -> Config:
    """A 2-layer, h = 64, 4-head model (Llama: 2 kv heads, no biases; GPT-2: biases, tied)."""
    args = {"llama": ["--model.arch=llama", "--model.num_kv_heads=2"],
            "gpt2": ["--model.arch=gpt2", "--model.tie_embeddings=true", "--model.bias=true"]}
    return load_config(None, [*args[arch], "--model.hidden_size=64",
                              f"--model.num_layers={LAYERS}", "--model.num_heads=4",
                              f"--model.vocab_size={VOCAB}", f"--model.max_seq_len={SEQ}",
                              f"--training.seq_len={SEQ}"])


class PlainBlock(nn.Module):
    """Pre-norm decoder layer written the usual way: x [b, s, h] -> [b, s, h]."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        m = cfg.model
        h, d, bias = m.hidden_size, m.head_size, m.bias
        self.llama, self.heads, self.kv, self.d = m.arch == "llama", m.num_heads, m.kv_heads, d
        norm = nn.RMSNorm if self.llama else nn.LayerNorm
        self.ln1, self.ln2 = norm(h, eps=m.norm_eps), norm(h, eps=m.norm_eps)
        self.q = nn.Linear(h, self.heads * d, bias=bias)
        self.k = nn.Linear(h, self.kv * d, bias=bias)
        self.v = nn.Linear(h, self.kv * d, bias=bias)
        self.o = nn.Linear(self.heads * d, h, bias=bias)
        self.up = nn.Linear(h, m.ffn_size, bias=bias)
        self.down = nn.Linear(m.ffn_size, h, bias=bias)
        self.gate = nn.Linear(h, m.ffn_size, bias=bias) if self.llama else None

    def rotate(self, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE (half split) of z [b, n, s, d] by cos/sin [s, d/2]."""
        z1, z2 = z[..., : self.d // 2], z[..., self.d // 2:]
        return torch.cat([z1 * cos - z2 * sin, z1 * sin + z2 * cos], dim=-1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
                ) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln1(x)
        q = self.q(y).view(b, s, self.heads, self.d).transpose(1, 2)  # [b, a, s, d]
        k = self.k(y).view(b, s, self.kv, self.d).transpose(1, 2)  # [b, kv, s, d]
        v = self.v(y).view(b, s, self.kv, self.d).transpose(1, 2)
        if rope is not None:
            q, k = self.rotate(q, *rope), self.rotate(k, *rope)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.kv != self.heads)
        x = x + self.o(out.transpose(1, 2).reshape(b, s, self.heads * self.d))
        y = self.ln2(x)
        if self.gate is not None:
            return x + self.down(F.silu(self.gate(y)) * self.up(y))
        return x + self.down(F.gelu(self.up(y), approximate="tanh"))


class PlainLM(nn.Module):
    """Embedding (+ learned positions), blocks, final norm, head, ``F.cross_entropy`` (sum)."""

    def __init__(self, cfg: Config, model: ModelChunk) -> None:
        super().__init__()
        m = cfg.model
        self.llama, self.tied = m.arch == "llama", m.tie_embeddings
        self.wte = nn.Embedding(m.vocab_size, m.hidden_size)
        self.wpe = None if self.llama else nn.Embedding(m.max_seq_len, m.hidden_size)
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(m.num_layers))
        self.lnf = (nn.RMSNorm if self.llama else nn.LayerNorm)(m.hidden_size, eps=m.norm_eps)
        self.head = None if self.tied else nn.Linear(m.hidden_size, m.vocab_size, bias=False)
        self.rope = rope_tables(m, None, torch.float64) if self.llama else None
        self.to(torch.float64)
        state = {p.sharding.key: p for p in model.parameters()}  # type: ignore[attr-defined]
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(state[colonnade_name(name)])

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)  # [b, s, h]
        if self.wpe is not None:
            x = x + self.wpe.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, self.rope)
        w = self.wte.weight if self.head is None else self.head.weight
        logits = F.linear(self.lnf(x), w)  # [b, s, V]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1),
                               reduction="sum")


def colonnade_name(plain: str) -> str:
    """The Colonnade key of a plain parameter name."""
    fixed = {"wte.weight": "embedding.word.weight", "wpe.weight": "embedding.position.weight",
             "lnf.weight": "final_norm.weight", "lnf.bias": "final_norm.bias",
             "head.weight": "head.weight"}
    if plain in fixed:
        return fixed[plain]
    _, index, module, leaf = plain.split(".")
    where = {"ln1": "attn_norm", "ln2": "mlp_norm", "q": "attn.q", "k": "attn.k", "v": "attn.v",
             "o": "attn.o", "up": "mlp.up", "down": "mlp.down", "gate": "mlp.gate"}[module]
    return f"layers.{index}.{where}.{leaf}"


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, labels [b, s]."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def colonnade_step(model: ModelChunk) -> torch.Tensor:
    """Forward + backward of the summed loss, as the training step runs it."""
    tokens, labels = batch()
    loss = model(tokens, labels, reduction="sum")
    loss.backward()
    return loss.detach()


def plain_step(model: PlainLM) -> torch.Tensor:
    tokens, labels = batch()
    loss = model(tokens, labels)
    loss.backward()
    return loss.detach()


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (by overload packet name)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def compute(self) -> Counter[str]:
        """The counts of ops that compute or move data (metadata-only ops left out)."""
        return Counter({k: v for k, v in self.counts.items() if k not in METADATA_OPS})


def models(arch: str) -> tuple[ModelChunk, PlainLM]:
    """Colonnade's reference model (float64, training mode) and the plain one with its
    weights."""
    cfg = config(arch)
    model = build_reference(cfg, torch.float64).train()
    return model, PlainLM(cfg, model).train()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_plain_model_is_the_same_model(arch: str) -> None:
    """The plain model's loss and gradients equal Colonnade's (float64), so its op count is
    a fair bar."""
    model, plain = models(arch)
    ours, theirs = colonnade_step(model), plain_step(plain)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    grads = {p.sharding.key: p.grad for p in model.parameters()}  # type: ignore[attr-defined]
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[colonnade_name(name)], p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_degree_one_enters_no_machinery(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No CommGroup method, no mapping or vocab-parallel autograd Function, no dropout draw,
    no Python autograd node but the CPU GELU's in a forward + backward at tp = 1."""
    calls: list[str] = []

    def spy(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def recorder(*args: Any, **kwargs: Any) -> Any:
            calls.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, recorder)

    methods = [n for n, v in vars(CommGroup).items() if callable(v) and not n.startswith("__")]
    assert {"all_reduce", "all_gather_into", "reduce_scatter_into", "p2p"} <= set(methods)
    for name in methods:
        spy(CommGroup, name)
    functions = [v for v in vars(mappings).values()
                 if isinstance(v, type) and issubclass(v, torch.autograd.Function)
                 and v.__module__ == mappings.__name__]
    assert len(functions) == 7  # f, g, g_sp, g-bar, split, gather_last, split_last
    for fn in [*functions, cross_entropy.VocabParallelCrossEntropy]:
        spy(fn, "apply")
    for name in ("keep_mask", "dropout", "stream"):
        spy(rng.RNGTracker, name)
    model, _ = models(arch)
    tokens, labels = batch()
    loss = model(tokens, labels, reduction="sum")
    python_nodes = []
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            python_nodes.append(type(node).__name__)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    loss.backward()
    assert calls == []
    assert python_nodes == (["GeluTanhBackward"] * LAYERS if arch == "gpt2" else [])
    assert len(seen) > 20 * LAYERS  # the walk did see the graph


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_op_count_at_most_plain(arch: str) -> None:
    """Ops of one forward + backward <= the plain model's + LAYOUT_COPIES_PER_LAYER per layer;
    the extra ops are those copies (``clone``) and nothing else."""
    model, plain = models(arch)
    colonnade_step(model)
    plain_step(plain)  # warm-up (lazy initialisation outside the count)
    counts = {}
    for name, step in (("colonnade", lambda: colonnade_step(model)),
                       ("plain", lambda: plain_step(plain))):
        with OpCounter() as counter:
            step()
        counts[name] = counter.compute()
    ours, theirs = counts["colonnade"], counts["plain"]
    if arch == "gpt2":  # the CPU GELU's passes count as the one gelu they replace
        for _ in range(LAYERS):
            assert ours >= CPU_GELU_OPS, ours
            ours = ours - CPU_GELU_OPS + Counter({"gelu": 1})
    extra = ours - theirs  # Counter difference: positive parts only
    allowed = LAYOUT_COPIES_PER_LAYER * LAYERS + LOSS_EXTRA_OPS
    assert sum(ours.values()) <= sum(theirs.values()) + allowed, (ours, theirs)
    assert set(extra) <= {"clone", "sum"}, extra
    assert extra["clone"] <= LAYOUT_COPIES_PER_LAYER * LAYERS + 1
    assert extra["sum"] <= 1
