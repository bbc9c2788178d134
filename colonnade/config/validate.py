"""The one place where cross-field configuration checks live (the mixture-of-experts rules,
one of :data:`RULES`, in :mod:`colonnade.config.rules_moe`; the RoPE scaling rules in
:mod:`colonnade.config.rules_rope`; the sliding-window rules in
:mod:`colonnade.config.rules_window`; hierarchical cp's in :mod:`colonnade.config.rules_cp`;
q/k logit clipping's in :mod:`colonnade.config.rules_qk_clip`).

:func:`resolve` derives the free degrees (dp, micro-batches, global batch) from the world size;
:func:`validate` runs every rule and raises one :class:`ConfigError` listing each violated rule
with the fields it names and a fix. Both run before any process group is created.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from colonnade.config.choices import (
    ARCHS,
    AXES,
    BACKENDS,
    CP_ATTENTIONS,
    DATA_FORMATS,
    DEVICES,
    ERROR_POLICIES,
    GRAD_REDUCE_DTYPES,
    LR_DECAYS,
    LR_SCHEDULE_POLICIES,
    MUON_SCALES,
    NAN_POLICIES,
    ON_EXISTING,
    OPTIM_DTYPES,
    OPTIMIZER_SWITCHES,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODES,
    RESTART_MODES,
    SCHEDULES,
    WSD_SHAPES,
)
from colonnade.config.data_paths import (
    BLEND_SUM_TOLERANCE,
    blend_prefix,
    input_sources,
    is_glob,
)
from colonnade.config.load import ConfigError
from colonnade.config.rules_cp import hierarchical_rules
from colonnade.config.rules_deepseek import deepseek_rules
from colonnade.config.rules_fp8 import fp8_rules
from colonnade.config.rules_graphs import cuda_graph_rules
from colonnade.config.rules_moe import moe_rules
from colonnade.config.rules_optim import optim_rules
from colonnade.config.rules_pipeline import pipeline_rules
from colonnade.config.rules_qk_clip import qk_clip_rules
from colonnade.config.rules_recovery import recovery_problems
from colonnade.config.rules_rope import rope_rules
from colonnade.config.rules_straggler import straggler_problems
from colonnade.config.rules_window import window_rules
from colonnade.config.sections import Config, DataConfig


def resolve(config: Config, world_size: int) -> Config:
    """Fill dp, microbatches and global_batch_size from the world size; never overrides a value.

    dp = world / (tp * pp * cp) (ep is folded inside tp * cp * dp, it does not divide the
    world); global batch = micro_batch_size * microbatches * dp. A mixture-of-experts model
    (model.num_experts > 0) gets parallel.expert_tp = 1 (whole experts) when it is None.
    checkpoint.save='auto' becomes <logging.dir>/checkpoints
    (:func:`resolve_save`).
    Inconsistent explicit values are left for :func:`validate` to report.
    """
    config = resolve_save(config)
    par, tr = config.parallel, config.training
    model_ranks = par.tp * par.pp * par.cp
    dp = par.dp
    if dp is None and model_ranks > 0 and world_size % model_ranks == 0:
        dp = world_size // model_ranks
    micro = tr.microbatches
    glob = tr.global_batch_size
    if dp and tr.micro_batch_size > 0:
        per_step = tr.micro_batch_size * dp
        if micro is None and glob is None:
            micro = 1
        if micro is None and glob is not None and glob % per_step == 0:
            micro = glob // per_step
        if glob is None and micro is not None:
            glob = micro * per_step
    expert_tp = 1 if par.expert_tp is None and config.model.moe else par.expert_tp
    return dataclasses.replace(
        config,
        parallel=dataclasses.replace(par, dp=dp, expert_tp=expert_tp),
        training=dataclasses.replace(tr, microbatches=micro, global_batch_size=glob),
    )


SAVE_AUTO = "auto"
"""checkpoint.save's default: save under the run's logging.dir (:func:`default_save_dir`)."""


def default_save_dir(logging_dir: str | Path) -> Path:
    """Where checkpoint.save='auto' saves: ``<logging.dir>/checkpoints``."""
    return Path(logging_dir) / "checkpoints"


def resolve_save(config: Config) -> Config:
    """``config`` with checkpoint.save='auto' replaced by ``<logging.dir>/checkpoints``; any
    other value (a directory, or None: save nothing) is kept."""
    ck = config.checkpoint
    if ck.save != SAVE_AUTO:
        return config
    save = str(default_save_dir(config.logging.dir))
    return dataclasses.replace(config, checkpoint=dataclasses.replace(ck, save=save))


Rule = Callable[[Config, int | None], list[str]]


def _positive(c: Config, _: int | None) -> list[str]:
    out = []
    names = {
        "model.num_layers": c.model.num_layers, "model.hidden_size": c.model.hidden_size,
        "model.num_heads": c.model.num_heads,
        "model.max_seq_len": c.model.max_seq_len, "training.seq_len": c.training.seq_len,
        "training.micro_batch_size": c.training.micro_batch_size, "parallel.tp": c.parallel.tp,
        "parallel.pp": c.parallel.pp, "parallel.vp": c.parallel.vp, "parallel.cp": c.parallel.cp,
        "parallel.ep": c.parallel.ep, "parallel.bucket_size": c.parallel.bucket_size,
        "parallel.tp_comm_chunks": c.parallel.tp_comm_chunks,
        "training.recompute_num_layers": c.training.recompute_num_layers,
        "training.steps": c.training.steps, "checkpoint.keep_last": c.checkpoint.keep_last,
        "data.num_workers": c.data.num_workers,
    }
    for name, value in (("model.num_kv_heads", c.model.num_kv_heads),
                        ("model.head_dim", c.model.head_dim),
                        ("model.vocab_size", c.model.vocab_size),
                        ("training.cpu_threads", c.training.cpu_threads)):
        if value is not None:  # None: derived (the tokenizer's vocabulary, the cores' share)
            names[name] = value
    if c.parallel.dp is not None:
        names["parallel.dp"] = c.parallel.dp
    if c.parallel.expert_tp is not None:
        names["parallel.expert_tp"] = c.parallel.expert_tp
    for name, value in names.items():
        if value < 1:
            out.append(f"{name}={value} must be >= 1.")
    return out


def _choices(c: Config, _: int | None) -> list[str]:
    out = []
    checks = [
        ("model.arch", c.model.arch, ARCHS),
        ("parallel.schedule", c.parallel.schedule, SCHEDULES),
        ("training.precision", c.training.precision, PRECISIONS),
        ("training.recompute", c.training.recompute, RECOMPUTE_MODES),
        ("training.recompute_method", c.training.recompute_method, RECOMPUTE_METHODS),
        ("training.on_nan", c.training.on_nan, NAN_POLICIES),
        ("training.device", c.training.device, DEVICES),
        ("optim.decay", c.optim.decay, LR_DECAYS),
        ("optim.decay_shape", c.optim.decay_shape, WSD_SHAPES),
        ("optim.state_dtype", c.optim.state_dtype, OPTIM_DTYPES),
        ("optim.master_dtype", c.optim.master_dtype, OPTIM_DTYPES),
        ("optim.name", c.optim.name, OPTIMIZERS),
        ("optim.muon_scale", c.optim.muon_scale, MUON_SCALES),
        ("parallel.backend", c.parallel.backend, BACKENDS),
        ("checkpoint.lr_schedule", c.checkpoint.lr_schedule, LR_SCHEDULE_POLICIES),
        ("checkpoint.optimizer_switch", c.checkpoint.optimizer_switch, OPTIMIZER_SWITCHES),
        ("checkpoint.on_existing", c.checkpoint.on_existing, ON_EXISTING),
        ("checkpoint.restart", c.checkpoint.restart, RESTART_MODES),
        ("data.errors", c.data.errors, ERROR_POLICIES),
        ("data.format", c.data.format, DATA_FORMATS),
        ("parallel.grad_reduce_dtype", c.parallel.grad_reduce_dtype, GRAD_REDUCE_DTYPES),
        ("parallel.cp_attention", c.parallel.cp_attention, CP_ATTENTIONS),
    ]
    for name, value, allowed in checks:
        if value not in allowed:
            out.append(f"{name}='{value}' is unknown; use one of {', '.join(allowed)}.")
    out.extend(_order(c.parallel.order, c.parallel.ep))
    return out


def _order(order: str, ep: int) -> list[str]:
    """parallel.order: a permutation of the dense axes; 'ep' in it (the spelling before the
    expert view) is accepted while ep = 1, where its place never changed a rank."""
    axes = order.split("-")
    dense = [a for a in axes if a != "ep"]
    if sorted(dense) != sorted(AXES) or axes.count("ep") > 1:
        return [f"parallel.order='{order}' must name each axis of {', '.join(AXES)} once, "
                f"joined by '-', e.g. '{'-'.join(AXES)}'."]
    if "ep" in axes and ep > 1:
        return [f"parallel.order='{order}' names ep, but ep is no longer a dense axis: "
                f"parallel.ep={ep} is folded inside tp x cp x dp of each stage (etp fastest, "
                f"then ep, then edp); drop 'ep' from the order, e.g. '{'-'.join(dense)}'."]
    return []


def _model_shape(c: Config, _: int | None) -> list[str]:
    m, tp, out = c.model, c.parallel.tp, []
    if m.head_dim is None and m.num_heads >= 1 and m.hidden_size % m.num_heads:
        out.append(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads="
                   f"{m.num_heads}; pick a head count that divides the width, or set "
                   "model.head_dim.")
    if m.kv_heads >= 1 and m.num_heads % m.kv_heads:
        out.append(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads="
                   f"{m.kv_heads}; each kv head must serve a whole group of query heads.")
    if tp >= 1 and m.num_heads % tp:
        out.append(f"model.num_heads={m.num_heads} is not divisible by parallel.tp={tp}; "
                   "choose tp dividing the head count.")
    if tp >= 1 and m.kv_heads % tp:
        out.append(f"model.num_kv_heads={m.kv_heads} is not divisible by parallel.tp={tp}; use "
                   "tp <= kv heads that divides them, or more kv heads.")
    if m.vocab_size is not None and tp > m.vocab_size >= 1:
        out.append(f"parallel.tp={tp} exceeds model.vocab_size={m.vocab_size}: every tp rank "
                   "needs at least one vocabulary row; use tp <= vocab_size.")
    if tp >= 1 and m.ffn_size % tp:
        out.append(f"model.ffn_hidden_size={m.ffn_size} is not divisible by parallel.tp={tp}; "
                   "set ffn_hidden_size to a multiple of tp.")
    if m.traits is not None and m.traits.rope and m.num_heads >= 1 and m.head_size % 2:
        source = ("model.head_dim" if m.head_dim is not None
                  else "model.hidden_size / model.num_heads")
        out.append(f"head dim {m.head_size} ({source}) must be even for RoPE.")
    if c.training.seq_len > m.max_seq_len:
        out.append(f"training.seq_len={c.training.seq_len} exceeds model.max_seq_len="
                   f"{m.max_seq_len}; raise max_seq_len or shorten the sequence.")
    for name, p in (("model.hidden_dropout", m.hidden_dropout),
                    ("model.attention_dropout", m.attention_dropout),
                    ("training.label_smoothing", c.training.label_smoothing)):
        if not 0.0 <= p < 1.0:
            out.append(f"{name}={p} must be in [0, 1).")
    return out


def _degrees(c: Config, world: int | None) -> list[str]:
    p, out = c.parallel, []
    if p.ep > 1 and not c.model.moe:
        out.append(f"parallel.ep={p.ep} needs a mixture-of-experts model (model.num_experts > "
                   "0): no layer has experts, so ep would change nothing; set ep=1.")
    if p.sp and p.tp == 1:
        out.append("parallel.sp=true needs parallel.tp > 1 (sequence parallelism splits the "
                   "tp regions); set sp=false or tp >= 2.")
    if p.sp and p.tp > 1 and c.training.seq_len % p.tp:
        out.append(f"training.seq_len={c.training.seq_len} is not divisible by parallel.tp="
                   f"{p.tp}, needed by parallel.sp=true; pick a multiple of tp.")
    if p.tp_comm_chunks > 1 and not p.sp:
        out.append("parallel.tp_comm_chunks > 1 needs parallel.sp=true (it chunks the sp "
                   "all-gather / reduce-scatter).")
    pieces = p.cp * p.tp * p.tp_comm_chunks
    if p.tp_comm_chunks > 1 and p.sp and p.cp >= 1 and c.training.seq_len % pieces:
        out.append(f"training.seq_len={c.training.seq_len} is not divisible by parallel.cp="
                   f"{p.cp} x tp={p.tp} x tp_comm_chunks={p.tp_comm_chunks} (each rank's "
                   "sequence block is cut into tp_comm_chunks pieces); change seq_len or "
                   "tp_comm_chunks.")
    out.extend(_expert_degrees(p.tp, p.cp, p.dp, p.ep, p.expert_tp))
    if world is not None:
        model_ranks = p.tp * p.pp * p.cp
        if p.dp is None:  # dp is derived as world / (tp pp cp): the world does not divide
            out.append(f"world size {world} is not a multiple of parallel.tp={p.tp} x pp={p.pp}"
                       f" x cp={p.cp} = {model_ranks} (dp = world / {model_ranks}; ep does not "
                       "multiply it); change the degrees or the number of ranks (--nproc).")
        elif p.dp * model_ranks != world:
            out.append(f"world size {world} != parallel.tp={p.tp} x pp={p.pp} x cp={p.cp} x "
                       f"dp={p.dp} (ep does not multiply it); change the degrees or the number "
                       "of ranks (--nproc).")
    if c.training.device == "cpu" and p.backend == "nccl":
        out.append("parallel.backend='nccl' needs GPUs; use 'gloo' or training.device='cuda'.")
    return out


def _expert_degrees(tp: int, cp: int, dp: int | None, ep: int,
                    expert_tp: int | None) -> list[str]:
    """The expert view folds ep x expert_tp inside the tp x cp x dp ranks of a stage:
    ep x expert_tp must divide them (edp = tp x cp x dp / (ep x expert_tp))."""
    etp = expert_tp if expert_tp is not None else tp
    if dp is None or min(tp, cp, dp, ep, etp) < 1:
        return []  # dp unknown (no world size) or a degree < 1 (reported by _positive)
    stage, folded = tp * cp * dp, ep * etp
    if stage % folded == 0:
        return []
    fits = [e for e in range(1, stage + 1) if stage % (e * etp) == 0]
    hint = (f"e.g. ep in {fits}" if fits else
            f"expert_tp={etp} alone does not divide {stage}: lower expert_tp (1 always fits)")
    if etp > 1 and stage % ep == 0:
        hint += f", or parallel.expert_tp=1 to keep ep={ep}"
    return [f"parallel.ep={ep} x parallel.expert_tp={etp}"
            f"{'' if expert_tp is not None else ' (= tp)'} = {folded} does not divide "
            f"parallel.tp={tp} x cp={cp} x dp={dp} = {stage}, the ranks of a pipeline stage "
            f"that the expert layout folds ep and expert_tp into (expert dp = the rest); "
            f"choose ep and expert_tp whose product divides {stage}, {hint}."]


def _context(c: Config, _: int | None) -> list[str]:
    """Context parallelism (parallel.cp > 1): the zigzag split's divisibility, the heads
    all_to_all needs, and training.memory_limit_gb."""
    p, m, s, out = c.parallel, c.model, c.training.seq_len, []
    limit = c.training.memory_limit_gb
    if limit is not None and not limit > 0:
        out.append(f"training.memory_limit_gb={limit} must be > 0 (GiB per rank); unset it "
                   "for no limit.")
    if p.cp <= 1 or s < 1 or p.tp < 1:
        return out
    if s % (2 * p.cp):
        k = 2 * p.cp
        out.append(f"training.seq_len={s} is not divisible by 2 x parallel.cp = {k}: the "
                   f"zigzag split cuts each sequence into {k} equal chunks and each of the "
                   f"{p.cp} cp ranks holds 2 of them; pick a seq_len that is a multiple of {k} "
                   f"(e.g. {-(-s // k) * k}), or change cp.")
    elif p.sp and s % (2 * p.cp * p.tp):
        out.append(f"training.seq_len={s} is not divisible by 2 x parallel.cp x tp="
                   f"{2 * p.cp * p.tp}, needed by parallel.sp=true (each cp rank's s/cp rows "
                   "are split across tp); pick a multiple, or change cp, tp or sp.")
    if p.cp_attention == "all_to_all" and m.num_heads % p.tp == 0 and m.kv_heads % p.tp == 0:
        heads, kv = m.num_heads // p.tp, m.kv_heads // p.tp
        if heads % p.cp:
            out.append(f"parallel.cp_attention='all_to_all' needs model.num_heads / parallel.tp"
                       f" = {heads} divisible by parallel.cp={p.cp} (each cp rank takes a share "
                       "of the heads); use parallel.cp_attention='ring', or change cp or tp.")
        if kv and kv % p.cp and p.cp % kv:
            out.append(f"parallel.cp_attention='all_to_all' needs model.num_kv_heads / "
                       f"parallel.tp = {kv} divisible by parallel.cp={p.cp} or dividing it; "
                       "use parallel.cp_attention='ring', or change cp, tp or num_kv_heads.")
    return out


def _pipeline(c: Config, _: int | None) -> list[str]:
    p, m, out = c.parallel, c.model, []
    chunks = p.pp * p.vp
    if p.vp > 1 and p.schedule not in ("interleaved_1f1b", "zbv"):
        out.append(f"parallel.vp={p.vp} needs parallel.schedule='interleaved_1f1b' or 'zbv' "
                   f"(got '{p.schedule}'); or set vp=1.")
    if p.schedule == "interleaved_1f1b" and p.vp == 1:
        out.append("parallel.schedule='interleaved_1f1b' needs parallel.vp >= 2 chunks per stage.")
    if p.schedule == "zbv" and p.vp != 2:
        out.append(f"parallel.schedule='zbv' places two chunks per stage in a V (stage s holds "
                   f"virtual stages s and 2 pp - 1 - s); set parallel.vp=2 (got {p.vp}).")
    if p.schedule == "zbv" and p.pp == 1:
        out.append("parallel.schedule='zbv' needs parallel.pp >= 2 (got 1): it is a pipeline "
                   "schedule over 2 pp virtual stages; set pp >= 2 with vp=2, or use "
                   "schedule='1f1b' with pp=1.")
    if p.vp > 1 and p.pp == 1:
        out.append("parallel.vp > 1 needs parallel.pp > 1.")
    if p.pipeline_layout is None:
        if (chunks >= 1 and m.num_layers % chunks and p.first_stage_layers is None
                and p.last_stage_layers is None):
            out.append(f"model.num_layers={m.num_layers} is not divisible by parallel.pp x "
                       f"parallel.vp={chunks}; set parallel.pipeline_layout (layers per virtual "
                       "stage) or parallel.first_stage_layers / last_stage_layers (fewer "
                       "layers beside the embedding and the head), or change the layer count. "
                       "No layer is ever dropped.")
    else:
        lay = p.pipeline_layout
        if len(lay) != chunks:
            out.append(f"parallel.pipeline_layout has {len(lay)} entries; it needs pp x vp="
                       f"{chunks} (one per virtual stage).")
        if sum(lay) != m.num_layers or min(lay, default=0) < 0:
            out.append(f"parallel.pipeline_layout={list(lay)} must be non-negative and sum to "
                       f"model.num_layers={m.num_layers}.")
    return out


def _batch(c: Config, _: int | None) -> list[str]:
    t, dp, out = c.training, c.parallel.dp, []
    if dp is None or dp < 1 or t.micro_batch_size < 1:
        return out
    per_step = t.micro_batch_size * dp
    if t.global_batch_size is not None and t.global_batch_size % per_step:
        out.append(f"training.global_batch_size={t.global_batch_size} is not divisible by "
                   f"training.micro_batch_size x dp={per_step}; make it a multiple.")
    elif (t.global_batch_size is not None and t.microbatches is not None
          and t.global_batch_size != per_step * t.microbatches):
        out.append(f"training.global_batch_size={t.global_batch_size} != micro_batch_size x "
                   f"microbatches x dp={per_step * t.microbatches}; set only one of them.")
    if t.microbatches is not None and t.microbatches < 1:
        out.append(f"training.microbatches={t.microbatches} must be >= 1.")
    return out


def _io(c: Config, _: int | None) -> list[str]:
    out = [*_input_problems(c.data), *_blend_problems(c.data)]
    if not c.data.text_key:
        out.append("data.text_key is empty; name the field or column holding the text, "
                   "e.g. --data.text_key=text.")
    if not 0 <= c.data.valid_fraction < 1:
        out.append(f"data.valid_fraction={c.data.valid_fraction} must be in [0, 1).")
    if c.checkpoint.interval < 0:
        out.append(f"checkpoint.interval={c.checkpoint.interval} must be >= 0.")
    if c.checkpoint.interval > 0 and c.checkpoint.save is None:
        out.append("checkpoint.interval > 0 needs checkpoint.save=DIR or 'auto' (the default: "
                   "<logging.dir>/checkpoints); checkpoint.save=none saves nothing.")
    if c.checkpoint.save is not None and not c.checkpoint.save.strip():
        out.append("checkpoint.save is empty; give a directory, 'auto' (the default: "
                   "<logging.dir>/checkpoints) or 'none' to save nothing.")
    return out


def _input_problems(data: DataConfig) -> list[str]:
    """data.input: every part exists (or a glob matches), ':key' suffixes are well formed."""
    if data.input is None:
        return []
    out, sources = [], input_sources(data.input)
    missing = [p for p, _ in sources
               if not (glob.glob(p, recursive=True) if is_glob(p) else Path(p).exists())]
    if missing or not sources:
        detail = f" ({', '.join(missing)} not found)" if len(sources) > 1 else ""
        keyed = [f"'{p}:{k}'" for p, k in sources if k and p in missing]
        read_as = (f" (read as {', '.join(keyed)}: path, then the ':key' suffix naming the "
                   "text field)") if keyed else ""
        out.append(f"data.input='{data.input}' does not exist{detail}{read_as}; give a file, "
                   "directory, glob or comma-separated list of them (text, jsonl, json, csv, "
                   "parquet, arrow, a HF datasets dir), or leave it unset for the built-in "
                   "corpus.")
    for part, key in sources:
        if key == "":
            out.append(f"data.input part '{part}:' has an empty text key after ':'; write "
                       f"'{part}:KEY' (KEY: the field or column holding its text) or drop "
                       "the ':'.")
    keyed = [f"{p}:{k}" for p, k in sources if k]
    if keyed and data.format != "text":
        out.append(f"data.input parts {', '.join(keyed)} name a text key, which only "
                   f"data.format='text' reads; data.format='{data.format}' reads "
                   "data.prompt_key / data.response_key: drop the ':KEY' suffixes.")
    return out


def _blend_problems(data: DataConfig) -> list[str]:
    """data.blend: 'weight:path' entries with positive weights that sum to 1."""
    out, weights = [], []
    for entry in data.blend:
        weight, _sep, prefix = entry.partition(":")
        try:
            ok = float(weight) > 0 and bool(prefix)
        except ValueError:
            ok = False
        if not ok:
            out.append(f"data.blend entry '{entry}' must look like 'weight:path/prefix' with "
                       "weight > 0.")
        else:
            weights.append((float(weight), prefix))
    total = sum(w for w, _ in weights)
    if not out and weights and abs(total - 1.0) > BLEND_SUM_TOLERANCE:
        fixed = ",".join(f"{w / total:.4g}:{prefix}" for w, prefix in weights)
        out.append(f"data.blend weights sum to {total:.4g}, not 1: each weight is the "
                   "fraction of training samples drawn from its dataset. Give fractions that "
                   f"sum to 1, e.g. --data.blend={fixed} (the same proportions).")
    return out


def _reliability(c: Config, _: int | None) -> list[str]:
    p, out = c.parallel, []
    if p.timeout_s <= 0:
        out.append(f"parallel.timeout_s={p.timeout_s} must be > 0 (seconds a collective may "
                   "wait before the rank fails), e.g. 300.")
    if p.watchdog_s is not None and p.watchdog_s < 0:
        out.append(f"parallel.watchdog_s={p.watchdog_s} must be >= 0 (0 disables the hang "
                   "detector; unset means 0.8 x parallel.timeout_s).")
    elif p.watchdog_s and p.timeout_s > 0 and p.watchdog_s >= p.timeout_s:
        out.append(f"parallel.watchdog_s={p.watchdog_s} must be < parallel.timeout_s="
                   f"{p.timeout_s}: the hang detector reports before the collective timeout "
                   "ends the rank; unset it (0.8 x timeout_s) or lower it.")
    return out + recovery_problems(c.checkpoint)


def _files_and_loop(c: Config, _: int | None) -> list[str]:
    t, out = c.training, []
    if c.checkpoint.load is not None and not Path(c.checkpoint.load).exists():
        out.append(f"checkpoint.load='{c.checkpoint.load}' does not exist; give a checkpoint "
                   "directory (or a Hugging Face model directory), or unset it to start fresh.")
    if c.data.tokenizer is not None and not Path(c.data.tokenizer).exists():
        out.append(f"data.tokenizer='{c.data.tokenizer}' does not exist; give a tokenizer.json "
                   "(or a Hugging Face model directory holding one) or unset it to train one.")
    for entry in c.data.blend:
        path = entry.partition(":")[2]
        prefix = blend_prefix(path)
        missing = [str(prefix.with_suffix(s)) for s in (".bin", ".idx")
                   if prefix.name and not prefix.with_suffix(s).is_file()]
        if missing:
            hint = (f" ({path} is a directory without data.idx: not a prepared dir)"
                    if Path(path).is_dir() else "")
            out.append(f"data.blend entry '{entry}': {' and '.join(missing)} missing{hint}; "
                       "run `colonnade prepare` for that dataset or fix the path (a prepared "
                       "dir, or its prefix DIR/data).")
    if t.eval_interval < 0:
        out.append(f"training.eval_interval={t.eval_interval} must be >= 0 (0 disables).")
    if t.eval_interval > 0 and t.eval_batches < 1:
        out.append(f"training.eval_batches={t.eval_batches} must be >= 1 when "
                   "training.eval_interval > 0.")
    if t.eval_interval > 0 and c.data.valid_fraction <= 0:
        out.append(f"training.eval_interval={t.eval_interval} needs data.valid_fraction > 0 "
                   f"(with valid_fraction={c.data.valid_fraction:g} no validation split is held "
                   "out); set --training.eval_interval=0 to train without evaluation, or "
                   "--data.valid_fraction=0.02 to evaluate.")
    if c.logging.log_interval < 1:
        out.append(f"logging.log_interval={c.logging.log_interval} must be >= 1.")
    return out + straggler_problems(c.logging)


CXX_NAMES: tuple[str, ...] = ("g++", "c++", "clang++")
"""C++ compilers TorchInductor can build its kernels with (besides the one $CXX names)."""


def cxx_compiler() -> str | None:
    """Path of the C++ compiler torch.compile would use: $CXX, else the first of
    :data:`CXX_NAMES` on PATH; None when there is none."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else list(CXX_NAMES)
    return next((found for found in map(shutil.which, names) if found), None)


