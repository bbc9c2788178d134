"""Configuration sections: frozen, keyword-only dataclasses, one per subsystem.

Every field carries a docstring (the string literal under it); ``colonnade train --help`` and
``--print-config`` read them through :func:`colonnade.config.docs.field_docs`. Cross-field
checks live in one place, :mod:`colonnade.config.validate`; nothing here checks anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from colonnade.config.model import (  # re-exported: the model section lives there
    ARCH_TRAITS,
    DEFAULT_VOCAB_SIZE,
    VOCAB_PAD_MULTIPLE,
    ArchTraits,
    ModelConfig,
)

__all__ = [
    "ARCH_TRAITS",
    "DEFAULT_VOCAB_SIZE",
    "SECTIONS",
    "VOCAB_PAD_MULTIPLE",
    "ArchTraits",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainingConfig",
]
"""The section classes; the model section's names are re-exported from
:mod:`colonnade.config.model`."""



@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees of each parallel axis and the switches of the parallel wrappers."""

    tp: int = 1
    """Tensor-parallel degree: each layer's matrices split across tp ranks."""
    pp: int = 1
    """Pipeline-parallel degree: layers split into pp stages."""
    vp: int = 1
    """Virtual pipeline chunks per pp rank: > 1 with 'interleaved_1f1b', exactly 2 with
    'zbv'."""
    dp: int | None = None
    """Data-parallel degree; None derives it as world_size / (tp * pp * cp) (ep does not
    count: it is folded inside tp x cp x dp)."""
    cp: int = 1
    """Context-parallel degree: each sample's sequence split across cp ranks, through
    attention as well (causal load balance: rank r holds sequence chunks r and 2cp-1-r of
    2cp, the "zigzag" split); activation memory per rank falls as 1/cp."""
    cp_attention: str = "ring"
    """How attention sees the whole sequence under cp > 1: 'ring' (key/value blocks passed
    around the cp ring by p2p, overlapped with the local block's attention; any head count)
    or 'all_to_all' (Ulysses: an all-to-all trades the sequence split for a head split, so
    heads / tp and kv heads / tp must be divisible by cp) or 'hierarchical' (USP: all_to_all
    inside groups of ``cp_a2a_size`` consecutive cp ranks, ring across the cp / cp_a2a_size
    groups, so cp can exceed the head count)."""
    cp_a2a_size: int | None = None
    """cp_attention='hierarchical' only (required there): ranks of its inner all-to-all group,
    a divisor of cp that divides heads / tp (cp = cp_a2a_size x ring size; cp_a2a_size = cp
    is plain all_to_all, 1 plain ring). Put it on the fast links: the inner groups are
    consecutive cp ranks."""
    cp_overlap: bool = True
    """Ring attention: post the next key/value transfer before computing on the current
    block (False: wait for each transfer first; same results, for measuring the overlap)."""
    ep: int = 1
    """Expert-parallel degree: the experts of a mixture-of-experts layer split across ep ranks.
    It does not multiply the world size: ep x expert_tp ranks are folded inside the
    tp x cp x dp ranks of each pipeline stage, the rest being expert data parallelism
    (edp = tp x cp x dp / (ep x expert_tp)); ep x expert_tp must divide tp x cp x dp. Dense
    weights are unaffected (a model without expert layers trains exactly as with ep = 1)."""
    expert_tp: int | None = None
    """Expert tensor-parallel degree (Megatron's MoE parallel folding): each routed expert's
    gate/up split by rows (column-parallel) and down by columns (row-parallel) across this
    many ranks of a stage, chosen independently of tp (ep x expert_tp folded inside
    tp x cp x dp); None resolves to 1 (whole experts) for a mixture-of-experts model. It
    must divide model.moe_ffn_hidden_size."""
    moe_dispatcher: str = "all_to_all"
    """How tokens reach the ranks holding their experts under ep > 1: 'all_to_all' (each
    rank sends every token copy to its expert's rank, split sizes exchanged first; bytes
    ~ tokens x k) or 'all_gather' (every rank gathers all tokens of the ep group and keeps
    those for its experts, then the outputs are reduce-scattered back; simpler, bytes ~
    tokens x ep: for small ep)."""
    sp: bool = False
    """Sequence parallelism: norms/dropout on sequence shards between tp regions (needs tp > 1)."""
    order: str = "tp-cp-dp-pp"
    """Dense rank order, fastest-varying axis first: consecutive ranks share a tp group by
    default. The expert axes are derived inside each stage (etp fastest, then ep, then edp);
    the older spelling with 'ep' (e.g. 'tp-cp-ep-dp-pp') is accepted only while ep = 1."""
    schedule: str = "1f1b"
    """Pipeline schedule: 'gpipe', '1f1b', 'interleaved_1f1b' (needs vp > 1), 'zb_h1' (1F1B
    with the backward split into input and weight gradients) or 'zbv' (zero-bubble ZB-V: vp = 2
    chunks per stage in a V, stage 0 holding both the embedding and the head)."""
    pipeline_layout: tuple[int, ...] | None = None
    """Layers per virtual stage (pp * vp entries, in virtual-stage order) for uneven splits;
    an entry may be 0 (a virtual stage that only passes activations on, or only holds the
    embedding or the head)."""
    first_stage_layers: int | None = None
    """Layers of the virtual stage holding the embedding (Megatron's
    --decoder-first-pipeline-num-layers; with vp > 1 only that chunk), the other virtual
    stages splitting the rest evenly; None: part of the even split. Not with pipeline_layout
    (config/rules_pipeline.py expands it)."""
    last_stage_layers: int | None = None
    """Layers of the virtual stage holding the head and the loss (Megatron's
    --decoder-last-pipeline-num-layers; under zbv a chunk of stage 0), the other virtual
    stages splitting the rest evenly; None: part of the even split. Not with pipeline_layout."""
    use_distributed_optimizer: bool = False
    """ZeRO-1 in Megatron's spelling: shard fp32 master weights and Adam states across dp
    ranks; the same as zero_stage >= 1 (code reads the effective stage, :attr:`zero`)."""
    zero_stage: int = 0
    """ZeRO stage over the shard group (dp x cp ranks, or zero_shard_size of them): 0 none
    (gradients all-reduced), 1 optimizer states sharded, 2 + gradients sharded (reduce-scatter
    on every micro-batch, accumulated into this rank's fp32 shard), 3 + parameters sharded
    (gathered per bucket before use, freed after)."""
    reshard_after_forward: bool | None = None
    """Stage 3: free a layer's gathered parameters after its forward and re-gather them for
    backward (FSDP2's knob). None: True when pp = 1; False when pp > 1 (a chunk's parameters
    stay gathered from its first forward of the step until the step's gradient sync ends)."""
    zero_prefetch: int = 1
    """Stage 3: buckets gathered ahead of the one in use (forward and backward); 0 gathers each
    bucket only when it is needed."""
    zero_shard_size: int | None = None
    """Hybrid sharding: shard over groups of this many consecutive dp x cp ranks and replicate
    across the groups (gradients all-reduced over the replicate group after the shard group's
    reduce-scatter); None shards over the whole dp x cp group. Needs a ZeRO stage >= 1."""
    grad_reduce_dtype: str = "fp32"
    """Dtype of the stage-2/3 gradient reduce-scatter: 'fp32' or 'bf16' (an fp64 model reduces
    in fp64); accumulation into the shard is always fp32 (fp64 for fp64 models)."""
    overlap_grad_reduce: bool = True
    """Launch each gradient bucket's reduction as soon as backward has filled it."""
    overlap_param_gather: bool = True
    """With ZeRO-1: all-gather updated params per bucket, waited in a pre-forward hook."""
    bucket_size: int = 40_000_000
    """Gradient bucket size in elements (tensor fusion granularity)."""
    average_in_collective: bool = False
    """Average over dp inside the collective (ReduceOp.AVG) instead of pre-scaling every
    gradient bucket by 1/dp before a SUM (the default; keeps the summed values in range)."""
    tp_comm_chunks: int = 1
    """Split sp all-gather+matmul / matmul+reduce-scatter into this many chunks (1: off)."""
    overlap_p2p: bool = True
    """Post pipeline sends/receives asynchronously and wait only when the data is needed."""
    p2p_in_order: bool = False
    """Run each rank's pipeline p2p groups one after another, a group done only when all its
    sends and receives are, as NCCL does (always so on NCCL). On gloo a checking mode: a run
    that completes with it completes on NCCL; slightly slower, results identical."""
    backend: str = "auto"
    """torch.distributed backend: 'auto' (nccl on GPU, gloo on CPU), 'gloo' or 'nccl'."""
    timeout_s: float = 300.0
    """Timeout of every collective; a rank that waits longer fails naming group and operation."""
    watchdog_s: float | None = None
    """Hang detector: a rank with no finished step and no completed collective for this long
    (or waiting this long for one collective) dumps its Python stacks and last collective to
    logging.dir/failures and exits, and the launcher kills a rank whose heartbeat is this old
    (frozen); None means 0.8 x timeout_s, so both report before the collective timeout; must
    be < timeout_s; 0 disables."""

    @property
    def zero(self) -> int:
        """The effective ZeRO stage: max(zero_stage, 1 if use_distributed_optimizer else 0)."""
        return max(self.zero_stage, 1 if self.use_distributed_optimizer else 0)

    @property
    def reshard(self) -> bool:
        """reshard_after_forward with its default resolved (True when pp = 1, else False)."""
        if self.reshard_after_forward is None:
            return self.pp == 1
        return self.reshard_after_forward


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokens come from."""

    input: str | None = None
    """What to prepare; None: train uses prepared_dir as it is, or the built-in corpus (Python
    stdlib) in its locations (see prepared_dir). A file (.txt/.md/.py...
    one document each; .jsonl/.ndjson, also .gz/.zst; .json array of records; .csv/.tsv with a
    header; .parquet; .arrow), a directory of such files (sorted), a Hugging Face datasets
    directory (save_to_disk), a glob ('shards/*.jsonl.zst'), or a comma-separated list. A part
    may end in ':KEY' to read the text of its records from field/column KEY instead of
    text_key: 'a.jsonl,b.parquet:body' (a.jsonl under text_key, b.parquet under 'body'; KEY
    holds no '/'; a path whose name holds ':' is taken whole when it exists). A prepared_dir
    built from other inputs, keys, tokenizer, vocab size or format is never overwritten
    unless data.overwrite."""
    prepared_dir: str = "data/stdlib"
    """Directory holding tokenizer.json and data.bin/.idx made by `colonnade prepare`. Without
    data.input, train uses it as it is (an error when it holds no dataset); only data/stdlib
    and data/stdlib-2k are built from the built-in corpus when missing."""
    tokenizer: str | None = None
    """An existing Hugging Face tokenizer.json, or a model directory holding one, to use
    instead of training a BPE; `prepare` then takes the vocab size from it (model.vocab_size
    need not be restated). Its EOD token: <|endoftext|>, <|end_of_text|>, </s>, <eos>.
    Unset with checkpoint.init_from, when data.input goes into a prepared_dir holding no
    dataset yet: the tokenizer.json stored with that checkpoint or HF folder, if it has one."""
    text_key: str = "text"
    """Field (jsonl/json records) or column (csv, parquet, arrow, HF datasets) holding the
    text of each document; a data.input part with a ':KEY' suffix uses KEY instead."""
    format: str = "text"
    """What `prepare` makes of the input: 'text' (pretraining: documents under text_key, every
    token in the loss) or 'sft' (supervised fine-tuning: .jsonl/.json records of prompt_key +
    response_key, or chat records under "messages" [{"role", "content"}], rendered with
    data.tokenizer's chat template when it has one, else as "<role>: <content>\n" per message
    (data/chat.py), only assistant replies trained on; writes a loss mask,
    mask.bin/.idx, beside data.bin/.idx so training masks the prompt and the non-assistant
    turns out of the loss (labels -100); samples are packed windows as in pretraining). `train`
    picks the mask up from the prepared dir by itself."""
    prompt_key: str = "prompt"
    """data.format='sft': field of a record holding the prompt (no loss on its tokens)."""
    response_key: str = "response"
    """data.format='sft': field of a record holding the response (its tokens and the EOD after
    it are trained on)."""
    reset_position_ids: bool = False
    """Restart position ids at 0 after every EOD inside a packed sample, so each document is
    seen from position 0 (Megatron's --reset-position-ids; RoPE and learned positions)."""
    reset_attention_mask: bool = False
    """Keep attention inside each document of a packed sample: a token does not attend across
    an EOD (Megatron's --reset-attention-mask; a [b, 1, s, s] mask instead of the causal
    kernel, so attention costs more memory)."""
    errors: str = "strict"
    """Unreadable documents (not UTF-8, invalid JSON, no text_key): 'strict' reads the whole
    input, then fails listing them all; 'skip' leaves them out and counts them in prepare.json."""
    num_workers: int = 1
    """Processes that tokenize during prepare (1: this process, already multi-threaded); the
    output is identical for any value."""
    blend: tuple[str, ...] = ()
    """Blend of prepared datasets as 'weight:path' strings, path a prepared dir (DIR) or its
    dataset prefix (DIR/data); the weights are the fractions of training samples drawn from
    each and must sum to 1 (within 0.01), e.g. '0.7:data/web,0.3:data/code'. Empty means
    prepared_dir alone. Validation still uses prepared_dir's valid split."""
    valid_fraction: float = 0.02
    """Fraction of samples held out for validation (every k-th block of windows, k = 1 /
    fraction, see data/dataset.py). 0 holds none out and trains on every window; it needs
    training.eval_interval=0 (no evaluation)."""
    max_corpus_bytes: int = 8_000_000
    """Cap on the built-in corpus size in bytes."""
    overwrite: bool = False
    """Let `prepare` / `train` replace a prepared_dir that holds a dataset built otherwise
    (its prepare.json records other inputs, text keys, tokenizer, vocab size or format).
    False refuses, naming the difference: pick a new prepared_dir or set true to rebuild it."""


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer (AdamW or Muon), the learning-rate schedule, clipping, the loss scaler and
    q/k logit clipping."""

    name: str = "adamw"
    """'adamw' for every parameter, or 'muon': Newton-Schulz-orthogonalised momentum for each
    2-D hidden matrix (attention and MLP projections, each expert's matrices) and AdamW for
    the rest (embeddings, output head, norms, biases, router weights); the split is
    colonnade.optim.muon.muon_matrices."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to lr."""
    decay: str = "cosine"
    """Schedule after warmup: 'cosine' or 'linear' to min_lr at training.steps, 'constant',
    'wsd' (warmup-stable-decay: lr until the last decay_fraction of training.steps, then to
    min_lr along decay_shape; MiniCPM / DeepSeek) or 'inverse_sqrt' (lr * sqrt(warmup_steps /
    step), step counted from 1, never below min_lr; Megatron's inverse-square-root)."""
    decay_fraction: float = 0.2
    """decay='wsd' only: fraction of training.steps, at the end, spent decaying from lr to min_lr
    (rounded to whole steps, at least 1); the last step runs at min_lr."""
    decay_shape: str = "linear"
    """decay='wsd' only: shape of the final decay in its progress t in (0, 1]: 'linear'
    (lr - (lr - min_lr) t) or '1-sqrt' (min_lr + (lr - min_lr)(1 - sqrt(t)), Hagele et al.)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    state_dtype: str = "fp32"
    """Storage of the optimizer states (Adam's exp_avg and exp_avg_sq, Muon's momentum):
    'fp32', or 'bf16' (half the bytes; the update still computes in fp32 on bounded chunks and
    rounds to nearest on the way back; Megatron's --use-precision-aware-optimizer). fp64 runs
    keep fp64 states (bf16 is refused there)."""
    master_dtype: str = "fp32"
    """Master weights of a bf16 model: 'fp32' (a separate fp32 copy the update works on) or
    'bf16' (no copy: the bf16 parameters are updated in place, computing in fp32 on bounded
    chunks). fp32 / fp64 models are their own masters ('bf16' is refused for them)."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold (0 disables)."""
    muon_momentum: float = 0.95
    """name='muon': momentum mu of M <- mu M + g, in [0, 1)."""
    muon_nesterov: bool = True
    """name='muon': orthogonalise g + mu M (Nesterov) instead of M."""
    muon_ns_steps: int = 5
    """name='muon': Newton-Schulz iterations of the quintic (3.4445, -4.7750, 2.0315), >= 1."""
    muon_scale: str = "match_adamw"
    """name='muon': the update's scale for a matrix [A, B]: 'match_adamw' 0.2 sqrt(max(A, B))
    (Moonlight / Kimi: the update RMS of AdamW's, so its lr and weight_decay carry over) or
    'spectral' sqrt(max(1, A / B)) (Keller Jordan's)."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: starting dynamic loss scale."""
    loss_scale_window: int = 1000
    """fp16 only: clean steps before the scale doubles."""
    min_loss_scale: float = 1.0
    """fp16 only: the scale never drops below this."""
    qk_clip_threshold: float = 0.0
    """MuonClip's per-head q/k logit clipping (Kimi K2), tau; 0 disables. With tau > 0 every
    training forward records per attention head h the largest pre-softmax logit S_h =
    max (q_h . k_h) / sqrt(d) over the step's micro-batches, queries and allowed keys (max over
    dp); after each update a head with S_h > tau has its W_q rows (and q bias) multiplied by
    (tau / S_h)^qk_clip_alpha and its key head's W_k rows (and k bias) by (tau / S)^(1 -
    qk_clip_alpha), S the max over the query heads sharing that key head (GQA). Works with
    either optimizer; Kimi K2 used 100. Logged as qk_clipped (heads clipped this step)."""
    qk_clip_alpha: float = 0.5
    """MuonClip's split of the clipping factor gamma = tau / S_h between queries (gamma^alpha)
    and keys (gamma^(1 - alpha)); in [0, 1]."""

    def wsd_decay_steps(self, total_steps: int) -> int:
        """decay='wsd': steps of the final decay, decay_fraction of ``total_steps`` (>= 1)."""
        return max(1, int(self.decay_fraction * total_steps + 0.5))


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The training loop."""

    steps: int = 200
    """Optimizer steps to run."""
    seq_len: int = 128
    """Tokens per sample."""
    micro_batch_size: int = 4
    """Samples in one forward pass on one rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step across all dp ranks; None derives micro * microbatches * dp."""
    microbatches: int | None = None
    """Micro-batches per step per dp rank; None derives global / (micro * dp) (default 1)."""
    precision: str = "fp32"
    """'fp32', 'bf16', 'fp16' (dynamic loss scale) or 'fp64' (exactness tests)."""
    seed: int = 1234
    """Seed of initialisation, dropout and data order."""
    eval_interval: int = 50
    """Steps between evaluations on the validation split (0 disables)."""
    eval_batches: int = 8
    """Micro-batches per evaluation."""
    recompute: str = "none"
    """Activation recomputation: 'none', 'full' or 'selective' (core attention only)."""
    recompute_method: str = "uniform"
    """With full recompute: 'uniform' (blocks of recompute_num_layers) or 'block' (first N)."""
    recompute_num_layers: int = 1
    """Layers per checkpointed block (uniform) or checkpointed layers per chunk (block)."""
    on_nan: str = "stop"
    """On a NaN/Inf loss or gradient: 'stop' with an error or 'skip' the step."""
    label_smoothing: float = 0.0
    """Label smoothing eps in [0, 1): the target is (1 - eps) one-hot + eps / vocab_size
    (PyTorch's cross_entropy label_smoothing); masked labels (-100) stay out of the loss."""
    device: str = "auto"
    """'auto' (cuda when available), 'cpu' or 'cuda'."""
    cpu_threads: int | None = None
    """Intra-op CPU threads of each rank (torch.set_num_threads). None: $OMP_NUM_THREADS when
    set, else the rank's share of the cores the machine's load leaves free, round((cores -
    1-minute load average) / ranks on the node), at least 1 and at most cores / ranks: an idle
    machine gets every core, a busy one fewer threads (OpenMP threads that wait for cores
    other processes hold slow every step down many times). Ranks x threads above the node's
    cores is warned about."""
    tf32: bool = True
    """On CUDA, run fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa
    inputs, fp32 accumulate); MFU of fp32 runs is then against the TF32 peak. False keeps
    IEEE fp32 (the much lower fp32 peak). No effect on CPU or on bf16/fp16/fp64 maths."""
    memory_limit_gb: float | None = None
    """Per-rank memory budget in GiB (None: none). Before any work starts, the memory model's
    estimate for this layout (weights, gradients, optimizer state, activations of the
    in-flight micro-batches) is checked against it, and a run that would exceed it is
    refused naming what would fit (context parallelism, recomputation, a smaller
    micro-batch)."""
    fp8: str = "off"
    """Float8 training of the linear layers (torchao's recipes): 'off', 'tensorwise' (one
    dynamic scale per tensor; activations and weights e4m3, gradients e5m2) or 'rowwise'
    (e4m3 with a power-of-two scale per row of the activation / gradient and per channel of
    the weight). Every GEMM of the column- and row-parallel linears and the routed experts
    (forward and both gradient GEMMs) reads float8 operands and accumulates and outputs in
    the model's dtype; the output head stays in it. Masters, gradients, optimizer states and
    checkpoints never hold float8. Scales are those of the whole (unsplit) tensor: under tp
    each GEMM adds one all-reduce (MAX) of its amaxes. Runs on float8 tensor cores
    (torch._scaled_mm) on CUDA sm89+, refused on older GPUs; emulated (quantise,
    dequantise, matmul) on CPU and for fp64 (the exactness tests). Not with
    parallel.tp_comm_chunks > 1."""
    compile: bool = False
    """torch.compile each transformer layer (TorchInductor, dynamic=False; torchtitan's
    recipe): one graph shared by every layer, fused kernels, the results of eager mode up to
    floating-point reassociation (dropout masks identical). The first step pays the
    compilation (tens of seconds; cached on disk for the next run); needs a C++ compiler;
    not with parallel.schedule='zb_h1' or 'zbv'. Embedding, head, loss, collectives and
    dropout draws stay eager (see colonnade.models.compile)."""
    cuda_graphs: bool = False
    """Capture each transformer layer's forward and backward in CUDA graphs (torch.compile
    mode='reduce-overhead' per layer: TorchInductor's CUDA graph trees, replayed every
    micro-batch), so a small model's step is no longer bound by kernel launches on the host.
    Compiles the layers whether or not training.compile is set. Needs a CUDA device and
    static shapes with no host read inside a layer: refused with training.device='cpu' or no
    GPU, a MoE model (token-dependent shapes), parallel.cp > 1, tp > 1 or pp > 1 (collectives
    and in-flight micro-batches between graphs), dropout > 0 (the eager dropout generator),
    training.recompute other than 'none', and ZeRO-3 (parameters re-gathered into new
    memory). Results equal those of training.compile (see colonnade.models.compile)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Saving and loading."""

    save: str | None = "auto"
    """Directory to save checkpoints into: at checkpoint.interval, at the end, and on Ctrl-C /
    SIGTERM (a re-run of the same command resumes from it). 'auto' (the default):
    <logging.dir>/checkpoints, which `colonnade generate` / `convert --to-hf` find from the
    run's logging.dir. 'none' saves nothing (the trained model is lost at exit: an explicit
    opt-out). A directory literally named auto or none is given as ./auto or ./none."""
    load: str | None = None
    """Colonnade checkpoint (save directory or step_N directory) to resume exactly: weights,
    optimizer, step, data position, LR. A Hugging Face directory or a weights-only checkpoint
    (`colonnade convert --from-hf`) is refused: use init_from for those."""
    init_from: str | None = None
    """Fine-tune (`colonnade train --init-from=PATH`): start a new run from the weights of a
    Colonnade checkpoint (save or step_N directory) or a Hugging Face Llama/GPT-2 directory,
    taking its [model] (metadata / config.json) for every model field not set; a set field
    that changes a tensor's shape is refused, naming it, and the others (max_seq_len under RoPE,
    rope_theta, norm_eps, dropout...) are the run's own,
    and requiring its tokenizer.json to be the data's; step, optimizer, LR schedule and data
    order start fresh. When there is a run to resume (load set, or checkpoint.save holding
    this run's checkpoints: a re-run or a restart), it resumes and this only gives the model
    shape."""
    interval: int = 0
    """Steps between saves (0: only at the end and on Ctrl-C / SIGTERM)."""
    keep_last: int = 3
    """Checkpoints kept; older ones are deleted after a successful save."""
    async_save: bool = False
    """Write in a background thread while training continues: the training thread only copies
    the state into host buffers reserved at start-up (two sets: a save may start while the
    previous one is written; a third waits, logged); on a GPU the copy runs on a side stream
    that the next step waits for on the device. Each save logs the training thread's stall."""
    on_existing: str = "auto"
    """When save already holds checkpoints at start: 'auto' resumes from its latest when they
    are this run's (same [model] and data) and refuses another run's; 'resume' resumes from the
    latest whatever data it saw; 'overwrite' starts fresh and deletes them once its own first
    checkpoint is committed (until then they stay as they were, named in
    <save>/replacing.json, and a restart or re-run never resumes from them); 'refuse' stops.
    A run whose latest checkpoint already reached training.steps exits 0 without training."""
    restart: str = "job"
    """How `colonnade train --nproc N --max-restarts R` recovers from a dead rank: 'job'
    (torch's elastic agent stops every rank and starts them all again, resuming from the
    latest checkpoint); 'in-process' (the survivors keep their process, imported torch and
    built model, leave the broken process groups and rejoin new ones with a replacement for
    the dead rank only, then every rank restores its state by the recovery ladder (memory
    snapshot, partner's copy, disk checkpoint) and goes on; a failure while rejoining falls
    back to a whole-job restart). Both spend one of the R restarts per failure. 'in-process'
    needs a state to restore (checkpoint.memory_interval > 0, or checkpoint.save with
    checkpoint.interval > 0) and one node (--nnodes 1)."""
    lr_schedule: str = "check"
    """On resume, when the LR schedule (training.steps, optim.lr, optim.min_lr,
    optim.warmup_steps, optim.decay and, for wsd, optim.decay_fraction / decay_shape) differs
    from the checkpoint's: 'check' stops with the differences named; 'checkpoint' keeps the
    saved schedule (training.steps then only says when to stop: past the saved horizon the LR
    stays at its end value); 'config' switches to this run's schedule at the resumed step (the
    LR jumps to the new curve, logged)."""
    optimizer_switch: str = "check"
    """On resume, when the checkpoint was written by another optimizer (optim.name; older
    checkpoints count as adamw): 'check' stops naming both; 'reset' loads the weights, the data
    position, the step counter and the LR schedule's place and starts this run's optimizer
    state fresh (logged; Megatron's --no-load-optim, torchtitan's exclude_from_loading =
    ["optimizer"], applied only when the optimizer changes, so a later resume of the new run
    keeps its state)."""
    memory_interval: int = 0
    """Steps between in-memory snapshots (0: off; 1 recommended for long runs with
    --max-restarts). Every N steps each rank copies its shard of the training state (model,
    optimizer, step, data position, RNG, loss scaler) into memory_dir and sends a copy to a
    partner rank (the same local rank on the next node; one node: the next rank), in the
    background during the next step. After a failure the restarted job resumes from the newest
    step held in memory (own copy, else the partner's) and falls back to the disk checkpoint
    only when both copies of a rank's shard are gone. Cost per rank: two copies of its shard
    of the state in host RAM (reported at start and by --dry-run); disk checkpoints go on as
    before."""
    memory_dir: str = "auto"
    """Node-local directory (RAM-backed: tmpfs) holding the memory snapshots. 'auto':
    /dev/shm/colonnade/<hash of checkpoint.save and logging.dir> where /dev/shm exists, else
    the temp directory."""


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """What the run reports."""

    log_interval: int = 10
    """Steps between log lines."""
    dir: str = "runs/latest"
    """Directory for metrics.jsonl, config.toml and TensorBoard events, and (checkpoint.save
    'auto', the default) the run's checkpoints/."""
    tensorboard: bool = False
    """Also write TensorBoard events to logging.dir (install the extra: pip install -e '.[tb]';
    asked for but not installed, rank 0 warns and writes metrics.jsonl only)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU; None uses the GPU table, and where the peak is
    unknown (a CPU, an unlisted GPU) MFU is reported as n/a rather than guessed."""
    wandb_project: str | None = None
    """Weights & Biases project to log every record to (rank 0; needs `pip install wandb` and
    `wandb login`; refused before launch when not installed); None: no W&B."""
    wandb_run_name: str | None = None
    """Name of the W&B run (None: W&B picks one); used only with logging.wandb_project."""
    straggler_interval: int = 0
    """Steps per straggler-detection window (0: off): every rank's step time split into data
    wait, compute, time blocked in collectives and optimizer is gathered every this many steps
    (a multiple of logging.log_interval, so it adds no sync), and a rank whose own work exceeds
    its pipeline-stage peers' median by logging.straggler_threshold while waiting the least is
    named, with the slow part, in the log and in metrics.jsonl ('stragglers')."""
    straggler_threshold: float = 1.2
    """A rank is slow in a window when its own work (data + compute + optimizer) is at least
    this many times its peers' median (1.2: 20% slower) and it waits in collectives no longer
    than they do."""
    straggler_windows: int = 3
    """Consecutive slow windows before a rank is named (and again every this many while it
    stays slow)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole resolved configuration of a run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Training loop."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Logging."""


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}
