"""`colonnade train --dry-run`: what a run would be, without running it.

The config is already validated by the CLI. Here the model is built on the meta device (shapes
only, no weights allocated, so a 70B preset takes a moment), and the report shows its parameter
count, the layout, tokens per step, the planner's per-rank memory (colonnade/analysis/memory.py:
the ZeRO stage's bytes per parameter; parameters, gradients, optimizer states, the stage's
gradient buckets and gathered parameters, activations and buffers of the fullest pipeline stage)
and, when ``data.prepared_dir`` holds a prepared dataset, its documents, tokens, samples per
epoch and the epochs this run covers.  With cp > 1 a line gives the context parallelism: the
activation factor 1/cp against cp = 1, the cp attention's bytes per step per rank and their
exposed time on a cluster preset (the planner's time model: cpu-local on CPU, a100-80gb
otherwise); with ``training.memory_limit_gb`` a line says whether the estimate fits (train
refuses a run that does not, naming what fits: :mod:`colonnade.analysis.memory_limit`).
For a mixture-of-experts model an MoE block gives the parameters total / active per token,
the experts per rank (E/ep per MoE layer, their state bytes with ZeRO sharded over expert_dp
or its hybrid shard groups) and
the token dispatch's MB per step per rank (:mod:`colonnade.analysis.moe`).
Nothing is written, prepared or launched. (It lives in the planner, above training, because it
reuses the planner's memory model.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from colonnade.analysis.cp_comm import step_cp_bytes
from colonnade.analysis.hardware import GIB, get_cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import (
    memory_per_device,
    moe_stage_params,
    stage_label,
    stage_params,
    stage_state_bytes,
    state_bytes_per_param,
    zero_paper_bytes,
)
from colonnade.analysis.memory_limit import memory_limit_line
from colonnade.analysis.moe import (
    MoEShape,
    active_flops_per_token,
    moe_param_counts,
    step_dispatch_bytes,
)
from colonnade.analysis.timing import step_time
from colonnade.config.sections import Config, DataConfig, ModelConfig
from colonnade.models.build import build_reference
from colonnade.parallel.dims import ParallelDims, layout_text


def meta_param_count(config: Config) -> int:
    """Parameters of the whole model, counted on the meta device (nothing allocated)."""
    model = build_reference(config, device=torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


def zero_line(workload: Workload, layout: Layout) -> str:
    """The ZeRO stage and its model-state bytes per parameter (memory.stage_state_bytes),
    beside the ZeRO paper's accounting of the same stage."""
    wb, gb, ob = state_bytes_per_param(workload, layout)
    s = layout.shard
    paper = zero_paper_bytes(1.0, s, layout.zero) if workload.mixed else None
    group = ""
    if layout.zero:
        group = f" over {s} rank(s)" + (f" (hybrid: {layout.dp // s} replicas)"
                                        if layout.zero_shard_size else "")
    extra = ""
    if layout.zero == 3:
        extra = (f"; reshard_after_forward={str(layout.reshard).lower()}, "
                 f"prefetch {workload.zero_prefetch}")
    if workload.optimizer == "muon":
        extra += (f"; optim.name=muon: the hidden matrices' optimizer "
                  f"{state_bytes_per_param(workload, layout, muon=True)[2]:.3g}")
    if (workload.state_dtype, workload.master_dtype) != ("fp32", "fp32"):
        extra += (f"; optimizer states {workload.state_dtype}, masters "
                  f"{workload.master_dtype if workload.mixed else workload.precision}")
    return (f"ZeRO stage {layout.zero}{group}: weights {wb:.3g} + grads {gb:.3g} + "
            f"optimizer {ob:.3g} = {wb + gb + ob:.3g} bytes/parameter"
            + (f" (ZeRO paper: {paper:.3g})" if paper is not None else "") + extra)


