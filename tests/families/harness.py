"""The shared checks of every model family (issue 36): against transformers, and against the
family's own single-process run under each parallel layout.

* :func:`hf_check`: a tiny random instance of the family's transformers class, saved with
  ``save_pretrained``, imported by ``colonnade convert --from-hf``'s code and built in float64.
  Logits and per-token loss (train mode, dropout 0) equal transformers' (``tol``), gradients of
  every parameter (ours mapped to HF names through the family's own ``HFFormat.to_hf``, which is
  linear in the tensors) to ``grad_tol``; greedy generation equal to transformers'
  ``generate(do_sample=False)``; import -> export bit for bit; the export loads in
  transformers (no warning) and gives the original model's logits exactly.
* :func:`check_layouts`: the family's config trained 3 float64 AdamW steps by the Trainer under
  each :class:`Layout` (through the rank pool), losses and the parameters after the steps
  against the single-process run (1e-10 relative).

A family's test module builds its HF model and ModelConfig and calls these with its numbers.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from colonnade.config.sections import (
    Config,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainingConfig,
)
from colonnade.fuzz.hf_twin import file_layout_grads, float64_softmax, float64_twin
from tests.parity import TOL, VOCAB, rel_err, resolved, split_micro, step_global_batch

SEQ = 16
"""Sequence length of the layout runs."""
MICRO = 2
"""Micro-batch size of the layout runs."""
GLOBAL_BATCH = 8
"""Sequences per step in every layout (4 micro-batches at dp 1)."""
STEPS = 3
"""Optimizer steps of a layout run."""


# ----------------------------------------------------------------------------- transformers


def randomize(model: Any, scale: float = 0.3, seed: int = 0) -> Any:
    """Every weight of an HF ``model`` redrawn: normal(0, scale), plus 1 on each
    norm-like vector (1-D, the hidden or a head's width), so no weight sits at its init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            one = p.ndim == 1 and "norm" in name
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * scale
                    + (1.0 if one else 0.0))
    return model


