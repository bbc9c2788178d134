"""Float64 parity of the pipeline executor with the single-process model.

Each case trains 3 AdamW steps (with clipping, weight decay and dropout) through the Trainer on
N gloo ranks and compares, against the single-process reference fed the same micro-batches
(gradient accumulation over all dp x m micro-batches): the loss of every step, the gathered
gradients of every step and the parameters after 3 steps, each with relative error <= 1e-10.

Every case runs with ``parallel.p2p_in_order``: each rank's p2p groups run one after another and
a group completes only when all its operations have, as on NCCL, so a posting that would hang
on GPUs hangs here too (the free gloo mode is checked to give the same numbers).

ZB-V (``zbv``, vp 2, the "v" placement) runs through every path here: the schedule grid, tp
(+sp) x dp, uneven layouts (entries per virtual stage in v order), the switches, recompute,
masked loss, document reset and an ep2 MoE model; gpt2's tied head shares the embedding's
Parameter on stage 0 (one tensor, one gradient, no embedding-group reduction).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.checkpoint.export import full_state, gather_full
from colonnade.config.sections import Config, OptimConfig, ParallelConfig, TrainingConfig
from colonnade.models.blocks import DocReset
from colonnade.models.params import grad_of, unique_params
from colonnade.parallel.groups import ProcessGroups
from colonnade.pipeline.plan import ExecOptions
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX
from colonnade.training.step import mean_loss
from tests.moe import harness as moe
from tests.parity import (
    TOL,
    dims_of,
    rank_groups,
    rel_err,
    resolved,
    split_micro,
    step_global_batch,
    tiny_model,
    train_step,
)

STEPS, SEQ, MICRO, VOCAB = 3, 16, 2, 96
EOD = 5  # the end-of-document id of the document-reset cases


def make_config(*, pp: int, vp: int = 1, schedule: str = "1f1b", m: int, tp: int = 1,
                dp: int = 1, sp: bool = False, arch: str = "llama",
                layout: tuple[int, ...] | None = None, zero: int = 0,
                ends: tuple[int | None, int | None] | None = None,
                layers: int | None = None) -> Config:
    """A tiny float64 model with one layer per virtual stage (embedding and head on top),
    or ``layers`` / sum(layout) layers; ``ends``: (first_stage_layers, last_stage_layers);
    ``zero``: the ZeRO stage (bucketed finely so that buckets follow the layers)."""
    gpt2 = arch == "gpt2"
    layers = layers or (sum(layout) if layout is not None else pp * vp)
    model = tiny_model(arch, layers=layers, hidden=32, heads=4, kv_heads=2, vocab=VOCAB,
                       seq=SEQ, init_std=0.02, dropout=0.1,
                       attention_dropout=0.1 if gpt2 else 0.0)
    first, last = ends or (None, None)
    par = ParallelConfig(tp=tp, pp=pp, vp=vp, dp=dp, sp=sp, schedule=schedule,
                         pipeline_layout=layout, first_stage_layers=first,
                         last_stage_layers=last, zero_stage=int(zero),
                         bucket_size=2000 if zero > 1 else 40_000_000, p2p_in_order=True)
    tr = TrainingConfig(steps=STEPS, seq_len=SEQ, micro_batch_size=MICRO, microbatches=m,
                        precision="fp64", seed=7, eval_interval=0)
    opt = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=0, clip_grad=0.05, weight_decay=0.1)
    return resolved(Config(model=model, parallel=par, training=tr, optim=opt))


def step_batches(cfg: Config, step: int, masked: bool = False, docs: bool = False
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of ``step``: dp x m micro-batches (dp rank d takes [d m, (d + 1) m)).

    ``masked``: micro-batch j keeps each label with probability j / count (the others are
    IGNORE_INDEX), so micro-batches and dp ranks hold different numbers of valid tokens and the
    first holds none. ``docs``: about one token in six is EOD (several documents per sample).
    """
    tr = cfg.training
    count = int(tr.microbatches or 1) * int(cfg.parallel.dp or 1)
    gen, data = step_global_batch(step, count, MICRO, SEQ, VOCAB)  # [count, b, s + 1]
    if docs:
        data[torch.rand(data.shape, generator=gen) < 1 / 6] = EOD
    out = split_micro(data)
    if masked:
        keep = [torch.rand(MICRO, SEQ, generator=gen) < j / count for j in range(count)]
        out = [(t, lab.masked_fill(~k, IGNORE_INDEX)) for (t, lab), k in zip(out, keep,
                                                                          strict=True)]
    return out


