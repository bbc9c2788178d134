"""Throughput arithmetic and the metrics writers (JSONL, TensorBoard, console, progress bar)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from colonnade.config.sections import ModelConfig


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of the model: embedding, per-layer total, head (0 when tied)."""
    h, f, d = cfg.hidden_size, cfg.ffn_size, cfg.head_dim
    attn = h * (cfg.num_heads * d) * 2 + h * (cfg.kv_heads * d) * 2
    mlp = (3 if cfg.arch == "llama" else 2) * h * f
    norms = (2 if cfg.arch == "llama" else 4) * h
    biases = 0
    if cfg.bias:
        biases = (cfg.num_heads + 2 * cfg.kv_heads) * d + h + (f * (2 if cfg.arch == "llama"
                                                                     else 1)) + h
    layer = attn + mlp + norms + biases
    emb = cfg.vocab_size * h + (cfg.max_seq_len * h if cfg.arch == "gpt2" else 0)
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    final = h if cfg.arch == "llama" else 2 * h
    return {"embedding": emb, "layers": layer * cfg.num_layers, "head": head + final,
            "total": emb + layer * cfg.num_layers + head + final}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward = 3x forward, no recompute counted).

    Forward: 2 x (matmul params per layer x layers + head V h) + attention 2 x 2 s h per layer
    (q k^T and p v, causal mask not discounted) -> x3 for backward.
    """
    h, f, d = cfg.hidden_size, cfg.ffn_size, cfg.head_dim
    attn_params = h * cfg.num_heads * d * 2 + h * cfg.kv_heads * d * 2
    mlp_params = (3 if cfg.arch == "llama" else 2) * h * f
    per_layer = 2 * (attn_params + mlp_params) + 4 * seq_len * h
    return 3.0 * (cfg.num_layers * per_layer + 2 * cfg.vocab_size * h)


class MetricsWriter:
    """Appends one JSON object per log step to metrics.jsonl; TensorBoard too when available.

    A run that starts at ``start_step`` (a resume; 0 for a fresh start) continues the file
    without duplicates: records of later steps, left by the run it resumes (or by an earlier run
    in the same directory), are moved to metrics.dropped.jsonl (:attr:`dropped` counts them).
    """

    def __init__(self, directory: str | Path, tensorboard: bool, start_step: int = 0) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.dropped = self._truncate_after(start_step)
        self.fh = self.path.open("a")
        self.tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.dir))
            except Exception:  # tensorboard not installed: JSONL only
                self.tb = None

    def _truncate_after(self, start_step: int) -> int:
        """Keep the records of steps <= ``start_step``; move the rest aside; return how many."""
        if not self.path.exists():
            return 0
        keep, drop = [], []
        for line in self.path.read_text().splitlines():
            try:
                step = int(json.loads(line).get("step", 0))
            except (ValueError, AttributeError, TypeError):
                step = start_step + 1  # unreadable: not part of this run's history
            (keep if step <= start_step else drop).append(line)
        if drop:
            with (self.dir / "metrics.dropped.jsonl").open("a") as fh:
                fh.write("".join(f"{line}\n" for line in drop))
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(f"{line}\n" for line in keep))
            os.replace(tmp, self.path)
        return len(drop)

    def write(self, record: dict[str, Any]) -> None:
        """Append a record (and scalars to TensorBoard)."""
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                    self.tb.add_scalar(key, value, record.get("step", 0))

    def close(self) -> None:
        """Flush and close."""
        self.fh.close()
        if self.tb is not None:
            self.tb.close()


def format_line(rec: dict[str, Any]) -> str:
    """One readable console line for a log record."""
    parts = [f"step {rec['step']:>5}", f"loss {rec['loss']:.4f}"]
    if "valid_loss" in rec:
        parts.append(f"valid {rec['valid_loss']:.4f}")
    parts += [f"lr {rec['lr']:.2e}", f"gnorm {rec['grad_norm']:.3f}",
              f"{rec['tokens_per_s']:,.0f} tok/s", f"{rec['tflops_per_device']:.3f} TFLOP/s/dev",
              f"MFU {100 * rec['mfu']:.1f}%"]
    if "mem_peak_gib" in rec:
        parts.append(f"mem {rec['mem_peak_gib']:.2f} GiB")
    return " | ".join(parts)