def _compile(c: Config, _: int | None) -> list[str]:
    out: list[str] = []
    if not c.training.compile:
        return out
    if cxx_compiler() is None:
        which = f"$CXX={os.environ['CXX']} is not found" if os.environ.get("CXX") else (
            f"none of {', '.join(CXX_NAMES)} is on PATH")
        out.append(f"training.compile=true needs a C++ compiler ({which}): TorchInductor "
                   "builds its CPU kernels (and Triton its GPU launchers) with it; install one "
                   "(e.g. apt-get install g++) or set training.compile=false.")
    if c.parallel.schedule in ("zb_h1", "zbv"):
        out.append(f"training.compile=true does not go with parallel.schedule="
                   f"'{c.parallel.schedule}': the "
                   "zero-bubble split walks each backward twice (input gradients, then weight "
                   "gradients), but a compiled layer's backward is one node that computes all "
                   "its gradients at once and frees its saved buffers; use schedule '1f1b' or "
                   "'interleaved_1f1b', or set training.compile=false.")
    return out

def _zero(c: Config, _: int | None) -> list[str]:
    """ZeRO fields: the stage, the prefetch depth, hybrid sharding's group size."""
    p, out = c.parallel, []
    if p.zero_stage not in range(4):
        out.append(f"parallel.zero_stage={p.zero_stage} is unknown; use 0, 1, 2 or 3 "
                   "(0 none, 1 optimizer states, 2 + gradients, 3 + parameters).")
    if p.zero_prefetch < 0:
        out.append(f"parallel.zero_prefetch={p.zero_prefetch} must be >= 0 (buckets gathered "
                   "ahead of the one in use); set 0 to gather only on use.")
    if p.reshard_after_forward is not None and p.zero < 3:
        out.append(f"parallel.reshard_after_forward={p.reshard_after_forward} applies to ZeRO "
                   f"stage 3 only (the stage is {p.zero}: parameters are not sharded); set "
                   "parallel.zero_stage=3 or unset reshard_after_forward.")
    size = p.zero_shard_size
    if size is None:
        return out
    if size < 1:
        out.append(f"parallel.zero_shard_size={size} must be >= 1 (ranks per shard group); "
                   "or leave it unset to shard over all dp x cp ranks.")
    elif p.zero < 1:
        out.append(f"parallel.zero_shard_size={size} needs a ZeRO stage >= 1 (nothing is "
                   "sharded at stage 0); set parallel.zero_stage >= 1 or unset "
                   "zero_shard_size.")
    elif p.dp is not None and (p.dp * p.cp) % size:
        out.append(f"parallel.zero_shard_size={size} does not divide dp x cp = "
                   f"{p.dp * p.cp}; pick a divisor of dp x cp (or unset it).")
    return out


