"""Published training runs beyond Narayanan et al. Table 1, each with its citation, as data.

The planner's efficiency constants are fitted on one part of the public record (the A100's on
Narayanan et al. 2021 Table 1, the H100's on four rows of llm-foundry's H100 table:
:mod:`colonnade.analysis.fit`); the runs here are the rest, the held-out check
(:mod:`colonnade.analysis.holdout`, ``benchmarks/planner.py``).  A run is what its source
says was run: model, sequence, GPUs, layout, batch, recomputation; where a choice is not
published the docstring of its source says what is assumed (micro-batch 1 for pipelines).
Two figures are compared where published: tokens per second per GPU, and the measured peak
memory per GPU (every run here trained, so its memory must fit: tests/analysis/
test_published_memory.py).

Sources (exact tables and rows; numbers copied as printed):

* ``korthikanti2022``: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models" (arXiv 2205.05198), Table 3 (model configurations): GPT models of 22B,
  175B, 530B and 1T parameters (heads / hidden / layers 64 / 6144 / 48, 96 / 12288 / 96,
  128 / 20480 / 105, 160 / 25600 / 128), tp 8 and pp 1 / 8 / 35 / 64 on 8 / 64 / 280 / 512
  A100 80GB GPUs, global batch 4 / 64 / 280 / 512, s = 2048, V = 51,200, with sequence
  parallelism and selective recomputation (the paper's "present work").  Megatron-LM keeps
  each column-parallel input as its sequence shard and gathers it again in backward (Sec.
  4.2.2): ``Workload.sp_regather``.  Micro-batch 1 (not in the table).  Memory only: its
  throughput tables are not used here.
* ``torchtitan_a100``: pytorch/torchtitan docs/performance.md at commit 0413364349 ("Llama 3
  performance numbers", "Llama 2 performance numbers"): FSDP2 on 64 A100 80GB, WPS per GPU;
  Llama 3 70B local batch 1, full checkpointing, 331 WPS; Llama 2 70B local batch 2, full,
  353 WPS; Llama 2 13B local batch 2, no checkpointing, 2162 WPS.  Sequence 8192 for Llama 3
  and 4096 for Llama 2 (the page: Llama 2's 4096 "is halved compared with Llama 3").
* ``torchtitan_h100``: the same file at commit eaea6f6a2f, on Grand Teton hosts: 8 H100 per
  host with 96 GB of HBM2e at 2.4 TB/s, 400 Gb/s RDMA per GPU, 500 W power limit (the page:
  peak between SXM's and NVL's, not known exactly; the H100 SXM peak is used, as the page does
  for MFU).  Llama 3.1 8B (s = 8192, torchtitan's llama3_8b.toml default), FSDP, local batch
  2, selective checkpointing (modelled as colonnade's selective recompute), eager: Table 1
  (8 GPUs) 5,762 TPS/GPU and 82.4 GiB, Table 3 (128 GPUs) 5,605 and 67.0 GiB.  Memory only
  (Float8 and torch.compile runs): Table 4, Llama 3.1 70B, FSDP 32 x TP 8, local batch 16,
  full checkpointing, 71.9 GiB; Table 5, Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, local batch
  32, full checkpointing, 1F1B 82.5 GiB (micro-batch 1 assumed).
* ``colonnade_h200``: this library's own run on one H200 (benchmarks/results/
  gpu_check_h200.json, stage train_1p3b): GPT-3 1.3B, bf16, micro-batch 4 x 2 micro-batches,
  s = 2048, dropout off, 46,865 tokens/s and a peak of 38.80 GiB
  (``torch.cuda.max_memory_allocated``).

FSDP FULL_SHARD runs are timed as ZeRO-1 data parallelism (the same reduce-scatter and
all-gather bytes per step; :class:`~colonnade.analysis.published.MPTRow` does the same) and
their memory is taken at ZeRO-3, as they ran.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from colonnade.analysis.hardware import PRESETS, Cluster
from colonnade.analysis.layout import Layout, Workload
from colonnade.config.sections import ModelConfig

GRAND_TETON_H100 = dataclasses.replace(
    PRESETS["h100-sxm"], name="h100-96gb-grand-teton",
    device="NVIDIA H100 96GB HBM2e, 500 W (Grand Teton)", memory_gib=96e9 / 2**30,
    hbm_gbps=2400.0, inter_node_gbps=400.0)
"""The H100 variant of torchtitan's H100 tables (96 GB HBM2e at 2.4 TB/s, 50 GB/s per GPU of
RDMA = 400 GB/s a host); the H100 SXM's compute constants."""


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One published training run: what ran, where, and what was measured."""

    source: str
    """Key of the source in this module's docstring."""
    label: str
    """Short name of the row."""
    cluster: Cluster
    """The devices it ran on."""
    workload: Workload
    """Model, sequence, global batch and the system's choices (attention kernel, sp_regather)."""
    layout: Layout
    """The layout as run (FSDP FULL_SHARD: ZeRO-3)."""
    fsdp: bool = False
    """FSDP FULL_SHARD: timed as ZeRO-1 (see the module docstring)."""
    tokens_per_s_per_gpu: float | None = None
    """Published tokens per second per GPU, or None."""
    memory_gib: float | None = None
    """Published peak memory per GPU in GiB, or None."""

    @property
    def timed_layout(self) -> Layout:
        """The layout whose step time is compared (FSDP: ZeRO-1)."""
        return dataclasses.replace(self.layout, zero=1) if self.fsdp else self.layout


