"""Build this rank's model chunks from the config and the process groups."""

from __future__ import annotations

import torch

from colonnade.config.choices import PRECISIONS, schedule_placement
from colonnade.config.rules_pipeline import stage_layout
from colonnade.config.sections import Config
from colonnade.models.compile import compile_layers, compile_mode, wants_compile
from colonnade.models.gpt import ModelChunk
from colonnade.models.recompute import RecomputePlan
from colonnade.models.recompute import install as install_recompute
from colonnade.models.spec import ArchSpec, arch_spec
from colonnade.models.stages import stage_chunks
from colonnade.moe.state import MoEState
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.layers import share_tied_across

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64,
}
if tuple(DTYPES) != PRECISIONS:
    raise AssertionError("models.build.DTYPES must map exactly config.choices.PRECISIONS")


def param_dtype(precision: str) -> torch.dtype:
    """Model parameter dtype of a training.precision value."""
    return DTYPES[precision]


def make_context(config: Config, groups: ProcessGroups, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, meta_params: bool = False
                 ) -> ParallelContext:
    """The ParallelContext every layer of this rank shares (``meta_params``: parameters are
    built on the meta device, to be materialised one at a time later). A mixture-of-experts
    model gets its :class:`~colonnade.moe.state.MoEState` (``ctx.moe``, the dp x cp group for
    the 'global' balancing loss), the ep and expert_tp groups (None when ``groups`` has no
    expert groups: then every MoE layer holds all experts, whole)."""
    par = config.parallel
    moe = MoEState(dp_cp=groups.dp_cp) if config.model.moe else None
    return ParallelContext(group=groups.tp, sp=par.sp, seed=config.training.seed,
                           rng=RNGTracker(config.training.seed),
                           dtype=dtype or param_dtype(config.training.precision),
                           device=device, comm_chunks=par.tp_comm_chunks, cp=groups.cp,
                           cp_attention=par.cp_attention, cp_overlap=par.cp_overlap,
                           cp_a2a=groups.cp_a2a, cp_ring=groups.cp_ring,
                           ep=groups.ep, expert_tp=groups.expert_tp,
                           moe_dispatcher=par.moe_dispatcher, moe=moe,
                           fp8=config.training.fp8,
                           param_device=torch.device("meta") if meta_params else None)


def defers_init(config: Config, groups: ProcessGroups) -> bool:
    """Whether :func:`build_chunks` leaves parameters on the meta device: ZeRO-3 over more than
    one rank, where DataParallel materialises each parameter from its recipe into its bucket
    and keeps only this rank's shard, so the full model never exists on one rank."""
    return config.parallel.zero == 3 and groups.shard_group.size > 1


def build_chunks(config: Config, groups: ProcessGroups, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, spec: ArchSpec | None = None
                 ) -> list[ModelChunk]:
    """The vp model chunks of this pipeline rank (one chunk when vp = 1).

    ``spec`` chooses the architecture's classes (default: the registered
    :func:`~colonnade.models.spec.arch_spec` of ``config.model.arch``).

    ZeRO-3 (:func:`defers_init`): parameters are built on the meta device with their init
    recipe (``param.init_recipe``); non-parameter buffers (RoPE tables) are real.
    :class:`~colonnade.data_parallel.ddp.DataParallel` then materialises them one at a time
    (``FlatBuffers(initial_values=...)``, one bucket full at a time) from the same
    layout-independent blocks, so the weights are bit-identical to an eager build.

    Initial weights are bit-identical to the single-process model's in every layout: each
    rank builds only its shard, from blocks drawn from (seed, global name, block index)
    (:func:`colonnade.tensor_parallel.sharding.init_shard`). The activation
    recomputation plan of ``config.training`` is installed on every chunk, and with
    ``training.compile`` every transformer layer is compiled
    (:func:`colonnade.models.compile.compile_layers`; compilation happens at the first step).
    """
    par = config.parallel
    meta = defers_init(config, groups)
    ctx = make_context(config, groups, device, dtype, meta_params=meta)
    spec = spec if spec is not None else arch_spec(config.model)
    specs = stage_chunks(config.model.num_layers, par.pp, par.vp, groups.pp_rank,
                         stage_layout(par, config.model.num_layers),
                         schedule_placement(par.schedule))
    chunks: list[ModelChunk] = []
    for layers, first, last in specs:
        chunk = ModelChunk(config.model, ctx, layers, first=first, last=last,
                           label_smoothing=config.training.label_smoothing, spec=spec)
        if device is not None and not meta:
            chunk = chunk.to(device)
        elif device is not None:  # meta parameters stay; buffers (RoPE tables) move
            for module in chunk.modules():
                for name, buf in module.named_buffers(recurse=False):
                    module._buffers[name] = buf.to(device)
        chunks.append(chunk)
    share_tied_across(chunks)  # the "v" placement: embedding and head on one rank
    install_recompute(chunks, RecomputePlan.from_config(config.training))
    if wants_compile(config.training):  # training.compile or training.cuda_graphs
        compile_layers(chunks, mode=compile_mode(config.training))
    return chunks


def build_reference(config: Config, dtype: torch.dtype | None = None,
                    device: torch.device | None = None, spec: ArchSpec | None = None
                    ) -> ModelChunk:
    """The single-process model (tp = pp = 1, no sp) of the same config, seed and spec.

    Never compiled (``training.compile`` is ignored): it serves generation with KV caches,
    export and the analysis models, which run a forward or two; call
    :func:`~colonnade.models.compile.compile_layers` on it to compile it.
    """
    import dataclasses

    single = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, tp=1, pp=1, vp=1, dp=1, sp=False,
                                             tp_comm_chunks=1, pipeline_layout=None,
                                             schedule="1f1b"),
        training=dataclasses.replace(config.training, compile=False, cuda_graphs=False))
    (chunk,) = build_chunks(single, ProcessGroups.single(), device, dtype, spec)
    return chunk
