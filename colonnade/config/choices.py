"""The allowed values of every configuration field that takes one of a fixed set of names.

Each list has exactly this one owner: the validator checks fields against it, and the code that
implements the values imports it (and, where it keeps its own table, such as the pipeline's
schedule functions or the parameter dtypes, checks at import that the table covers this list).
"""

from __future__ import annotations

ARCHS: tuple[str, ...] = ("llama", "gpt2", "mistral", "qwen2", "qwen3", "deepseek_v3",
                          "gpt_oss")
"""model.arch: decoder architectures (colonnade.models.spec declares each)."""
ROPE_SCALINGS: tuple[str, ...] = ("none", "linear", "dynamic", "llama3", "yarn")
"""model.rope_scaling: how RoPE's frequencies are stretched for a longer context
(colonnade.models.rope computes each; HF's rope_type, with 'none' for its 'default')."""
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")
"""parallel.schedule: pipeline schedules (colonnade.pipeline.schedules builds each)."""
SCHEDULE_PLACEMENT: dict[str, str] = {"zbv": "v"}
"""Schedules whose virtual stages are not in the "loop" placement (models.stages)."""
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp64")
"""training.precision: parameter / compute dtypes (colonnade.models.build maps each)."""
AXES: tuple[str, ...] = ("tp", "cp", "dp", "pp")
"""Dense parallel axes (world = tp x cp x dp x pp); parallel.order is a '-'-joined permutation
of them, fastest first. ep is not among them: the expert view (etp, ep, edp) is derived inside
each pipeline stage (colonnade.parallel.dims). An order naming 'ep' ('tp-cp-ep-dp-pp', the
spelling before the expert view) still loads while parallel.ep = 1, where its place meant
nothing."""
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
"""training.recompute (colonnade.models.recompute), least recomputation first."""
RECOMPUTE_METHODS: tuple[str, ...] = ("uniform", "block")
"""training.recompute_method: how full recompute groups layers."""
NAN_POLICIES: tuple[str, ...] = ("stop", "skip")
"""training.on_nan: stop with an error or skip the step."""
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
"""training.device and `colonnade generate --device`."""
BACKENDS: tuple[str, ...] = ("auto", "gloo", "nccl")
"""parallel.backend: torch.distributed backend ('auto': nccl on GPUs, gloo on CPU)."""
LR_DECAYS: tuple[str, ...] = ("cosine", "linear", "constant", "wsd", "inverse_sqrt")
"""optim.decay values; colonnade.optim.lr implements each."""
OPTIMIZERS: tuple[str, ...] = ("adamw", "muon")
"""optim.name: the update (colonnade.optim.distributed builds each)."""
MUON_SCALES: tuple[str, ...] = ("match_adamw", "spectral")
"""optim.muon_scale: the shape-dependent scale of a Muon update (colonnade.optim.muon)."""
WSD_SHAPES: tuple[str, ...] = ("linear", "1-sqrt")
"""optim.decay_shape values (the final decay of decay='wsd')."""
LR_SCHEDULE_POLICIES: tuple[str, ...] = ("check", "checkpoint", "config")
"""checkpoint.lr_schedule: what a resume does when the run's LR schedule differs."""
OPTIMIZER_SWITCHES: tuple[str, ...] = ("check", "reset")
"""checkpoint.optimizer_switch: what a resume does when the checkpoint's optimizer differs."""
ON_EXISTING: tuple[str, ...] = ("auto", "resume", "overwrite", "refuse")
"""checkpoint.on_existing: what a run does with a checkpoint directory that already exists."""
RESTART_MODES: tuple[str, ...] = ("job", "in-process")
"""checkpoint.restart: how a failed rank is replaced (colonnade.reliability.supervisor)."""
ERROR_POLICIES: tuple[str, ...] = ("strict", "skip")
"""data.errors: fail listing every unreadable document, or leave them out (data/corpus.py)."""
DATA_FORMATS: tuple[str, ...] = ("text", "sft")
"""data.format: pretraining text, or prompt/response records with a loss mask (data/sft.py)."""
GRAD_REDUCE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
"""parallel.grad_reduce_dtype: dtype of the ZeRO-2/3 gradient reduce-scatter."""
OPTIM_DTYPES: tuple[str, ...] = GRAD_REDUCE_DTYPES
"""optim.state_dtype (Adam's moments, Muon's momentum) and optim.master_dtype (a bf16 model's
master weights): their storage, the same two dtypes as the gradient reduce (colonnade.optim)."""
CP_ATTENTIONS: tuple[str, ...] = ("ring", "all_to_all", "hierarchical")
"""parallel.cp_attention: how attention spans the cp ranks (colonnade.context_parallel)."""
MOE_ROUTERS: tuple[str, ...] = ("softmax", "sigmoid")
"""model.moe_router: how router logits become expert choices and weights (colonnade.moe)."""
MOE_AUX_LOSS_TYPES: tuple[str, ...] = ("seq", "global")
"""model.moe_aux_loss_type: the tokens the load-balancing loss counts over."""
MOE_DISPATCHERS: tuple[str, ...] = ("all_to_all", "all_gather")
"""parallel.moe_dispatcher: how tokens reach their experts' ranks (colonnade.moe)."""
FP8_RECIPES: tuple[str, ...] = ("off", "tensorwise", "rowwise")
"""training.fp8: float8 GEMMs of the linear layers (colonnade.tensor_parallel.float8)."""


def schedule_placement(schedule: str) -> str:
    """The virtual-stage placement of ``schedule``: "v" for zbv, else "loop"."""
    return SCHEDULE_PLACEMENT.get(schedule, "loop")


def tied_across_stages(tie_embeddings: bool, schedule: str) -> bool:
    """Whether a tied output head lives on another pipeline rank than the embedding (then the
    embedding group all-reduces their gradients): tied, unless the schedule's "v" placement
    keeps both on stage 0 (one Parameter there)."""
    return tie_embeddings and schedule_placement(schedule) == "loop"