def memory_lines(config: Config, world: int) -> list[str]:
    """Per-rank memory of the fullest stage from the planner's model, one line per kind."""
    workload = Workload.from_config(config)
    layout = Layout.from_config(config, world)
    mem = memory_per_device(workload, layout)
    params = stage_params(workload.shape, layout, mem.stage)
    if config.model.moe:
        params += sum(moe_stage_params(workload, layout, mem.stage))
    gib = mem.gib()
    lines = [f"memory per rank (planner's model, {stage_label(mem.stage)} stage, "
             f"{config.training.precision}): {params:,.0f} parameters",
             "  " + zero_line(workload, layout)]
    kinds = ["params", "grads", "optimizer"]
    if layout.zero >= 2:
        kinds.append("grad_buckets")
    if layout.zero == 3:
        kinds.append("gathered")
    if layout.cp > 1:
        kinds.append("cp_buffers")
    kinds += ["activations", "buffers"] + (["loss_backward"] if mem.loss_backward else [])
    for kind in (*kinds, "total"):
        lines.append(f"  {kind:<12} {gib[kind]:10.3f} GiB")
    return lines


def snapshot_line(config: Config, world: int) -> str | None:
    """checkpoint.memory_interval > 0: host RAM per rank of the memory snapshots on the fullest
    stage (planner's model): own = the owned parameters (ZeRO-1/2: 1/shard of them) + the
    optimizer state; held = own + the partner's copy of its source's; None when off."""
    every = config.checkpoint.memory_interval
    if every <= 0:
        return None
    layout = Layout.from_config(config, world)
    mem = memory_per_device(Workload.from_config(config), layout)
    own = mem.params / (layout.shard if layout.zero in (1, 2) else 1) + mem.optimizer
    unit, size = ("GiB", GIB) if own >= GIB / 10 else ("MiB", 2**20)
    return (f"memory snapshots every {every} step(s): own {own / size:.3f} {unit} + a "
            f"partner's copy {own / size:.3f} {unit} = {2 * own / size:.3f} {unit} host RAM "
            f"per rank, {own / every / size:.3f} {unit}/step sent to the partner")


def cp_line(config: Config, world: int) -> str | None:
    """'cp: 2 (ring, zigzag): activations x1/2 ..., ring p2p N MB/step, exposed ~X ms on C'
    (None at cp = 1)."""
    workload = Workload.from_config(config)
    layout = Layout.from_config(config, world)
    if layout.cp == 1:
        return None
    on_cpu = config.training.device == "cpu" or (config.training.device == "auto"
                                                 and not torch.cuda.is_available())
    cluster = get_cluster("cpu-local" if on_cpu else "a100-80gb")
    act = memory_per_device(workload, layout).activations
    act1 = memory_per_device(workload, dataclasses.replace(layout, cp=1)).activations
    mb = step_cp_bytes(workload, layout, cluster) / 1e6
    exposed = step_time(workload, layout, cluster).cp_comm * 1e3
    kind = {"ring": "ring p2p", "all_to_all": "all-to-all"}.get(layout.cp_attention,
                                                                 "all-to-all + ring p2p")
    overlap = "" if layout.cp_attention == "all_to_all" else (
        ", overlapped" if workload.cp_overlap else ", not overlapped (cp_overlap=false)")
    return (f"cp: {layout.cp} ({layout.cp_kind}, zigzag): activations x1/{layout.cp} "
            f"({act / GIB:.3f} GiB per rank, {act1 / GIB:.3f} at cp 1; ratio "
            f"{act / act1:.3f}), {kind} {mb:,.1f} MB/step per rank{overlap}, exposed "
            f"~{exposed:.3g} ms on {cluster.name} (the planner's time model)")


