"""`colonnade plot RUN_DIR... [--out plot.png]`: training curves of one or more runs as a PNG.

Reads each run's ``metrics.jsonl`` (``logging.dir``) and draws four panels over steps: training
loss with the validation loss dashed in the same colour, validation perplexity, tokens/s and the
learning rate; several runs are overlaid, one colour each, named in the legend. matplotlib (the
``plot`` extra: ``pip install -e '.[plot]'``) is imported only here, with the Agg backend, so no
display is needed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from colonnade.config.load import ConfigError

PANELS: tuple[tuple[str, tuple[str, ...], str, bool], ...] = (
    ("loss", ("loss", "valid_loss"), "loss (solid: training, dashed: validation)", False),
    ("perplexity", ("valid_ppl",), "validation perplexity", True),
    ("throughput", ("tokens_per_s",), "tokens/s", False),
    ("learning rate", ("lr",), "learning rate", False),
)
"""(title, record keys, y label, log scale) of each panel."""

Series = dict[str, tuple[list[int], list[float]]]


def metrics_file(run: str | Path) -> Path:
    """``run``'s metrics.jsonl (``run`` is a logging dir or the file itself)."""
    path = Path(run)
    path = path if path.is_file() else path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: give a run's logging.dir (it holds "
                                "metrics.jsonl), e.g. colonnade plot runs/demo")
    return path


def read_run(run: str | Path) -> Series:
    """Every plotted key of a run as (steps, values), in step order; the last record of a step
    wins; non-finite values are left out."""
    by_key: dict[str, dict[int, float]] = {}
    path = metrics_file(run)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{path}:{number}: not a metrics record ({err})") from err
        for key in {k for _, keys, _, _ in PANELS for k in keys}:
            value = rec.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                by_key.setdefault(key, {})[step] = float(value)
    return {key: (sorted(points), [points[s] for s in sorted(points)])
            for key, points in by_key.items()}


def run_labels(runs: list[str | Path]) -> list[str]:
    """Legend names: each run's folder name, or its path where names repeat."""
    names = [Path(r).name if Path(r).is_dir() else Path(r).parent.name for r in runs]
    return names if len(set(names)) == len(names) else [str(r) for r in runs]


def plot_runs(runs: list[str | Path], out: str | Path, width: float = 12.0,
              height: float = 8.0, dpi: int = 100) -> Path:
    """Write a PNG of ``runs`` (overlaid) to ``out``; its size is width x height inches at dpi."""
    series = [read_run(r) for r in runs]  # every run read before anything is written
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError as err:
        raise ConfigError("colonnade plot needs matplotlib: pip install -e '.[plot]'") from err
    fig, axes = plt.subplots(2, 2, figsize=(width, height), dpi=dpi)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles = []
    for k, (data, label) in enumerate(zip(series, run_labels(runs), strict=True)):
        colour = colours[k % len(colours)]
        handles.append(Line2D([], [], color=colour, label=label))
        for ax, (_, keys, _, _) in zip(axes.flat, PANELS, strict=True):
            for key in (key for key in keys if key in data):
                steps, values = data[key]
                dashed = key.startswith("valid") and len(keys) > 1
                ax.plot(steps, values, color=colour, linestyle="--" if dashed else "-",
                        marker="o" if len(steps) <= 30 else None, markersize=3)
    for ax, (title, _, ylabel, log) in zip(axes.flat, PANELS, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if log and ax.lines:
            ax.set_yscale("log")
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes,
                    color="grey")
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 6), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