def train_steps(cfg: Config, groups: ProcessGroups, options: ExecOptions | None = None,
                masked: bool = False, docs: bool = False) -> dict[str, Any]:
    """3 Trainer steps on this rank's micro-batches: losses, full grads per step, full params.

    With ``options`` the Trainer's step is assembled by hand so that these executor options
    reach the executor through ``StepPlan.options``; otherwise ``Trainer.train_step`` runs as is.
    """
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
    for chunk in trainer.chunks:  # what data.reset_position_ids / reset_attention_mask set
        chunk.doc_reset = DocReset(EOD) if docs else None
    m, d = int(cfg.training.microbatches or 1), groups.dp_rank
    losses, grads = [], []
    for step in range(STEPS):
        batches = step_batches(cfg, step, masked, docs)[d * m:(d + 1) * m]
        if options is None:
            losses.append(trainer.train_step(batches)["loss"])
        else:
            out, _ = train_step(trainer.chunks, trainer.ddp, trainer.optimizer, groups, cfg,
                                step, batches, options=options)
            losses.append(mean_loss(out, groups, torch.device("cpu"), batches))
        grads.append({} if cfg.parallel.zero else  # ZeRO: a rank holds its shard only
                     {p.sharding.key: gather_full(grad_of(p), p.sharding, groups.tp)
                      for p in unique_params(trainer.chunks)})
    trainer.ddp.finish_param_gather()
    params = full_state(trainer.chunks, groups, trainer.ddp)  # ZeRO-3: from the shards
    return {"loss": losses, "grads": grads, "params": params, "stage": groups.pp_rank}


def reference_run(cfg: Config, masked: bool = False, docs: bool = False) -> dict[str, Any]:
    """The same 3 steps on the single-process model fed all dp x m micro-batches."""
    par, tr = cfg.parallel, cfg.training
    single = dataclasses.replace(
        cfg, parallel=dataclasses.replace(par, tp=1, pp=1, vp=1, dp=1, sp=False,
                                          schedule="1f1b", pipeline_layout=None,
                                          first_stage_layers=None, last_stage_layers=None,
                                          zero_stage=0, bucket_size=40_000_000),
        training=dataclasses.replace(tr, microbatches=int(tr.microbatches or 1) * int(par.dp or 1),
                                     global_batch_size=None))
    return _reference(resolved(single, 1), masked, docs)


@functools.lru_cache(maxsize=16)
def _reference(single: Config, masked: bool = False, docs: bool = False) -> dict[str, Any]:
    """Cached per single-process config: schedules of the same model and batch share it."""
    torch.set_num_threads(1)
    return train_steps(single, ProcessGroups.single(), masked=masked, docs=docs)


def rank_train(cfg: Config, options: ExecOptions | None = None,
               masked: bool = False, docs: bool = False) -> dict[str, Any] | None:
    """On each rank: the 3 steps; tp rank 0 returns its results."""
    groups = rank_groups(dims_of(cfg))
    out = train_steps(cfg, groups, options, masked, docs)
    return out if groups.tp_rank == 0 else None