def moe_lines(config: Config, world: int) -> list[str]:
    """The MoE block: parameters total / active, experts and their states per rank, the
    dispatch's bytes per step per rank (empty for a dense model)."""
    m = config.model
    if not m.moe:
        return []
    workload = Workload.from_config(config)
    layout = Layout.from_config(config, world)
    counts, x = moe_param_counts(m), MoEShape.of(m)
    zbv = layout.pp > 1 and layout.schedule == "zbv"
    layers = x.max_stage_moe_layers(layout.pp, "v" if zbv else "loop")
    experts = m.num_experts // layout.ep
    stage = "only" if layout.pp == 1 else ("ends" if zbv else "first")
    _, expert_params = moe_stage_params(workload, layout, stage)
    ewb, egb, eob = stage_state_bytes(workload.precision, layout.zero, layout.expert_shard,
                                      workload.state_dtype, workload.master_dtype,
                                      workload.optimizer == "muon")
    sharded = ("optimizer", "optimizer and gradients", "weights, gradients and optimizer")
    tokens = layout.local_tokens(workload.seq_len) / layout.tp
    mbs = layout.microbatches(workload.global_batch)
    mb = step_dispatch_bytes(m, tokens, mbs, layout.pp, workload.elem, layout.ep,
                             workload.moe_dispatcher, layout.expert_tp) / 1e6
    dense = active_flops_per_token(m, workload.seq_len)
    return [
        f"moe: {counts['moe_layers']} MoE layers of {m.num_experts} experts (top {m.moe_top_k}"
        f", expert width {m.expert_ffn_size}"
        + (f", shared {m.moe_shared_expert_ffn_hidden_size}" if x.shared_ffn else "")
        + f"): {counts['total']:,} parameters total, {counts['active']:,} active per token "
        f"({counts['active'] / counts['total']:.1%}); {dense / 1e9:.3g} GFLOPs per token "
        "(active experts, forward + backward)",
        f"  experts per rank: {experts} per MoE layer x {layers} layer(s) (ep {layout.ep}, "
        + (f"each split over expert tp {layout.expert_tp}, " if layout.expert_tp > 1 else "")
        + f"expert_dp {layout.edp}) = {expert_params:,.0f} parameters, "
        f"{expert_params * (ewb + egb + eob) / GIB:.3f} GiB of weights + grads + optimizer"
        + (f" ({sharded[layout.zero - 1]} sharded over {layout.expert_shard} expert_dp "
           "ranks)" if layout.zero else ""),
        f"  dispatch ({workload.moe_dispatcher}): {mb:,.2f} MB/step per rank sent "
        "(forward + backward, uniform routing"
        + (", with the expert tp exchange)" if layout.expert_tp > 1 else ")")
        + ("; none at ep 1" if layout.ep == layout.expert_tp == 1 else ""),
    ]


def data_lines(config: Config) -> list[str]:
    """Documents, tokens, samples per epoch and epochs covered, when the data is prepared;
    what train would do with the data otherwise (a missing prepared dir is train's error).
    With data.blend, one line per blended dataset: its share of the samples, its own samples
    per epoch and the epochs of it this run covers."""
    from colonnade.config.data_paths import blend_entries
    from colonnade.data.dataset import WindowDataset
    from colonnade.data.indexed import IndexedDataset
    from colonnade.training.preflight import data_plan

    data, tr = config.data, config.training
    plan = data_plan(config)
    prefix = plan.prepared_dir / "data"
    used = tr.steps * int(tr.global_batch_size or 1)
    blend = [f"  blend {w:.3g} of the samples: {p}: {_samples_line(p, tr.seq_len, data, w * used)}"
             for w, p in blend_entries(data.blend)]
    head = ["data: training samples are drawn from data.blend (validation from "
            f"{plan.prepared_dir}):"] if blend else []
    if plan.action == "prepare" or not prefix.with_suffix(".idx").is_file():
        source = data.input or "the built-in corpus"
        return [f"data: train would prepare {source} into {plan.prepared_dir} first (a dry "
                "run prepares nothing; run `colonnade prepare` to see its statistics here)",
                *head, *blend]
    indexed = IndexedDataset(prefix)
    train = WindowDataset(indexed, tr.seq_len, "train", data.valid_fraction)
    valid = (f"{len(WindowDataset(indexed, tr.seq_len, 'valid', data.valid_fraction)):,} "
             "validation" if data.valid_fraction > 0 else
             "no validation: data.valid_fraction=0")
    uses = "" if blend else (f"; {tr.steps} steps use {used:,} samples = "
                             f"{used / len(train):.3g} epochs")
    return [f"data: {plan.prepared_dir}: {len(indexed):,} documents, {indexed.num_tokens:,} "
            f"tokens; {len(train):,} training samples of {tr.seq_len} tokens per epoch "
            f"({valid}){uses}", *head, *blend]