def save_hf(model: Any, directory: Path) -> Path:
    """``model.save_pretrained(directory)`` without its warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory)
    return directory


def hf_check(model: Any, tmp_path: Path, *, vocab: int, seq: int = 12, tol: float = 1e-10,
             grad_tol: float = 1e-8, new_tokens: int = 32) -> ModelConfig:
    """Every check against transformers for the HF ``model`` (random weights, eval-free:
    dropout must be 0 in its config). Returns the imported ModelConfig for the caller's own
    asserts on the mapped fields."""
    from safetensors.torch import load_file

    from colonnade.checkpoint.convert import from_hf
    from colonnade.checkpoint.export import load_exported
    from colonnade.checkpoint.hf import hf_refs
    from colonnade.checkpoint.hf_moe import format_for
    from colonnade.generate import generate
    from colonnade.hf_export import to_hf

    hf_dir = save_hf(model, tmp_path / "hf")
    from_hf(hf_dir, tmp_path / "ck")
    config, ours = load_exported(tmp_path / "ck", dtype=torch.float64)
    cfg = config.model
    theirs = float64_twin(model, cfg)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (2, seq + 1), generator=gen)  # [b, s + 1]
    tokens, labels = ids[:, :-1], ids[:, 1:]
    ours.train()
    theirs.train()
    mine = _logits(ours, tokens, vocab)  # [b, s, V]
    with float64_softmax():
        ref = theirs(tokens).logits  # [b, s, V]
    assert ref.dtype == torch.float64 and float(ref.detach().abs().max()) > 0.5
    err = rel_err(mine.detach(), ref.detach())
    assert err <= tol, f"logits: rel err {err:.2e} > {tol:.0e}"
    loss_mine = F.cross_entropy(mine.reshape(-1, vocab), labels.reshape(-1), reduction="none")
    loss_ref = F.cross_entropy(ref.reshape(-1, vocab), labels.reshape(-1), reduction="none")
    err = rel_err(loss_mine.detach(), loss_ref.detach())
    assert err <= tol, f"per-token loss: rel err {err:.2e} > {tol:.0e}"
    loss_mine.mean().backward()
    loss_ref.mean().backward()
    grads = {p.sharding.key: p.grad for p in ours.parameters() if p.grad is not None}
    frozen = {p.sharding.key: torch.zeros_like(p) for p in ours.parameters()
              if not p.requires_grad}  # e.g. the sigmoid router's selection bias (HF: a buffer)
    assert set(grads) | set(frozen) == set(hf_refs(cfg)), "a parameter got no gradient"
    buffers = {n for n, _ in theirs.named_buffers()}
    mapped = {n: g for n, g in format_for(cfg).to_hf(cfg, grads | frozen).items()
              if n not in buffers}
    want = {n: g for n, g in file_layout_grads(theirs).items() if n in mapped}
    assert set(mapped) == set(want), f"names differ: {sorted(set(mapped) ^ set(want))}"
    worst = max(want, key=lambda n: rel_err(mapped[n], want[n]))
    err = rel_err(mapped[worst], want[worst])
    assert err <= grad_tol, f"gradient of {worst}: rel err {err:.2e} > {grad_tol:.0e}"

    ours.eval()
    theirs.eval()
    prompt = tokens[:, :4]  # [2, 4]
    with torch.no_grad(), float64_softmax():
        greedy = theirs.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=None, min_new_tokens=new_tokens)
    got = generate(ours, prompt, new_tokens, temperature=0.0)
    assert torch.equal(got, greedy), f"greedy generation differs:\n{got}\n{greedy}"

    out = to_hf(tmp_path / "ck", tmp_path / "hf2")
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys(), f"tensor names differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{k} not bit for bit"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = type(model).from_pretrained(out).eval()
    assert not caught, [str(w.message) for w in caught]
    model.eval()
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, model(tokens).logits)
    return cfg


def _logits(chunk: Any, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The single-process chunk's training forward (autograd on): tokens [b, s] -> logits
    [b, s, V] (the tp padding of the vocabulary cut off)."""
    return chunk(tokens).transpose(0, 1)[..., :vocab]  # [s, b, V'] -> [b, s, V]


# ----------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """One parallel layout of a family's parity run."""

    tp: int = 1
    sp: bool = False
    pp: int = 1
    vp: int = 1
    schedule: str = "1f1b"
    dp: int = 1
    zero: int = 0
    cp: int = 1
    cp_attention: str = "ring"
    ep: int = 1
    dispatcher: str = "all_to_all"
    expert_tp: int = 1

    @property
    def world(self) -> int:
        """Ranks it needs (ep is folded inside dp x cp x tp)."""
        return self.tp * self.pp * self.dp * self.cp

    def __str__(self) -> str:
        parts = [f"tp{self.tp}" + ("sp" if self.sp else "")] if self.tp > 1 else []
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f"vp{self.vp}" if self.vp > 1 else "")
                         + f"-{self.schedule}")
        if self.dp > 1:
            parts.append(f"dp{self.dp}" + (f"-zero{self.zero}" if self.zero else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}-{self.cp_attention}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}-{self.dispatcher}")
        if self.expert_tp > 1:
            parts.append(f"etp{self.expert_tp}")
        return "_".join(parts) or "single"


def family_config(model: ModelConfig, layout: Layout) -> Config:
    """The float64 training config of ``model`` under ``layout``: a global batch of
    :data:`GLOBAL_BATCH` sequences of :data:`SEQ` tokens in every layout, AdamW with clipping
    and weight decay."""
    par = ParallelConfig(tp=layout.tp, sp=layout.sp, pp=layout.pp, vp=layout.vp,
                         schedule=layout.schedule, dp=layout.dp, zero_stage=layout.zero,
                         cp=layout.cp, cp_attention=layout.cp_attention, ep=layout.ep,
                         moe_dispatcher=layout.dispatcher, bucket_size=1000,
                         expert_tp=layout.expert_tp if layout.expert_tp > 1 else None)
    micro = GLOBAL_BATCH // (MICRO * layout.dp)
    tr = TrainingConfig(steps=STEPS, seq_len=SEQ, micro_batch_size=MICRO, microbatches=micro,
                        global_batch_size=GLOBAL_BATCH, precision="fp64", eval_interval=0)
    opt = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.1, clip_grad=0.5)
    return resolved(Config(model=model, parallel=par, training=tr, optim=opt), layout.world)