def gpt(layers: int, hidden: int, heads: int, dropout: bool = True) -> ModelConfig:
    """The GPT of Megatron's papers: V = 51,200, s = 2048, tied head, biases, dropout 0.1."""
    p = 0.1 if dropout else 0.0
    return ModelConfig(arch="gpt2", num_layers=layers, hidden_size=hidden, num_heads=heads,
                       vocab_size=51200, max_seq_len=2048, tie_embeddings=True, bias=True,
                       hidden_dropout=p, attention_dropout=p)


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
          seq: int) -> ModelConfig:
    """A Llama 2 / 3 model (RMSNorm, SwiGLU, RoPE, untied head) of context ``seq``."""
    return ModelConfig(arch="llama", num_layers=layers, hidden_size=hidden, num_heads=heads,
                       num_kv_heads=kv_heads, ffn_hidden_size=ffn, vocab_size=vocab,
                       max_seq_len=seq)


def _korthikanti() -> tuple[PublishedRun, ...]:
    a100 = PRESETS["a100-80gb"]
    rows = (("22B", 64, 6144, 48, 1, 8, 4), ("175B", 96, 12288, 96, 8, 64, 64),
            ("530B", 128, 20480, 105, 35, 280, 280), ("1T", 160, 25600, 128, 64, 512, 512))
    out = []
    for label, a, h, layers, pp, gpus, batch in rows:
        w = Workload(model=gpt(layers, h, a), seq_len=2048, global_batch=batch,
                     attention="eager", sp_regather=True, overlap_grad_reduce=False,
                     overlap_param_gather=False, overlap_p2p=False)
        lay = Layout(tp=8, pp=pp, dp=gpus // (8 * pp), micro_batch=1, recompute="selective",
                     sp=True)
        out.append(PublishedRun(source="korthikanti2022", label=f"GPT {label}", cluster=a100,
                                workload=w, layout=lay))
    return tuple(out)


def _torchtitan() -> tuple[PublishedRun, ...]:
    a100, h100 = PRESETS["a100-80gb"], GRAND_TETON_H100
    l3_70 = llama(80, 8192, 64, 8, 28672, 128256, 8192)  # Llama 3 and 3.1 70B
    l2_70 = llama(80, 8192, 64, 8, 28672, 32000, 4096)
    l2_13 = llama(40, 5120, 40, 40, 13824, 32000, 4096)
    l31_8 = llama(32, 4096, 32, 8, 14336, 128256, 8192)
    l31_405 = llama(126, 16384, 128, 8, 53248, 128256, 8192)

    def run(src: str, label: str, c: Cluster, m: ModelConfig, gpus: int, mb: int, rc: str,
            tps: float | None = None, gib: float | None = None, tp: int = 1,
            pp: int = 1) -> PublishedRun:
        dp = gpus // (tp * pp)  # the 405B run: local batch 32 in micro-batches of mb
        w = Workload(model=m, seq_len=m.max_seq_len, global_batch=(mb if pp == 1 else 32) * dp,
                     fsdp_fp32_states=True)
        lay = Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, recompute=rc, zero=3, sp=tp > 1)
        return PublishedRun(source=src, label=label, cluster=c, workload=w, layout=lay,
                            fsdp=pp == 1 and tp == 1, tokens_per_s_per_gpu=tps, memory_gib=gib)

    return (
        run("torchtitan_a100", "Llama 3 70B 64gpu full", a100, l3_70, 64, 1, "full", 331),
        run("torchtitan_a100", "Llama 2 70B 64gpu full", a100, l2_70, 64, 2, "full", 353),
        run("torchtitan_a100", "Llama 2 13B 64gpu", a100, l2_13, 64, 2, "none", 2162),
        run("torchtitan_h100", "Llama 3.1 8B 8gpu sel", h100, l31_8, 8, 2, "selective",
            5762, 82.4),
        run("torchtitan_h100", "Llama 3.1 8B 128gpu sel", h100, l31_8, 128, 2, "selective",
            5605, 67.0),
        run("torchtitan_h100", "Llama 3.1 70B tp8 full", h100, l3_70, 256, 16, "full",
            gib=71.9, tp=8),
        run("torchtitan_h100", "Llama 3.1 405B tp8 pp8 full", h100, l31_405, 512, 1, "full",
            gib=82.5, tp=8, pp=8),
    )


def _colonnade_h200() -> tuple[PublishedRun, ...]:
    w = Workload(model=dataclasses.replace(gpt(24, 2048, 16, dropout=False), vocab_size=50257),
                 seq_len=2048, global_batch=8)
    return (PublishedRun(source="colonnade_h200", label="GPT-3 1.3B 1gpu", cluster=PRESETS["h200"],
                         workload=w, layout=Layout(micro_batch=4), tokens_per_s_per_gpu=46865,
                         memory_gib=38.80),)


KORTHIKANTI_2022 = _korthikanti()
TORCHTITAN = _torchtitan()
COLONNADE_H200 = _colonnade_h200()
PUBLISHED_RUNS: tuple[PublishedRun, ...] = KORTHIKANTI_2022 + TORCHTITAN + COLONNADE_H200
"""Every run of this module (none is fitted on)."""
