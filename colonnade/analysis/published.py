"""Published figures the planner is checked against (see shared/anchors/published.md).

Narayanan et al. 2021 (arXiv 2104.04473) Table 1: GPT models, V = 51,200, s = 2048, DGX A100
(80 GB), interleaved schedule with scatter/gather, full recomputation, dp = GPUs / (tp pp).
The 2021 Megatron-LM it measured materialised the attention scores (eager attention), did not
overlap the data-parallel reduction with backward, and sent pipeline tensors synchronously; the
workload below says so, so those rows are predicted for the system that produced them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from colonnade.analysis.layout import Layout, Workload
from colonnade.config.sections import ModelConfig


@dataclass(frozen=True)
class Table1Row:
    """One row of Narayanan et al. 2021 Table 1."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float
    peak_pct: int
    aggregate_pflops: float

    @property
    def dp(self) -> int:
        """Data-parallel degree GPUs / (tp pp)."""
        return self.gpus // (self.tp * self.pp)

    def model(self) -> ModelConfig:
        """The GPT model of this row (tied head, biases, dropout 0.1, V = 51,200)."""
        return ModelConfig(arch="gpt2", num_layers=self.layers, hidden_size=self.hidden,
                           num_heads=self.heads, vocab_size=51200, max_seq_len=2048,
                           tie_embeddings=True, bias=True, hidden_dropout=0.1,
                           attention_dropout=0.1)

    def workload(self) -> Workload:
        """The row's workload as Megatron-LM 2021 ran it."""
        return Workload(model=self.model(), seq_len=2048, global_batch=self.batch,
                        precision="bf16", attention="eager", overlap_grad_reduce=False,
                        overlap_param_gather=False, overlap_p2p=False)

    def fixed(self) -> dict[str, object]:
        """The published layout's fixed choices (micro-batch and vp are not published)."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "recompute": ["full"],
                "sp": [False], "zero": [0], "schedules": ["1f1b", "interleaved_1f1b"]}

    def layout(self, micro_batch: int, vp: int) -> Layout:
        """The published layout with a chosen micro-batch and chunk count."""
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp, vp=vp, micro_batch=micro_batch,
                      recompute="full", sp=False, zero=0,
                      schedule="interleaved_1f1b" if vp > 1 else "1f1b")


TABLE1: tuple[Table1Row, ...] = (
    Table1Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    Table1Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    Table1Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    Table1Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    Table1Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    Table1Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    Table1Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    Table1Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    Table1Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    Table1Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
)

# ZeRO (Rajbhandari et al., arXiv 1910.02054), 7.5B parameters, Nd = 64, GB = 1e9 bytes.
ZERO_EXAMPLE = {"params": 7.5e9, "dp": 64, "gb": {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}}


# MosaicML llm-foundry, "MPT Training Benchmarks", table "H100 80GB BF16"
# (https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md):
# MPT models (GPT-style: learned positions, GeLU MLP 4h, LayerNorm, no biases, tied head,
# V = 50,368, head dim 128) on DGX H100 nodes in amp_bf16 with FSDP FULL_SHARD (modelled as
# ZeRO-1 data parallelism: the same reduce-scatter + all-gather bytes, all dp) and fused
# attention and flash-attn's fused cross entropy (MPT's loss_fn default). The figure compared
# is tokens per second per GPU, what the table measures.
MPT_SHAPES: dict[str, tuple[int, int]] = {
    "760m": (1536, 24), "1b": (2048, 24), "3b": (2560, 32), "7b": (4096, 32),
    "13b": (5120, 40), "30b": (7168, 48), "70b": (8192, 80),
}
"""MPT model name -> (d_model, layers) of llm-foundry's yamls/pretrain/mpt-*.yaml."""