def _samples_line(prefix: Path, seq_len: int, data: DataConfig, used: float) -> str:
    """'N documents, T tokens; S samples per epoch, this run uses U = E epochs' of a blend
    dataset (its train split, as train blends it)."""
    from colonnade.data.dataset import WindowDataset
    from colonnade.data.indexed import IndexedDataset

    indexed = IndexedDataset(prefix)
    train = WindowDataset(indexed, seq_len, "train", data.valid_fraction)
    return (f"{len(indexed):,} documents, {indexed.num_tokens:,} tokens; {len(train):,} "
            f"samples per epoch, this run uses {used:,.0f} = {used / len(train):.3g} epochs")


VOCAB_UNKNOWN = " (model.vocab_size unset: the size of the BPE prepare would train)"
"""Said of the vocabulary when no tokenizer exists yet to take its size from."""


def _known_vocab(config: Config) -> Config:
    """``config`` with an unset model.vocab_size taken as train would (the checkpoint a resume
    loads, or the tokenizer the run will use) when that is known before preparing."""
    from colonnade.data.errors import DataError
    from colonnade.training.preflight import data_plan
    from colonnade.training.vocab import resolve_vocab

    if config.model.vocab_size is not None:
        return config
    try:
        return resolve_vocab(config, data_plan(config).tokenizer)
    except DataError:  # no prepared data: data_lines names the problem
        return config


def _heads_and_rope(m: ModelConfig) -> str:
    """The model line's head width when model.head_dim sets it and its RoPE scaling, e.g.
    ' of 128, rope llama3 x8.0 (original context 8192)'; '' for neither."""
    out = f" of {m.head_dim}" if m.head_dim is not None else ""
    if m.rope_scaling != "none":
        original = m.rope_original_max_seq_len or m.max_seq_len
        out += f", rope {m.rope_scaling} x{m.rope_factor:g} (original context {original})"
    return out


def dry_run(config: Config, world: int) -> str:
    """The report of a validated, resolved config on ``world`` ranks (model.vocab_size unset:
    the tokenizer's as train would take it, when that tokenizer exists already)."""
    config = _known_vocab(config)
    tr, m = config.training, config.model
    dims = ParallelDims.from_config(config.parallel, world)
    total = meta_param_count(config)
    tokens = int(tr.global_batch_size or 1) * tr.seq_len
    unknown = VOCAB_UNKNOWN if m.vocab_size is None else ""
    lines = [
        "dry run: nothing was started, written or prepared",
        f"model: {m.arch}, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads"
        f"{_heads_and_rope(m)}, vocab {m.vocab}{unknown}: {total:,} parameters "
        f"({total / 1e9:.3g} B; built on the meta device)",
        f"layout: {layout_text(config.parallel, dims.describe(), m.num_layers)} on {world} "
        "rank(s)",
        f"batch: global {tr.global_batch_size} x seq {tr.seq_len} = {tokens:,} tokens per step "
        f"(micro-batch {tr.micro_batch_size} x {tr.microbatches} micro-batches x dp "
        f"{dims.dp}); {tr.steps} steps = {tr.steps * tokens:,} tokens",
        *memory_lines(config, world),
        *moe_lines(config, world),
        *[line for line in (cp_line(config, world), memory_limit_line(config, world),
                            snapshot_line(config, world)) if line],
        *data_lines(config),
    ]
    return "\n".join(lines)