RULES: tuple[Rule, ...] = (_positive, _choices, _model_shape, _degrees, _context, _pipeline,
                           _batch, optim_rules, _io, _reliability, _files_and_loop, _compile, _zero,
                           moe_rules, window_rules, rope_rules, deepseek_rules,
                           hierarchical_rules, pipeline_rules, qk_clip_rules, fp8_rules,
                           cuda_graph_rules)


def rule_name(rule: Rule) -> str:
    """The name a rule is reported under: its function's name without the leading underscore
    and the ``_rules`` suffix (``_degrees`` -> 'degrees', ``moe_rules`` -> 'moe')."""
    return rule.__name__.lstrip("_").removesuffix("_rules")


def problems_by_rule(config: Config, world_size: int | None = None) -> list[tuple[str, str]]:
    """Every violated rule's message with the name of the rule that raised it
    (:func:`rule_name`), in :data:`RULES` order; empty when the config is valid."""
    return [(rule_name(rule), message) for rule in RULES
            for message in rule(config, world_size)]


def problems(config: Config, world_size: int | None = None) -> list[str]:
    """Every violated rule's message (empty when the config is valid)."""
    return [message for _, message in problems_by_rule(config, world_size)]


def validate(config: Config, world_size: int | None = None) -> Config:
    """Raise :class:`ConfigError` listing every problem; return the config when valid."""
    found = problems(config, world_size)
    if found:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in found))
    return config