@dataclass(frozen=True)
class MPTRow:
    """One measured training throughput of an MPT model in amp_bf16 (llm-foundry's tables: the
    H100 80GB BF16 one and the A100 80GB one)."""

    model: str
    seq_len: int
    gpus: int
    micro_batch: int
    batch: int
    checkpointing: bool
    tokens_per_s_per_gpu: float

    def workload(self) -> Workload:
        """The row's model and batch (fused attention, overlapped reductions)."""
        hidden, layers = MPT_SHAPES[self.model]
        model = ModelConfig(arch="gpt2", num_layers=layers, hidden_size=hidden,
                            num_heads=hidden // 128, vocab_size=50368,
                            max_seq_len=self.seq_len, tie_embeddings=True, bias=False)
        return Workload(model=model, seq_len=self.seq_len, global_batch=self.batch,
                        fsdp_fp32_states=True, fused_loss=True)

    def layout(self) -> Layout:
        """All data parallel, sharded optimizer, full recompute with activation checkpointing
        (timed: FULL_SHARD as ZeRO-1, the same bytes; memory: :meth:`memory_layout`)."""
        return Layout(dp=self.gpus, micro_batch=self.micro_batch, zero=1,
                      recompute="full" if self.checkpointing else "none")

    def memory_layout(self) -> Layout:
        """The layout as run, for its memory: FSDP FULL_SHARD is ZeRO-3."""
        return dataclasses.replace(self.layout(), zero=3)

    def label(self) -> str:
        """Short name: model, sequence, GPUs, checkpointing."""
        return (f"MPT-{self.model} s{self.seq_len} {self.gpus}gpu"
                f"{' AC' if self.checkpointing else ''}")


MPT_H100_FIT: tuple[MPTRow, ...] = (
    MPTRow("760m", 2048, 8, 24, 384, False, 63147),
    MPTRow("1b", 2048, 8, 14, 112, False, 45455),
    MPTRow("7b", 2048, 8, 6, 48, False, 10643),
    MPTRow("13b", 2048, 8, 2, 16, False, 4792),
)
"""The rows the H100 GEMM curve is fitted on: s = 2048 on one node, no checkpointing."""

HELD_OUT_H100: tuple[MPTRow, ...] = (
    MPTRow("760m", 2048, 16, 24, 384, False, 68551),
    MPTRow("3b", 2048, 16, 10, 480, False, 24142),
    MPTRow("30b", 2048, 8, 3, 504, True, 2002),
    MPTRow("70b", 2048, 64, 8, 2048, True, 1039),
    MPTRow("1b", 8192, 8, 3, 96, False, 29157),
    MPTRow("3b", 4096, 8, 5, 240, False, 20964),
    MPTRow("3b", 8192, 8, 3, 144, False, 16578),
    MPTRow("7b", 4096, 8, 16, 256, True, 8611),
    MPTRow("13b", 4096, 8, 10, 240, True, 4717),
)
"""Rows of the same table that no fit uses: other sizes (3b, 30b, 70b), two nodes and more,
longer sequences, activation checkpointing. benchmarks/planner.py reports their errors."""

# The same README (commit 061f2c7ce64e655100286584a7629e2a09f827ba), table "A100 80GB with 1600
# Gbps node-node interconnect (RoCE)": its amp_bf16 rows on one node (the 70b rows run PURE bf16
# weights, another system). (model, s, GPUs, micro-batch, global batch, checkpointing,
# Throughput (T/s/GPU)) exactly as printed.
MPT_A100: tuple[MPTRow, ...] = (
    MPTRow("760m", 2048, 8, 24, 384, False, 32434),
    MPTRow("1b", 2048, 8, 14, 448, False, 20513),
    MPTRow("3b", 2048, 8, 10, 160, False, 10811),
    MPTRow("7b", 2048, 8, 6, 96, False, 4641),
    MPTRow("13b", 2048, 8, 2, 48, False, 2262),
    MPTRow("30b", 2048, 8, 3, 504, True, 916),
    MPTRow("1b", 8192, 8, 3, 96, False, 13814),
    MPTRow("3b", 8192, 8, 3, 144, False, 7695),
    MPTRow("7b", 8192, 8, 8, 128, True, 3206),
    MPTRow("13b", 4096, 8, 10, 240, True, 2060),
)
"""llm-foundry's A100 80GB rows: a second A100 source besides Narayanan et al. Table 1, held
out from every fit (benchmarks/planner.py, tests/analysis/test_holdout.py)."""


def narayanan_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
                    recompute: bool = True) -> float:
    """Narayanan et al. 2021 eq. (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full
    recompute, else 72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    b, s, l, h, v = float(batch), float(seq_len), float(layers), float(hidden), float(vocab)
    if recompute:
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def narayanan_params(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. 2021: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))."""
    l, h = float(layers), float(hidden)
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))
