"""The metrics writers (JSONL, TensorBoard, W&B, console) and the run clock.

Parameter and FLOP counts (``tflops_per_device``, ``mfu``) come from
:mod:`colonnade.models.counts`, the one counter.

A log record (one line of ``metrics.jsonl``) holds ``step``, ``loss``, ``lr``, ``grad_norm``,
``step_time_s``, ``tokens_per_s``, ``tflops_per_device``, ``tokens`` (consumed since step 0),
``elapsed_s`` (wall time of the training loop over the whole run: a resume continues from the
time its checkpoint recorded), ``eta_s`` (to ``training.steps`` at this segment's mean step
time), memory, ``mfu`` only against a known peak (``logging.peak_tflops`` or the GPU table; a
shared CPU has no meaningful peak), ``valid_loss`` / ``valid_ppl`` (perplexity, exp of the
validation loss) when evaluated, and ``attempt``: which start of training into this logging.dir
wrote it (0 the first; every re-run, resume or restart counts one more), so the records a resume
moves to metrics.dropped.jsonl still say which attempt they came from. The validation loss
before the first step is a record of its own (step 0, no ``loss``). With straggler detection
(``logging.straggler_interval``), a record at the end of a window in which ranks are named holds
``stragglers``: a list of {rank, node, part, ratio, windows}
(:mod:`colonnade.reliability.straggler`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from colonnade.config.sections import LoggingConfig

TB_MISSING = ("logging.tensorboard=true but the tensorboard package is not installed; writing "
              "metrics.jsonl only (install it with `pip install -e '.[tb]'`, or set "
              "--logging.tensorboard=false)")


def logging_problems(log: LoggingConfig) -> list[str]:
    """What in ``log`` cannot work on this machine (checked before launch): W&B asked for but
    not installed."""
    if log.wandb_project and importlib.util.find_spec("wandb") is None:
        return [f"logging.wandb_project={log.wandb_project!r} but the wandb package is not "
                "installed; install it (`pip install wandb`, then `wandb login`) or leave "
                "logging.wandb_project unset"]
    return []


def perplexity(loss: float) -> float:
    """exp(loss), inf where it overflows."""
    return math.exp(loss) if loss < 700 else math.inf


class RunClock:
    """Elapsed time, ETA and tokens consumed of a run that starts (or resumes) at ``start_step``
    after ``elapsed_before_s`` seconds of training in its earlier segments (what the resumed
    checkpoint recorded; 0 for a fresh start)."""

    def __init__(self, start_step: int, total_steps: int, tokens_per_step: int,
                 elapsed_before_s: float = 0.0) -> None:
        self.start_step, self.total_steps = start_step, total_steps
        self.tokens_per_step = tokens_per_step
        self.elapsed_before_s = elapsed_before_s
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds of training of the whole run: the earlier segments' and this one's."""
        return self.elapsed_before_s + time.perf_counter() - self.t0

    def fields(self, step: int) -> dict[str, float]:
        """``tokens``, ``elapsed_s`` (the whole run's) and, once this segment has done a step
        (JSON has no NaN), ``eta_s`` at this segment's mean step time."""
        segment = time.perf_counter() - self.t0
        done = step - self.start_step
        out = {"tokens": step * self.tokens_per_step, "elapsed_s": self.elapsed_before_s + segment}
        if done > 0:
            out["eta_s"] = segment / done * max(0, self.total_steps - step)
        return out


def format_duration(seconds: float) -> str:
    """'12m05s' (under an hour) or '3h07m'; '?' when not finite."""
    if not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


