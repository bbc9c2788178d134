"""What is planned: the workload (model, batch, precision) and one parallel layout.

A :class:`Workload` is fixed by the user; a :class:`Layout` is one point of the search space
(tp, cp, pp, vp, dp, micro-batch, ZeRO stage, recompute, sp, schedule, cp attention).  Both
convert to and from the colonnade :class:`~colonnade.config.sections.Config`, so a planned
layout is a runnable config.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from colonnade.analysis.activations import ATTENTION_KERNELS, KERNEL_PATHS
from colonnade.analysis.moe import dense_model
from colonnade.config.choices import (
    CP_ATTENTIONS,
    MOE_DISPATCHERS,
    OPTIM_DTYPES,
    OPTIMIZERS,
    schedule_placement,
)
from colonnade.config.rules_pipeline import stage_layout
from colonnade.config.sections import Config, ModelConfig
from colonnade.models.counts import LayerShape
from colonnade.models.stages import stage_chunks

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}
REDUCE_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per element of the stage-2/3 gradient reduce-scatter, by parallel.grad_reduce_dtype."""
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The model and what one optimizer step processes; independent of the layout."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    precision: str = "bf16"
    attention: str = "flash"
    """'flash' (fused SDPA: no s x s scores kept), 'blockwise' (colonnade's attention with
    dropout: scores computed block by block, none kept) or 'eager' (scores materialised, as in
    Megatron 2021; the Korthikanti et al. activation formulas assume it)."""
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    overlap_p2p: bool = True
    bucket_size: int = 40_000_000
    """parallel.bucket_size: elements per gradient bucket (and per gathered stage-3 bucket)."""
    zero_prefetch: int = 1
    """parallel.zero_prefetch: stage-3 buckets gathered ahead of the one in use."""
    grad_reduce_dtype: str = "fp32"
    """parallel.grad_reduce_dtype: dtype of the stage-2/3 gradient reduce-scatter ('fp32' or
    'bf16'; an fp64 model reduces in fp64)."""
    cp_overlap: bool = True
    """parallel.cp_overlap: ring attention's p2p overlapped with the local block's attention
    (False: every ring transfer is exposed)."""
    moe_dispatcher: str = "all_to_all"
    """parallel.moe_dispatcher under ep > 1: 'all_to_all' or 'all_gather'
    (:mod:`colonnade.analysis.moe` gives each one's bytes)."""
    state_dtype: str = "fp32"
    """optim.state_dtype: storage of the optimizer's moments ('fp32' or 'bf16'; fp64 models
    keep fp64 ones)."""
    master_dtype: str = "fp32"
    """optim.master_dtype: a bf16 model's master weights ('fp32' copy, or 'bf16': none)."""
    optimizer: str = "adamw"
    """optim.name: 'adamw', or 'muon' (one momentum for each hidden matrix's element instead
    of Adam's two moments: :func:`colonnade.analysis.memory.layer_muon_params`)."""
    fsdp_fp32_states: bool = False
    """FSDP mixed precision (llm-foundry's amp_bf16, torchtitan's FSDP2): fp32 sharded weights
    that are their own masters, gathered in bf16 for compute, so a parameter's states are
    those of an fp32 model (4 + 4 + 8 = 16 bytes) while activations stay 16-bit; how
    published FSDP runs kept their states.  Colonnade keeps bf16 weights and an fp32 master
    (False: 2 + 4 + 12)."""
    fused_loss: bool = False
    """The system's cross entropy is one fused kernel that writes the logits' gradient in place
    (flash-attn's, llm-foundry's MPT default ``loss_fn: fused_crossentropy``): no loss-backward
    transient (:func:`~colonnade.analysis.memory.loss_backward_bytes`).  Colonnade's is not."""
    kernels: str = "cuda"
    """Whose kernels run the layers, 'cuda' or 'cpu' (:data:`~colonnade.analysis.activations.
    KERNEL_PATHS`): the activation model's kernel path.  ``plan`` and ``estimate`` take the
    cluster's (``Cluster.kernels``); :meth:`from_config` 'cuda' with training.device='cuda',
    else 'cpu' (the paths differ only in LayerNorm's statistics, 4 r b bytes per norm)."""
    sp_regather: bool = False
    """Under sp, keep each column-parallel input as its [s/t, b, h] shard and all-gather it again
    in backward (Megatron-LM, Korthikanti et al. 2022 Sec. 4.2.2): how published Megatron
    configurations ran.  Colonnade keeps the gathered input (False)."""

    def __post_init__(self) -> None:
        if self.grad_reduce_dtype not in REDUCE_BYTES:
            raise ValueError(f"grad_reduce_dtype='{self.grad_reduce_dtype}' is unknown; use "
                             f"one of {sorted(REDUCE_BYTES)}.")
        if self.zero_prefetch < 0:
            raise ValueError(f"zero_prefetch={self.zero_prefetch} must be >= 0.")
        if self.precision not in ELEMENT_BYTES:
            raise ValueError(f"training.precision='{self.precision}' is unknown; use one of "
                             f"{sorted(ELEMENT_BYTES)}.")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention='{self.attention}' must be one of "
                             f"{', '.join(ATTENTION_KERNELS)}.")
        if self.kernels not in KERNEL_PATHS:
            raise ValueError(f"kernels='{self.kernels}' must be one of "
                             f"{', '.join(KERNEL_PATHS)}.")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"moe_dispatcher='{self.moe_dispatcher}' must be one of "
                             f"{', '.join(MOE_DISPATCHERS)}.")
        for name, value in (("state_dtype", self.state_dtype),
                            ("master_dtype", self.master_dtype)):
            if value not in OPTIM_DTYPES:
                raise ValueError(f"{name}='{value}' must be one of {', '.join(OPTIM_DTYPES)}.")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer='{self.optimizer}' must be one of "
                             f"{', '.join(OPTIMIZERS)}.")
        if self.seq_len < 1 or self.global_batch < 1:
            raise ValueError(f"seq_len={self.seq_len} and global_batch={self.global_batch} must "
                             "be >= 1.")

    @functools.cached_property
    def shape(self) -> LayerShape:
        """Resolved shape of the model's dense part (computed once per workload): an MoE
        model's layers are counted with a dense MLP here and corrected by
        :mod:`colonnade.analysis.moe`."""
        return LayerShape.of(dense_model(self.model))

    @property
    def elem(self) -> int:
        """Bytes of one activation / weight element."""
        return ELEMENT_BYTES[self.precision]

    @property
    def states_precision(self) -> str:
        """The precision whose state bytes a parameter keeps ('fp32' under
        ``fsdp_fp32_states``, else ``precision``)."""
        return "fp32" if self.fsdp_fp32_states else self.precision

    @property
    def mixed(self) -> bool:
        """16-bit weights with fp32 master weights and fp32 gradient buffer."""
        return self.precision in ("bf16", "fp16")

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of the stage-2/3 gradient reduce-scatter (fp64 models: 8)."""
        return 8 if self.precision == "fp64" else REDUCE_BYTES[self.grad_reduce_dtype]

    @classmethod
    def from_config(cls, cfg: Config, global_batch: int | None = None,
                    seq_len: int | None = None, attention: str = "auto") -> Workload:
        """Workload of a colonnade config (global batch must be known or given).

        ``attention='auto'`` follows colonnade's models: fused SDPA ('flash') unless attention
        dropout is on, in which case the blockwise kernel runs ('blockwise').
        """
        tr, par = cfg.training, cfg.parallel
        if attention == "auto":
            attention = "blockwise" if cfg.model.attention_dropout > 0 else "flash"
        batch = global_batch if global_batch is not None else tr.global_batch_size
        if batch is None:
            raise ValueError("the global batch is unknown: give --global-batch or set "
                             "training.global_batch_size.")
        return cls(model=cfg.model, seq_len=seq_len or tr.seq_len, global_batch=batch,
                   precision=tr.precision, attention=attention,
                   overlap_grad_reduce=par.overlap_grad_reduce,
                   overlap_param_gather=par.overlap_param_gather, overlap_p2p=par.overlap_p2p,
                   bucket_size=par.bucket_size, zero_prefetch=par.zero_prefetch,
                   grad_reduce_dtype=par.grad_reduce_dtype, cp_overlap=par.cp_overlap,
                   moe_dispatcher=par.moe_dispatcher, state_dtype=cfg.optim.state_dtype,
                   master_dtype=cfg.optim.master_dtype, optimizer=cfg.optim.name,
                   kernels="cuda" if tr.device == "cuda" else "cpu")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One parallel layout of a workload on ``tp * cp * pp * dp`` devices."""

    tp: int = 1
    cp: int = 1
    """Context-parallel degree: each rank holds s / cp rows of every sample (zigzag split)."""
    cp_attention: str = "ring"
    """parallel.cp_attention under cp > 1: 'ring', 'all_to_all' or 'hierarchical'
    (:data:`CP_ATTENTIONS`)."""
    cp_a2a_size: int | None = None
    """parallel.cp_a2a_size: the inner all-to-all group of 'hierarchical' (a divisor of cp;
    the ring spans cp / cp_a2a_size); None for the other kinds."""
    pp: int = 1
    vp: int = 1
    dp: int = 1
    ep: int = 1
    """Expert-parallel degree (parallel.ep): folded inside tp x cp x dp, the experts of each
    MoE layer split over ep ranks, their states over edp = tp cp dp / (ep expert_tp)."""
    expert_tp: int = 1
    """Expert tensor-parallel degree (parallel.expert_tp): each expert's f split over this
    many ranks, folded with ep inside tp x cp x dp."""
    micro_batch: int = 1
    zero: int = 0
    """ZeRO stage (parallel.zero_stage): 0 none, 1 optimizer states sharded, 2 + gradients,
    3 + parameters, each over the shard group (dp ranks, or ``zero_shard_size`` of them)."""
    recompute: str = "none"
    sp: bool = False
    schedule: str = "1f1b"
    reshard_after_forward: bool | None = None
    """Stage 3: free gathered parameters after forward and re-gather them for backward;
    None = True without pp, False with pp (parameters kept for the step's micro-batches)."""
    zero_shard_size: int | None = None
    """Hybrid sharding: shard over groups of this many dp ranks, replicate across them;
    None = the whole dp group."""
    pipeline_layout: tuple[int, ...] | None = None
    """Layers per virtual stage (parallel.pipeline_layout: pp x vp entries in virtual-stage
    order, uneven stages); None = the even split l / (pp vp)."""

    def __post_init__(self) -> None:
        if self.cp < 1 or self.cp_attention not in CP_ATTENTIONS:
            raise ValueError(f"cp={self.cp} must be >= 1 and cp_attention="
                             f"'{self.cp_attention}' one of {', '.join(CP_ATTENTIONS)}.")
        a2a = self.cp_a2a_size
        if (self.cp_attention == "hierarchical") != (a2a is not None) or (
                a2a is not None and (a2a < 1 or self.cp % a2a)):
            raise ValueError(f"cp_a2a_size={a2a} must divide cp={self.cp} with cp_attention="
                             "'hierarchical' and be None otherwise.")
        if min(self.ep, self.expert_tp) < 1 or (self.tp * self.cp * self.dp) % (
                self.ep * self.expert_tp):
            raise ValueError(f"ep={self.ep} x expert_tp={self.expert_tp} must be >= 1 and "
                             f"divide tp x cp x dp = {self.tp * self.cp * self.dp}.")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero={self.zero}: the ZeRO stage must be one of {ZERO_STAGES}.")
        lay = self.pipeline_layout
        if lay is not None and (len(lay) != self.pp * self.vp or min(lay) < 0):
            raise ValueError(f"pipeline_layout={list(lay)} must have pp x vp = "
                             f"{self.pp * self.vp} non-negative entries.")
        if self.zero_shard_size is not None and (self.zero_shard_size < 1
                                                 or self.dp_cp % self.zero_shard_size):
            raise ValueError(f"zero_shard_size={self.zero_shard_size} must divide "
                             f"dp={self.dp_cp}"
                             + (f" (dp {self.dp} x cp {self.cp})." if self.cp > 1 else "."))
        size = self.expert_shard_size
        if size is not None and self.edp % size:
            raise ValueError(f"zero_shard_size={self.zero_shard_size} must divide the expert "
                             f"dp = tp cp dp / ep = {self.edp} or be a multiple of it.")

    @property
    def dp_cp(self) -> int:
        """Ranks gradients are reduced over and ZeRO shards over: dp x cp."""
        return self.dp * self.cp

    @property
    def shard(self) -> int:
        """Ranks the sharded states are divided over (1 at stage 0): dp x cp, or
        ``zero_shard_size`` of them."""
        if self.zero == 0:
            return 1
        return self.zero_shard_size or self.dp_cp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree tp cp dp / (ep expert_tp): expert gradients are reduced
        and their ZeRO states (stage 2: + gradients, 3: + parameters) sharded over it."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    @property
    def expert_shard_size(self) -> int | None:
        """Hybrid sharding of the expert weights: min(zero_shard_size, edp) expert-dp ranks
        per shard group (None without hybrid sharding)."""
        if self.zero_shard_size is None:
            return None
        return min(self.zero_shard_size, self.edp)

    @property
    def expert_shard(self) -> int:
        """Ranks the routed experts' sharded states are divided over (1 at stage 0): edp, or
        :attr:`expert_shard_size` of them."""
        if self.zero == 0:
            return 1
        return self.expert_shard_size or self.edp

    def local_tokens(self, seq_len: int) -> float:
        """Tokens of one micro-batch on one rank: b s / cp (the rank's zigzag rows)."""
        return float(self.micro_batch) * seq_len / self.cp

    @property
    def reshard(self) -> bool:
        """Stage 3's resolved reshard_after_forward (None: True iff pp == 1)."""
        if self.reshard_after_forward is None:
            return self.pp == 1
        return self.reshard_after_forward

    @property
    def placement(self) -> str:
        """The virtual-stage placement of the schedule ("v" for zbv, else "loop")."""
        return schedule_placement(self.schedule) if self.pp > 1 else "loop"

    def stage_layers(self, num_layers: int) -> tuple[tuple[int, ...], ...]:
        """Global layer indices each pipeline stage holds (all its chunks), stage order."""
        return _stage_layers(num_layers, self.pp, self.vp, self.pipeline_layout,
                             self.placement)

    def chunk_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers of each virtual stage, in virtual-stage order."""
        if self.pipeline_layout is not None:
            return self.pipeline_layout
        return (num_layers // (self.pp * self.vp),) * (self.pp * self.vp)

    @property
    def head_stage(self) -> int:
        """The pipeline stage holding the head (and the MTP modules): pp - 1, or 0 under the
        "v" placement."""
        return 0 if self.placement == "v" else self.pp - 1

    def max_stage_layers(self, num_layers: int) -> int:
        """Layers of the pipeline stage holding the most (l // pp with even stages)."""
        if self.pipeline_layout is None:
            return num_layers // self.pp
        return max(len(held) for held in self.stage_layers(num_layers))

    def stage_kind(self, index: int) -> str:
        """The kind of pipeline stage ``index``: 'only' (no pipeline), 'first' (embedding),
        'last' (head and loss), 'middle'; under zbv 'ends' (stage 0: both) and 'middle'."""
        if self.pp == 1:
            return "only"
        if self.schedule == "zbv":
            return "ends" if index == 0 else "middle"
        return "first" if index == 0 else "last" if index == self.pp - 1 else "middle"

    def stage_index(self, stage: str | int, num_layers: int) -> int:
        """The pipeline stage a kind stands for: 'first' / 'only' / 'ends' 0, 'last' pp - 1,
        'middle' the middle stage holding the most layers (with even stages: any); an int
        is that stage."""
        if isinstance(stage, int):
            return stage
        if stage == "last":
            return self.pp - 1
        middles = range(1, self.pp if self.schedule == "zbv" else self.pp - 1)
        if stage != "middle" or not middles:
            return 0
        held = self.stage_layers(num_layers)
        return max(middles, key=lambda j: (len(held[j]), -j))

    def stage_layer_count(self, stage: str | int, num_layers: int) -> int:
        """Layers held by ``stage`` (a kind, :meth:`stage_index`, or a stage index)."""
        return len(self.stage_layers(num_layers)[self.stage_index(stage, num_layers)])

    def zero_label(self) -> str:
        """The stage for tables: '-', '1', '2', '3' ('3k' keeps gathered parameters over the
        step's micro-batches; '/S' appended with hybrid sharding over S ranks)."""
        if self.zero == 0:
            return "-"
        label = f"{self.zero}{'k' if self.zero == 3 and not self.reshard else ''}"
        return label + (f"/{self.zero_shard_size}" if self.zero_shard_size else "")

    @property
    def cp_kind(self) -> str:
        """The cp attention for tables: 'ring', 'all_to_all', or 'a2a{a}xring{r}'."""
        if self.cp_a2a_size is None:
            return self.cp_attention
        return f"a2a{self.cp_a2a_size}xring{self.cp // self.cp_a2a_size}"

    @property
    def world(self) -> int:
        """Devices used."""
        return self.tp * self.cp * self.pp * self.dp

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step per dp rank, m = B / (dp * micro_batch)."""
        return global_batch // (self.dp * self.micro_batch)

    def short(self) -> str:
        """Compact one-line description."""
        extra = []
        if self.sp:
            extra.append("sp")
        if self.cp > 1:
            extra.append(f"cp{self.cp}:{self.cp_kind}")
        if self.ep > 1:
            extra.append(f"ep{self.ep}")
        if self.expert_tp > 1:
            extra.append(f"etp{self.expert_tp}")
        if self.zero:
            extra.append(f"zero{self.zero_label()}")
        tail = (" " + " ".join(extra)) if extra else ""
        sched = f" {self.schedule}" if self.pp > 1 else ""
        if self.pipeline_layout is not None:
            sched += " layers=" + ",".join(map(str, self.pipeline_layout))
        return (f"tp{self.tp} pp{self.pp} vp{self.vp} dp{self.dp} mb{self.micro_batch}"
                f"{sched} rc={self.recompute}{tail}")

    def to_config(self, base: Config, workload: Workload) -> Config:
        """A colonnade config running this layout (the model and batch of ``workload``)."""
        par = dataclasses.replace(
            base.parallel, tp=self.tp, cp=self.cp, cp_attention=self.cp_attention,
            cp_a2a_size=self.cp_a2a_size, cp_overlap=workload.cp_overlap, ep=self.ep,
            expert_tp=self.expert_tp if self.expert_tp > 1 else base.parallel.expert_tp,
            moe_dispatcher=workload.moe_dispatcher, pp=self.pp, vp=self.vp, dp=self.dp, sp=self.sp,
            schedule=self.schedule if self.pp > 1 else "1f1b",
            use_distributed_optimizer=False, zero_stage=self.zero,
            reshard_after_forward=self.reshard_after_forward,
            zero_shard_size=self.zero_shard_size, zero_prefetch=workload.zero_prefetch,
            grad_reduce_dtype=workload.grad_reduce_dtype,
            overlap_grad_reduce=workload.overlap_grad_reduce,
            overlap_param_gather=workload.overlap_param_gather,
            overlap_p2p=workload.overlap_p2p, bucket_size=workload.bucket_size,
            pipeline_layout=self.pipeline_layout, first_stage_layers=None,
            last_stage_layers=None,
        )
        tr = dataclasses.replace(
            base.training, seq_len=workload.seq_len, micro_batch_size=self.micro_batch,
            global_batch_size=workload.global_batch,
            microbatches=self.microbatches(workload.global_batch),
            precision=workload.precision, recompute=self.recompute,
        )
        return dataclasses.replace(base, model=workload.model, parallel=par, training=tr)

    def overrides(self) -> list[str]:
        """``--section.field=value`` overrides that select this layout in `colonnade train`."""
        # use_distributed_optimizer=false: a base config's Megatron spelling of stage 1 must
        # not lift a planned stage 0 (the effective stage is the larger of the two)
        zero = [f"--parallel.zero_stage={self.zero}", "--parallel.use_distributed_optimizer=false"]
        if self.zero == 3 and self.reshard_after_forward is not None:
            zero.append(f"--parallel.reshard_after_forward={str(self.reshard).lower()}")
        if self.zero and self.zero_shard_size:
            zero.append(f"--parallel.zero_shard_size={self.zero_shard_size}")
        cp = [f"--parallel.cp={self.cp}"] + ([f"--parallel.cp_attention={self.cp_attention}"]
                                             if self.cp > 1 else [])
        if self.cp_a2a_size is not None:
            cp.append(f"--parallel.cp_a2a_size={self.cp_a2a_size}")
        ep = [f"--parallel.ep={self.ep}"] if self.ep > 1 else []
        ep += [f"--parallel.expert_tp={self.expert_tp}"] if self.expert_tp > 1 else []
        if self.pipeline_layout is not None:
            ep.append("--parallel.pipeline_layout=" + ",".join(map(str, self.pipeline_layout)))
        return [
            f"--parallel.tp={self.tp}", *cp, *ep, f"--parallel.pp={self.pp}",
            f"--parallel.vp={self.vp}",
            f"--parallel.dp={self.dp}", f"--parallel.sp={str(self.sp).lower()}",
            f"--parallel.schedule={self.schedule if self.pp > 1 else '1f1b'}",
            *zero,
            f"--training.micro_batch_size={self.micro_batch}",
            f"--training.recompute={self.recompute}",
        ]

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> Layout:
        """The layout of a colonnade config on ``world_size`` devices."""
        par, tr = cfg.parallel, cfg.training
        dp = par.dp if par.dp is not None else world_size // (par.tp * par.cp * par.pp)
        return cls(tp=par.tp, cp=par.cp, cp_attention=par.cp_attention,
                   cp_a2a_size=par.cp_a2a_size, ep=par.ep, expert_tp=par.expert_tp or 1,
                   pp=par.pp,
                   vp=par.vp,
                   dp=dp, micro_batch=tr.micro_batch_size,
                   zero=par.zero, recompute=tr.recompute, sp=par.sp, schedule=par.schedule,
                   reshard_after_forward=par.reshard_after_forward,
                   zero_shard_size=par.zero_shard_size,
                   pipeline_layout=stage_layout(par, cfg.model.num_layers))


@functools.lru_cache(maxsize=4096)
def _stage_layers(num_layers: int, pp: int, vp: int, layout: tuple[int, ...] | None,
                  placement: str) -> tuple[tuple[int, ...], ...]:
    """Per pipeline stage, the global layer indices of all its chunks (cached: the search
    asks for the same split many times)."""
    return tuple(tuple(i for layers, _, _ in stage_chunks(num_layers, pp, vp, s, layout,
                                                          placement) for i in layers)
                 for s in range(pp))
