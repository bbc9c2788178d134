"""Outputs of a plan: a table (rich when installed, plain text otherwise), JSON and a PNG plot."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from colonnade.analysis.estimate import Estimate
from colonnade.analysis.hardware import GIB
from colonnade.analysis.moe import moe_param_counts
from colonnade.analysis.search import Plan

COLUMNS = ("#", "tp", "cp", "pp", "vp", "dp", "mb", "m", "schedule", "recompute", "sp", "zero",
           "mem GiB", "step s", "tokens/s", "TFLOP/s", "MFU", "bubble", "comm")


def row_cells(rank: int, e: Estimate, global_batch: int) -> list[str]:
    """The table cells of one estimate."""
    lay, t = e.layout, e.timing
    comm = (t.tp_comm + t.cp_comm + t.ep_comm + t.p2p + t.dp_comm) / t.total
    kinds = {"all_to_all": "a2a", "hierarchical": f"a2a{lay.cp_a2a_size}"}
    cp = f"{lay.cp}{kinds.get(lay.cp_attention, '')}" if lay.cp > 1 else "1"
    return [
        str(rank), str(lay.tp), cp, str(lay.pp), str(lay.vp),
        str(lay.dp) + (f"/ep{lay.ep}" if lay.ep > 1 else "")
        + (f"/etp{lay.expert_tp}" if lay.expert_tp > 1 else ""), str(lay.micro_batch),
        str(lay.microbatches(global_batch)), lay.schedule if lay.pp > 1 else "-",
        lay.recompute, "y" if lay.sp else "-", lay.zero_label(),
        f"{e.memory.total / GIB:.1f}", f"{e.step_s:.3g}", f"{e.tokens_per_s:,.0f}",
        f"{e.tflops_per_device:.3g}", f"{e.mfu:.1%}", f"{t.bubble / t.total:.1%}",
        f"{comm:.1%}",
    ]


def header(p: Plan) -> str:
    """One paragraph naming the workload, the cluster and the search."""
    w, c = p.workload, p.cluster
    m = w.model
    return (f"{m.arch} l={m.num_layers} h={m.hidden_size} a={m.num_heads} kv={m.kv_heads} "
            f"V={m.vocab} ({moe_param_counts(w.model)['total'] / 1e9:.2f}B params), "
            f"seq {w.seq_len}, "
            f"global batch {w.global_batch}, {w.precision}, attention={w.attention}\n"
            f"{p.gpus} x {c.device} ({c.memory_gib:g} GiB, {c.peak_tflops:g} TFLOP/s peak, "
            f"efficiency {c.efficiency:g}"
            + (f", GEMM knee {c.gemm_knee:.0f} FLOP/B" if c.gemm_knee > 0 else "")
            + f"); {p.candidates} layouts, {len(p.ranked)} fit")


def format_table(p: Plan, top: int) -> str:
    """Plain-text table of the ``top`` ranked layouts."""
    rows = [list(COLUMNS)] + [row_cells(i + 1, e, p.workload.global_batch)
                              for i, e in enumerate(p.ranked[:top])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [header(p)]
    for j, r in enumerate(rows):
        lines.append("  ".join(cell.rjust(widths[i]) for i, cell in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    return "\n".join(lines)


def print_table(p: Plan, top: int) -> None:
    """Print the ranking with rich when it is installed, as plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(p, top))
        return
    table = Table(title="colonnade plan", caption=header(p))
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for i, e in enumerate(p.ranked[:top]):
        table.add_row(*row_cells(i + 1, e, p.workload.global_batch))
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(table)


def plan_to_json(p: Plan, top: int) -> dict[str, Any]:
    """Everything about the plan as plain data."""
    w = p.workload
    return {
        "workload": {"model": dataclasses.asdict(w.model), "seq_len": w.seq_len,
                     "global_batch": w.global_batch, "precision": w.precision,
                     "attention": w.attention, "overlap_grad_reduce": w.overlap_grad_reduce,
                     "overlap_param_gather": w.overlap_param_gather,
                     "overlap_p2p": w.overlap_p2p, "params": moe_param_counts(w.model)['total']},
        "cluster": dataclasses.asdict(p.cluster),
        "gpus": p.gpus,
        "candidates": p.candidates,
        "fitting": len(p.ranked),
        "ranked": [e.as_dict() for e in p.ranked[:top]],
        "smallest_memory": p.smallest.as_dict() if p.smallest else None,
    }


def write_json(p: Plan, top: int, path: str | Path) -> None:
    """Write :func:`plan_to_json` to ``path``."""
    Path(path).write_text(json.dumps(plan_to_json(p, top), indent=2) + "\n")


def write_plot(p: Plan, top: int, path: str | Path) -> None:
    """PNG: left, throughput vs memory of every fitting layout (top ones numbered); right,
    the memory breakdown of the top layouts with their throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    colours = {"none": "tab:blue", "selective": "tab:orange", "full": "tab:green"}
    for rc, col in colours.items():
        pts = [e for e in p.ranked if e.layout.recompute == rc]
        ax1.scatter([e.memory.total / GIB for e in pts], [e.tokens_per_s for e in pts], s=8,
                    c=col, alpha=0.5, label=f"recompute={rc}")
    for i, e in enumerate(p.ranked[:top]):
        ax1.annotate(str(i + 1), (e.memory.total / GIB, e.tokens_per_s), fontsize=8)
    usable = p.cluster.memory_bytes / GIB
    most = max((e.memory.total / GIB for e in p.ranked), default=usable)
    if most > 0.2 * usable:
        ax1.axvline(usable, color="red", ls="--", lw=1, label="usable memory")
    else:  # tiny models: drawing the capacity line would squash every point against 0
        ax1.set_xlim(0, 1.15 * most)
        ax1.text(0.98, 0.02, f"usable memory {usable:.1f} GiB (off scale)", ha="right",
                 transform=ax1.transAxes, fontsize=8, color="red")
    ax1.set_xlabel("memory per device (GiB)")
    ax1.set_ylabel("predicted tokens/s")
    ax1.set_title(f"{len(p.ranked)} fitting layouts on {p.gpus} x {p.cluster.name}")
    ax1.legend(fontsize=8)
    best = p.ranked[:top]
    kinds = ("params", "grads", "optimizer", "activations", "buffers", "grad_buckets",
             "gathered", "cp_buffers", "loss_backward")
    left = [0.0] * len(best)
    labels = [f"{i + 1}: {e.layout.short()}" for i, e in enumerate(best)]
    for kind in kinds:
        vals = [getattr(e.memory, kind) / GIB for e in best]
        ax2.barh(labels, vals, left=left, label=kind)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    for y, e in enumerate(best):
        ax2.text(left[y], y, f" {e.tokens_per_s:,.0f} tok/s", va="center", fontsize=7)
    ax2.invert_yaxis()
    ax2.tick_params(axis="y", labelsize=7)
    ax2.set_xlabel("memory per device (GiB)")
    ax2.set_title("top layouts: memory and throughput")
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