def assert_parity(results: list[dict[str, Any] | None], ref: dict[str, Any],
                  grads: bool = True) -> None:
    """Every returned rank matches the reference; every reference parameter is covered.

    Relative errors take a floor on the reference norm (1e-6 for gradients, 1e-3 for
    parameters) for the key biases only: their gradient is mathematically zero (softmax is
    shift invariant), the computed one is rounding noise ~1e-17, and Adam turns that noise into
    ~1e-11 parameter values; neither has a meaningful relative error. ``grads=False``
    (ZeRO-1: a rank's reduced gradient is only its own shard) compares losses and parameters
    only."""
    seen: set[str] = set()
    for r in results:
        if r is None:
            continue
        for step in range(STEPS):
            assert abs(r["loss"][step] - ref["loss"][step]) <= TOL * abs(ref["loss"][step]), (
                f"step {step} loss {r['loss'][step]} != reference {ref['loss'][step]}")
            for key, g in (r["grads"][step] if grads else {}).items():
                err = rel_err(g, ref["grads"][step][key], 1e-6)
                assert err <= TOL, f"stage {r['stage']} step {step} grad {key}: rel err {err:.2e}"
        for key, p in r["params"].items():
            err = rel_err(p, ref["params"][key], 1e-3)
            assert err <= TOL, f"stage {r['stage']} param {key} after {STEPS} steps: {err:.2e}"
            seen.add(key)
    assert seen == set(ref["params"]), f"parameters never compared: {set(ref['params']) - seen}"


def check(run_ranks: Callable[..., list[Any]], cfg: Config,
          options: ExecOptions | None = None, masked: bool = False,
          docs: bool = False) -> None:
    par = cfg.parallel
    results = run_ranks(par.tp * par.pp * int(par.dp or 1), rank_train, cfg, options, masked,
                        docs)
    assert_parity(results, reference_run(cfg, masked, docs), grads=par.zero == 0)


CASES = [  # (pp, vp, schedule, m): m = pp, a multiple of pp, not a multiple
    (pp, vp, sched, m)
    for pp in (2, 4)
    for vp, sched in ((1, "gpipe"), (1, "1f1b"), (1, "zb_h1"), (2, "interleaved_1f1b"),
                      (2, "zbv"))
    for m in (pp, 2 * pp, pp + 1)
]


@pytest.mark.parametrize(("pp", "vp", "schedule", "m"), CASES,
                         ids=[f"pp{p}-vp{v}-{s}-m{m}" for p, v, s, m in CASES])
def test_schedule_parity(run_ranks: Callable[..., list[Any]], pp: int, vp: int, schedule: str,
                         m: int) -> None:
    arch = "gpt2" if (m + vp) % 2 else "llama"  # both archs, tied embeddings across stages
    check(run_ranks, make_config(pp=pp, vp=vp, schedule=schedule, m=m, arch=arch))


@pytest.mark.parametrize(("tp", "dp", "sp", "schedule", "vp", "arch"), [
    (2, 1, False, "1f1b", 1, "gpt2"),
    (2, 1, True, "interleaved_1f1b", 2, "llama"),
    (1, 2, False, "zb_h1", 1, "gpt2"),
    (1, 2, False, "interleaved_1f1b", 2, "gpt2"),
    (2, 2, True, "1f1b", 1, "gpt2"),
    (2, 2, True, "zb_h1", 1, "llama"),
    (2, 1, True, "zbv", 2, "gpt2"),  # ZB-V: tied head on stage 0 with tp-split vocabulary
    (1, 2, False, "zbv", 2, "llama"),
    (2, 2, True, "zbv", 2, "llama"),
])
def test_combined_layout_parity(run_ranks: Callable[..., list[Any]], tp: int, dp: int, sp: bool,
                                schedule: str, vp: int, arch: str) -> None:
    check(run_ranks, make_config(pp=2, vp=vp, schedule=schedule, m=3, tp=tp, dp=dp, sp=sp,
                                 arch=arch))