class MetricsWriter:
    """Appends one JSON object per log step to metrics.jsonl; TensorBoard and W&B when asked.

    TensorBoard asked for (``tensorboard``) but not installed: one warning on stderr, JSONL
    only. ``wandb_project``: ``wandb`` is imported and a run started (its absence is refused
    before launch by :func:`logging_problems`); every numeric field is logged at its step.

    A run that starts at ``start_step`` (a resume; 0 for a fresh start) continues the file
    without duplicates: records of later steps, left by the run it resumes (or by an earlier run
    in the same directory), are moved to metrics.dropped.jsonl (:attr:`dropped` counts them),
    each with the ``attempt`` that wrote it. :attr:`kept` holds the records it continues (the
    earlier segments' history), :attr:`attempt` the number this writer stamps on its records:
    one more than any record of either file holds (a record without one counts as 0), or 0
    when there is none.
    """

    def __init__(self, directory: str | Path, tensorboard: bool, start_step: int = 0, *,
                 wandb_project: str | None = None, wandb_run_name: str | None = None,
                 run_config: dict[str, Any] | None = None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.attempt = _next_attempt(self.path, self.dir / "metrics.dropped.jsonl")
        self.kept: list[dict[str, Any]] = []
        self.dropped = self._truncate_after(start_step)
        self.fh = self.path.open("a")
        self.tb: Any = None
        self.wandb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print(f"colonnade: warning: {TB_MISSING}", file=sys.stderr, flush=True)
            else:
                self.tb = SummaryWriter(str(self.dir))
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=wandb_run_name,
                                    config=run_config, dir=str(self.dir), resume="allow")

    def _truncate_after(self, start_step: int) -> int:
        """Keep the records of steps <= ``start_step`` (a resume; a fresh start keeps none, as
        it writes its own step-0 record); move the rest aside; return how many."""
        if not self.path.exists():
            return 0
        last_kept = start_step if start_step > 0 else -1
        keep, drop = [], []
        for line in self.path.read_text().splitlines():
            record = _record(line)
            step = int(record.get("step", 0)) if record is not None else start_step + 1
            (keep if step <= last_kept else drop).append(line)  # unreadable: not this run's
            if record is not None and step <= last_kept:
                self.kept.append(record)
        if drop:
            with (self.dir / "metrics.dropped.jsonl").open("a") as fh:
                fh.write("".join(f"{line}\n" for line in drop))
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(f"{line}\n" for line in keep))
            os.replace(tmp, self.path)
        return len(drop)

    def write(self, record: dict[str, Any]) -> None:
        """Append a record stamped with :attr:`attempt` (and its finite scalars to TensorBoard /
        W&B)."""
        self.fh.write(json.dumps({**record, "attempt": self.attempt}) + "\n")
        self.fh.flush()
        step = int(record.get("step", 0))
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float))
                   and k not in ("step", "attempt") and math.isfinite(v)}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close."""
        self.fh.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _record(line: str) -> dict[str, Any] | None:
    """One JSONL line as a record, or None when it is not a JSON object with an integer step."""
    try:
        record = json.loads(line)
        int(record.get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return None
    return record if isinstance(record, dict) else None


def _next_attempt(*paths: Path) -> int:
    """One more than the largest ``attempt`` of the records in ``paths`` (a record without one:
    0); 0 when they hold no record."""
    last = -1
    for path in paths:
        for line in path.read_text().splitlines() if path.exists() else []:
            attempt = (_record(line) or {}).get("attempt", 0) if line.strip() else -1
            last = max(last, attempt if isinstance(attempt, int) else 0)
    return last + 1


def format_line(rec: dict[str, Any]) -> str:
    """One readable console line for a log record (a validation-only record too)."""
    parts = [f"step {rec['step']:>5}"]
    if "loss" in rec:
        parts.append(f"loss {rec['loss']:.4f}")
    if "valid_loss" in rec:
        parts.append(f"valid {rec['valid_loss']:.4f} (ppl {rec['valid_ppl']:.4g})")
    if "lr" in rec:
        mfu = f"MFU {100 * rec['mfu']:.1f}%" if "mfu" in rec else "MFU n/a"
        parts += [f"lr {rec['lr']:.2e}", f"gnorm {rec['grad_norm']:.3f}",
                  f"{rec['tokens_per_s']:,.0f} tok/s",
                  f"{rec['tflops_per_device']:.3f} TFLOP/s/dev", mfu]
    if "qk_clipped" in rec:
        parts.append(f"qk_clipped {rec['qk_clipped']:.0f}")
    if "compile_s" in rec:
        parts.append(f"compiled in {rec['compile_s']:.1f} s")
    parts += format_moe(rec)
    if "mem_peak_gib" in rec:
        parts.append(f"mem {rec['mem_peak_gib']:.2f} GiB")
    if "tokens" in rec:
        parts += [f"{_count(rec['tokens'])} tok",
                  f"elapsed {format_duration(rec['elapsed_s'])}"]
        if "eta_s" in rec:
            parts.append(f"ETA {format_duration(rec['eta_s'])}")
    return " | ".join(parts)


def format_moe(rec: dict[str, Any]) -> list[str]:
    """Compact console parts: worst max/mean load, dropped %, aux, and the per-expert load
    (% of slots) of the most imbalanced layer."""
    if "moe_load" not in rec:
        return []
    parts = [f"moe max/mean {rec['moe_load_max_mean']:.2f}",
             f"drop {100 * rec['moe_dropped_frac']:.1f}%",
             f"aux {rec['moe_aux_loss']:.4f}"]
    if rec.get("moe_z_loss"):
        parts.append(f"z {rec['moe_z_loss']:.2e}")
    loads: dict[str, list[int]] = rec["moe_load"]
    if loads:
        layer = max(loads, key=lambda k: rec.get(f"moe/{k}/load_max_mean", 0.0))
        total = max(sum(loads[layer]), 1)
        shares = "/".join(f"{100 * v / total:.0f}" for v in loads[layer])
        parts.append(f"load L{layer} {shares}%")
    return parts