def rank_train(model: ModelConfig, layout: Layout, eod: int | None = None) -> dict[str, Any]:
    """Rank side: :data:`STEPS` Trainer steps of ``model`` under ``layout`` on the synthetic
    global batches; the losses and this rank's share of the full parameters after them
    (dp/cp rank 0, tp rank 0 of each stage gives its stage's). ``eod``: packed documents end
    at this token id, positions and attention reset there in every chunk (what
    data.reset_position_ids / reset_attention_mask install)."""
    from colonnade.checkpoint.export import full_state
    from colonnade.models.blocks import DocReset
    from colonnade.parallel.dims import ParallelDims
    from colonnade.parallel.groups import ProcessGroups
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    torch.set_num_threads(1)
    cfg = family_config(model, layout)
    dims = ParallelDims.from_config(cfg.parallel, layout.world)
    groups = ProcessGroups.build(dims, experts=model.moe)
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups), None)
    if eod is not None:
        for chunk in trainer.chunks:
            chunk.doc_reset = DocReset(eod)
    dp, rank = groups.dp.size, groups.dp.rank
    losses = []
    for step in range(STEPS):
        _, data = step_global_batch(step, GLOBAL_BATCH // MICRO, MICRO, SEQ, model.vocab)
        m = GLOBAL_BATCH // (MICRO * dp)
        losses.append(trainer.train_step(split_micro(data[rank * m:(rank + 1) * m]))["loss"])
    ddp = getattr(trainer, "ddp", None)
    if ddp is not None:
        ddp.finish_param_gather()
    state = full_state(trainer.chunks, groups, ddp)
    keep = groups.dp_cp.rank == 0 and groups.tp.rank == 0
    return {"losses": losses, "params": state if keep else {}}


def reference(run_ranks: Callable[..., list[Any]], model: ModelConfig,
              eod: int | None = None) -> dict[str, Any]:
    """The single-process run of ``model`` (one pool rank; ``eod``: :func:`rank_train`)."""
    (ref,) = run_ranks(1, rank_train, model, Layout(), eod)
    return ref


def check_layouts(run_ranks: Callable[..., list[Any]], model: ModelConfig,
                  layouts: Sequence[Layout], ref: dict[str, Any] | None = None,
                  tol: float = TOL, eod: int | None = None) -> dict[str, Any]:
    """Each layout's losses and final parameters equal the single-process run's (``ref``, or
    computed here) to ``tol`` relative; returns the reference for further layouts. ``eod``:
    document resets at that token id in every run (:func:`rank_train`)."""
    ref = reference(run_ranks, model, eod) if ref is None else ref
    for layout in layouts:
        results = run_ranks(layout.world, rank_train, model, layout, eod)
        for res in results:
            for step, (a, b) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
                assert abs(a - b) <= tol * abs(b), f"{layout}: step {step} loss {a!r} != {b!r}"
        params: dict[str, torch.Tensor] = {}
        for res in results:
            params.update(res["params"])
        assert sorted(params) == sorted(ref["params"]), f"{layout}: parameter names differ"
        worst = max(params, key=lambda k: rel_err(params[k], ref["params"][k]))
        err = rel_err(params[worst], ref["params"][worst])
        assert err <= tol, f"{layout}: {worst} after {STEPS} steps: rel err {err:.2e}"
    return ref


def tiny(model: ModelConfig, **changes: Any) -> ModelConfig:
    """``model`` with the layout runs' vocabulary (:data:`tests.parity.VOCAB`, prime) and
    sequence length, plus ``changes``."""
    return dataclasses.replace(model, vocab_size=VOCAB, max_seq_len=max(SEQ, model.max_seq_len),
                               **changes)