UNEVEN = [  # (schedule, vp, layout or (first, last) of 5 layers, arch, tp, dp, ZeRO stage)
    ("gpipe", 1, (1, 3), "llama", 1, 1, 0),
    ("1f1b", 1, (0, 3), "gpt2", 1, 1, 0),  # stage 0: the embedding only (tied head on 1)
    ("1f1b", 1, (None, 1), "llama", 2, 1, 0),  # last_stage_layers=1: (4, 1) under tp2 + sp
    ("1f1b", 1, (1, None), "gpt2", 1, 2, 2),  # first_stage_layers=1: (1, 4), ZeRO-2 x dp2
    ("zb_h1", 1, (3, 1), "gpt2", 1, 1, 0),
    ("zb_h1", 1, (2, 0), "llama", 1, 2, 3),  # stage 1: the head only, ZeRO-3 x dp2
    ("interleaved_1f1b", 2, (2, 0, 1, 1), "gpt2", 1, 1, 0),  # v1 passes activations on
    ("interleaved_1f1b", 2, (1, 0, 2, 0), "llama", 1, 2, 3),  # a chunk without parameters
    ("interleaved_1f1b", 2, (1, 0), "gpt2", 2, 1, 0),  # ends: (1, 2, 2, 0), tp2 + sp
    ("zbv", 2, (3, 1, 1, 1), "gpt2", 1, 1, 0),  # v order: stage 0 holds v0 (3) and v3 (1)
    ("zbv", 2, (1, 2, 0, 2), "gpt2", 1, 1, 0),  # v2 (stage 1, chunk 1) passes through
    ("zbv", 2, (0, 3, 2, 0), "llama", 1, 2, 1),  # stage 0: embedding and head only; ZeRO-1
    ("zbv", 2, (1, 0), "gpt2", 2, 1, 0),  # ends: (1, 2, 2, 0), tied head on stage 0, tp2 + sp
]


@pytest.mark.parametrize(("schedule", "vp", "layout", "arch", "tp", "dp", "zero"), UNEVEN,
                         ids=[f"{c[0]}-{'-'.join(map(str, c[2]))}-{c[3]}-tp{c[4]}-dp{c[5]}-"
                              f"z{c[6]}" for c in UNEVEN])
def test_uneven_layout_parity(run_ranks: Callable[..., list[Any]], schedule: str, vp: int,
                              layout: tuple[int | None, ...], arch: str, tp: int, dp: int,
                              zero: int) -> None:
    """Uneven stages under every schedule, tied (gpt2) and untied (llama), with tp2 + sp and
    dp2 with ZeRO 1-3: virtual stages without layers (only the embedding, only the head, or
    nothing but a hand-over) and Megatron's first / last stage counts (two entries of
    ``UNEVEN`` for pp x vp > 2 virtual stages, or with a None: ``ends``)."""
    explicit = len(layout) == 2 * vp and None not in layout
    cfg = make_config(pp=2, vp=vp, schedule=schedule, m=3, arch=arch, tp=tp, dp=dp,
                      sp=tp > 1, zero=zero,
                      layout=layout if explicit else None,  # type: ignore[arg-type]
                      ends=None if explicit else layout,  # type: ignore[arg-type]
                      layers=None if explicit else 5)
    check(run_ranks, cfg)


@pytest.mark.parametrize(("schedule", "in_order"), [
    ("gpipe", True), ("1f1b", True), ("interleaved_1f1b", True), ("zb_h1", True),
    ("interleaved_1f1b", False), ("zb_h1", False), ("zbv", True), ("zbv", False)])
def test_switches_off_give_the_same_numbers(run_ranks: Callable[..., list[Any]],
                                            schedule: str, in_order: bool) -> None:
    """No p2p overlap, no output deallocation, with and without NCCL's in-order p2p: same
    numbers (a switch never changes results)."""
    cfg = make_config(pp=2, vp=2 if schedule in ("interleaved_1f1b", "zbv") else 1,
                      schedule=schedule, m=5, arch="gpt2")
    check(run_ranks, cfg, ExecOptions(overlap=False, deallocate=False, in_order=in_order))


@pytest.mark.parametrize(("schedule", "vp"), [("zb_h1", 1), ("zbv", 2)])
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_zero_bubble_with_recompute_parity(run_ranks: Callable[..., list[Any]],
                                           recompute: str, schedule: str, vp: int) -> None:
    """W after recomputed blocks (full: W runs one second pass, selective: per boundary)."""
    cfg = make_config(pp=2, vp=vp, schedule=schedule, m=3, arch="gpt2")
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                recompute=recompute))
    check(run_ranks, cfg)


MASKED = [  # (pp, vp, schedule, tp, dp, sp, zero, arch): loss-masked labels, uneven counts
    (1, 1, "1f1b", 1, 2, False, False, "llama"),  # dp
    (1, 1, "1f1b", 1, 4, False, True, "gpt2"),  # dp + ZeRO-1
    (1, 1, "1f1b", 2, 2, True, False, "gpt2"),  # tp + sp + dp
    (2, 1, "1f1b", 1, 2, False, True, "llama"),  # pp 1F1B + dp + ZeRO-1
    (2, 2, "interleaved_1f1b", 2, 1, True, False, "gpt2"),  # interleaved + tp + sp
    (2, 1, "zb_h1", 1, 2, False, False, "gpt2"),  # ZB-H1 + dp
    (2, 1, "gpipe", 1, 1, False, False, "llama"),
    (2, 2, "zbv", 1, 2, False, True, "gpt2"),  # ZB-V + dp + ZeRO-1, tied head on stage 0
    (2, 2, "zbv", 2, 1, True, False, "llama"),  # ZB-V + tp + sp
]


@pytest.mark.parametrize(("pp", "vp", "schedule", "tp", "dp", "sp", "zero", "arch"), MASKED,
                         ids=[f"pp{c[0]}-vp{c[1]}-{c[2]}-tp{c[3]}-dp{c[4]}-sp{int(c[5])}-"
                              f"zero{int(c[6])}-{c[7]}" for c in MASKED])
def test_masked_loss_parity(run_ranks: Callable[..., list[Any]], pp: int, vp: int,
                            schedule: str, tp: int, dp: int, sp: bool, zero: bool,
                            arch: str) -> None:
    """Micro-batches with different numbers of valid tokens (one with none): every layout's
    loss, gradients and parameters equal the single-process token-weighted step's."""
    cfg = make_config(pp=pp, vp=vp, schedule=schedule, m=3, tp=tp, dp=dp, sp=sp, zero=zero,
                      arch=arch)
    check(run_ranks, cfg, masked=True)


DOCS = [  # (pp, vp, schedule, tp, dp, sp, recompute, arch): documents reset at EOD
    (1, 1, "1f1b", 2, 2, True, "none", "gpt2"),  # learned positions under sp, attn dropout
    (2, 2, "interleaved_1f1b", 2, 1, True, "selective", "llama"),  # masked core recomputed
    (2, 1, "zb_h1", 1, 2, False, "full", "gpt2"),
    (2, 2, "zbv", 1, 2, False, "selective", "gpt2"),
    (2, 2, "zbv", 2, 1, True, "full", "llama"),
]


@pytest.mark.parametrize(("pp", "vp", "schedule", "tp", "dp", "sp", "recompute", "arch"), DOCS,
                         ids=[f"pp{c[0]}-vp{c[1]}-{c[2]}-tp{c[3]}-dp{c[4]}-sp{int(c[5])}-"
                              f"{c[6]}-{c[7]}" for c in DOCS])
def test_document_reset_parity(run_ranks: Callable[..., list[Any]], pp: int, vp: int,
                               schedule: str, tp: int, dp: int, sp: bool, recompute: str,
                               arch: str) -> None:
    """Position ids restarting and attention kept inside documents (every chunk derives them
    from the tokens) with masked labels: every layout equals the single-process run."""
    cfg = make_config(pp=pp, vp=vp, schedule=schedule, m=3, tp=tp, dp=dp, sp=sp, arch=arch)
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                recompute=recompute))
    check(run_ranks, cfg, masked=True, docs=True)


def test_moe_zbv_parity(run_ranks: Callable[..., list[Any]]) -> None:
    """ep2 x pp2 x dp2 under ZB-V (every layer MoE, 4 micro-batches): the expert all-to-alls
    of the two chunks of a stage interleave with the split backward's B and W passes; losses,
    expert loads, aux losses, step 0's gradients and the parameters equal the single-process
    run (tests/moe/harness.py)."""
    config = moe.moe_config(ep=2, pp=2, vp=2, dp=2, schedule="zbv", microbatches=4,
                            aux_type="seq")
    batches = moe.make_batches(config)
    results = run_ranks(moe.world_size(config), moe.rank_train, config, batches)
    errs = moe.check_parity(results, moe.reference_run(config, batches))
    assert "grads" in errs, errs
