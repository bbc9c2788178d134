"""The peer table: Colonnade against the fastest peer on every layout, one workload.

    .venv/bin/python benchmarks/peer_table.py [--workload gpt2-tiny] [--quick] [--zero23]
        [--only single_process,data_parallel,tensor_parallel,pipeline] [--repeat N]
        [--results-dir DIR] [--from-json]

Runs each side-by-side benchmark as a subprocess on ``--workload`` (each writes its JSON with
a top-level ``rows`` list: layout, colonnade tokens/s, peer, peer_tokens_per_s, ratio), then
prints and writes the table's rows as JSON (``peer_table.json``) and a markdown table
(``peer_table.md``):

  single_process.py --threads 1 2   1 process, 1 thread / 2 threads  (plain PyTorch loop)
  data_parallel.py                  dp2 (torch DDP, DeepSpeed ZeRO-0); dp2 + ZeRO-1
                                    (DeepSpeed ZeRO-1/2, FSDP2); with ``--zero23`` also
                                    dp2 + ZeRO-2 (DeepSpeed ZeRO-2, FSDP2
                                    reshard_after_forward=False), dp2 + ZeRO-3 (DeepSpeed
                                    ZeRO-3, FSDP2), dp2 + ZeRO-3 no reshard (FSDP2
                                    reshard_after_forward=False)
  tensor_parallel.py                tp2 (DTensor); tp2 + sp (DTensor with SequenceParallel)
  pipeline.py                       pp2 1F1B, interleaved (vp2), ZB-H1 (against ZBV, and
                                    against torch's ZB1P = ScheduleInterleavedZeroBubble with
                                    one stage per rank), ZB-V (vp2; same torch ZBV run as
                                    ZB-H1) (torch.distributed.pipelining)

``ratio`` is each benchmark's median over interleaved rounds (or alternated steps) of the
per-round ratio Colonnade tokens/s / peer tokens/s against the fastest peer of the row (the
highest median tokens/s); >= 1 means Colonnade is at least as fast. The reference ratio
(the one first measured for the table, gpt2-tiny) is shown next to it. Load on a shared
machine also drifts over minutes, so one run of one benchmark can sit in a slow phase:
``--repeat N`` runs the whole list N times, one after the other, writes run k of each
benchmark as ``<bench>_<workload>.run<k>.json`` and the table's JSON as their pooled rows,
whose ratio and quartiles are taken over the rounds of every run together (each run's own
median shown beside it as "runs ..."). Timings mean something only
on a quiet machine: ``--quick`` runs every
benchmark in its smoke-test size and writes to a temporary directory unless ``--results-dir``
is given. ``--from-json`` rebuilds the table from the JSON files already in the results
directory without running anything. The ZeRO-2/3 rows are not in the default run
(they double data_parallel.py's variants): ``--zero23`` runs them; a table built from a JSON
that has them shows them, after dp2 + ZeRO-1, with no reference ratio; likewise the rows
"pp2 ZB-H1 (torch ZB1P)" (the same algorithm as ours; the reference ZB-H1 row keeps torch's ZBV)
and pp2 ZB-V (pipeline.py runs both by default) follow pp2 ZB-H1 with no reference ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ratios import pooled_row

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
BENCHMARKS = ("single_process", "data_parallel", "tensor_parallel", "pipeline")
ISSUE_ROWS: list[tuple[str, float]] = [
    ("1 process, 1 thread", 0.91), ("1 process, 2 threads", 0.93), ("dp2", 0.88),
    ("dp2 + ZeRO-1", 0.96), ("tp2", 1.11), ("tp2 + sp", 1.00), ("pp2 1F1B", 0.92),
    ("pp2 interleaved", 0.92), ("pp2 ZB-H1", 0.98),
]
"""The issue's layouts in its order, with the ratio it measured (3 interleaved rounds)."""
EXTRA_ROWS: dict[str, list[str]] = {
    "dp2 + ZeRO-1": ["dp2 + ZeRO-2", "dp2 + ZeRO-3", "dp2 + ZeRO-3 no reshard"],
    "pp2 ZB-H1": ["pp2 ZB-H1 (torch ZB1P)", "pp2 ZB-V"],
}
"""Layouts added after issue 19 (issue 15's ZeRO-2/3, ZB-H1 against torch's same algorithm,
the ZB-V schedule), placed after the issue-19 layout they follow; they carry no issue-19
ratio and are never listed as "not run"."""
LAYOUTS: list[tuple[str, float | None]] = [
    row for name, ratio in ISSUE_ROWS
    for row in [(name, ratio), *((extra, None) for extra in EXTRA_ROWS.get(name, []))]]
"""Every known layout in table order, with the issue-19 ratio (None for later issues')."""
ISSUE_WORKLOAD = "gpt2-tiny"
"""The workload the issue's ratios were measured on (other workloads show none)."""


def command(bench: str, workload: str, json_path: Path, quick: bool,
            zero23: bool = False) -> list[str]:
    """The subprocess command of one benchmark on ``workload`` writing ``json_path``
    (``zero23``: data_parallel.py also runs issue 15's ZeRO-2/3 variants)."""
    cmd = [sys.executable, str(HERE / f"{bench}.py"), "--workload", workload,
           "--json", str(json_path)]
    if bench == "single_process":
        cmd += ["--threads", "1", "2"]
    if bench == "data_parallel" and zero23:
        cmd += ["--zero23"]
    return cmd + (["--quick"] if quick else [])


def run_all(benches: list[str], workload: str, out: Path, quick: bool,
            zero23: bool = False, repeat: int = 1) -> dict[str, list[float]]:
    """Run each benchmark in turn (its output streams through), the whole list ``repeat``
    times (run k of a benchmark writes ``<bench>_<workload>.run<k>.json``, then
    :func:`pool_runs` writes their pooled rows as ``<bench>_<workload>.json``); wall seconds
    per benchmark and run."""
    took: dict[str, list[float]] = {bench: [] for bench in benches}
    for k in range(1, repeat + 1):
        for bench in benches:
            path = json_path(out, bench, workload, k if repeat > 1 else None)
            cmd = command(bench, workload, path, quick, zero23)
            print(f"$ {' '.join(cmd)}" + (f"   # run {k}/{repeat}" if repeat > 1 else ""),
                  flush=True)
            start = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, check=True)
            took[bench].append(time.perf_counter() - start)
    if repeat > 1:
        for bench in benches:
            pool_runs([json_path(out, bench, workload, k) for k in range(1, repeat + 1)],
                      json_path(out, bench, workload, None))
    return took


def json_path(out: Path, bench: str, workload: str, run: int | None) -> Path:
    """Where a benchmark's JSON goes: ``<bench>_<workload>.json`` (what the table reads), or
    run ``run``'s of a repeated table."""
    return out / f"{bench}_{workload}{'' if run is None else f'.run{run}'}.json"


def pool_runs(paths: list[Path], out: Path) -> None:
    """Write ``out`` with one row per layout pooled over the runs in ``paths``
    (:func:`ratios.pooled_row`: median and quartiles over every run's rounds together, each
    run's own median in run_ratios), in the first run's row order."""
    runs = [json.loads(p.read_text()) for p in paths]
    layouts = [r["layout"] for r in runs[0]["rows"]]
    rows = [pooled_row([r for run in runs for r in run["rows"] if r["layout"] == layout])
            for layout in layouts]
    out.write_text(json.dumps({"repeat": len(runs), "run_files": [p.name for p in paths],
                               "rows": rows}, indent=1) + "\n")


def issue_key(layout: str) -> int:
    """Index of ``layout`` in :data:`LAYOUTS`: the longest known layout that ``layout``
    starts with (case-insensitive, at a word end: "tp2 + sp" is not "tp2"); else the end."""
    low = layout.lower()
    best, found = -1, len(LAYOUTS)
    for i, (name, _) in enumerate(LAYOUTS):
        key = name.lower()
        if low.startswith(key) and not low[len(key):][:1].isalnum() and len(key) > best:
            best, found = len(key), i
    return found


def collect(benches: list[str], workload: str, out: Path) -> list[dict[str, Any]]:
    """The rows of every benchmark's JSON, in the issue's order, each with its source and the
    issue's ratio; a missing file is reported and skipped."""
    rows = []
    for bench in benches:
        path = out / f"{bench}_{workload}.json"
        if not path.exists():
            print(f"missing {path}: its rows are left out", file=sys.stderr)
            continue
        for row in json.loads(path.read_text()).get("rows", []):
            if row.get("workload", workload) != workload:
                continue
            i = issue_key(row["layout"])
            known = i < len(LAYOUTS) and workload == ISSUE_WORKLOAD
            rows.append({**row, "source": bench,
                         "issue_ratio": LAYOUTS[i][1] if known else None})
    return sorted(rows, key=lambda r: issue_key(r["layout"]))


def markdown(rows: list[dict[str, Any]], workload: str) -> str:
    """The issue's table: layout, Colonnade, fastest peer, ratio (by wall clock and CPU time)
    and the issue's ratio; a layout of the issue with no row reads "not run"."""
    keyed: list[tuple[int, str]] = []
    for r in rows:
        cpu = f"{r['ratio_cpu']:.2f}" if r.get("ratio_cpu") is not None else "-"
        iqr = (f" [{r['ratio_q1']:.2f}, {r['ratio_q3']:.2f}]"
               if r.get("ratio_q1") is not None else "")
        if r.get("run_ratios"):
            iqr += f" (runs {', '.join(f'{x:.2f}' for x in r['run_ratios'])})"
        issue = f"{r['issue_ratio']:.2f}" if r.get("issue_ratio") is not None else "-"
        keyed.append((issue_key(r["layout"]),
                      f"| {r['layout']} | {r['colonnade']:.0f} | {r['peer']} "
                      f"{r['peer_tokens_per_s']:.0f} | {r['ratio']:.2f}{iqr} | {cpu} | {issue} |"))
    seen = {k for k, _ in keyed}
    keyed += [(i, f"| {layout} | not run | - | - | - | "
                  f"{f'{ratio:.2f}' if workload == ISSUE_WORKLOAD else '-'} |")
              for i, (layout, ratio) in enumerate(LAYOUTS)
              if i not in seen and ratio is not None]
    keyed.sort(key=lambda kl: kl[0])  # stable: a benchmark's own order within a layout
    head = [f"Workload `{workload}`: tokens/s, medians; ratio = median per-round "
            "Colonnade / fastest peer [quartiles over rounds].", "",
            "| layout | Colonnade | fastest peer | ratio [q1, q3] | ratio by CPU time | issue 19 |",
            "|---|---|---|---|---|---|"]
    notes = zero_notes(rows) + bound_notes(rows)
    return "\n".join(head + [line for _, line in keyed] + (["", *notes] if notes else [])) + "\n"


def zero_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Note lines under the table, per issue-15 row (ZeRO-2/3): Colonnade's exposed parameter
    all-gather time per step, and per rank for Colonnade / the fastest peer the allocated
    training state (storage accounting) and the resident-set peak of the timed steps above the
    steady state before them (touched transient memory)."""
    extra = {name for names in EXTRA_ROWS.values() for name in names}
    notes = []
    for r in rows:
        if r["layout"] not in extra or "colonnade_state_bytes" not in r:
            continue
        gather = r.get("colonnade_gather_exposed_s", 0.0)

        def mb(key: str, r: dict[str, Any] = r) -> str:
            both = [r.get(f"{side}_{key}") for side in ("colonnade", "peer")]
            return " / ".join("-" if v is None else f"{v / 2**20:.1f}" for v in both)

        notes.append(f"- {r['layout']}: Colonnade parameter all-gather exposed "
                     f"{1e3 * gather:.1f} ms/step; per rank, Colonnade / {r['peer']}: "
                     f"training state {mb('state_bytes')} MB, RSS growth in the timed steps "
                     f"{mb('step_rss_peak_bytes')} MB")
    return notes


def bound_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Under the table, per row carrying a one-stage bound (pipeline_train's "pp2 ZB-H1"
    against torch's ZBV, its last run's replays): ZB-H1's compute makespan, the least any
    schedule with one stage per rank can have, zbv's, and so the most such a schedule can
    reach against the V placement."""
    return [f"- {r['layout']}: replayed with the measured action times, ZB-H1 computes a "
            f"step's forward-backward in {r['replay_ms']:.0f} ms, and no schedule with one "
            f"stage per rank can take under {r['one_stage_bound_ms']:.0f} ms; the V placement "
            f"(zbv) takes {r['zbv_replay_ms']:.0f} ms, so against ZBV a one-stage schedule "
            f"reaches at most {r['bound_ratio']:.2f} at equal per-action work"
            for r in rows if "bound_ratio" in r]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="gpt2-tiny", choices=["gpt2-tiny", "llama-tiny"])
    p.add_argument("--only", default=",".join(BENCHMARKS),
                   help=f"run only these of {BENCHMARKS} (the table still takes every "
                        "benchmark's JSON found in the results directory)")
    p.add_argument("--quick", action="store_true", help="every benchmark's smoke-test size")
    p.add_argument("--zero23", action="store_true",
                   help="data_parallel.py also runs the ZeRO-2/3 rows (DeepSpeed "
                        "ZeRO-2/3, FSDP2 reshard_after_forward False / True)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole list of benchmarks this many times, one after the "
                        "other, and pool each row's rounds over the runs (load drifts over "
                        "minutes: a single run of one benchmark can sit in a slow phase)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="where the JSON and the table go (default benchmarks/results; a "
                        "temporary directory with --quick)")
    p.add_argument("--from-json", action="store_true",
                   help="only rebuild the table from the JSON files in the results directory")
    args = p.parse_args(argv)
    benches = args.only.split(",")
    if set(benches) - set(BENCHMARKS):
        raise SystemExit(f"--only: choose from {BENCHMARKS}")
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {args.repeat}")
    out = args.results_dir or (Path(tempfile.mkdtemp(prefix="peer_table_")) if args.quick
                               else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    took = {} if args.from_json else run_all(benches, args.workload, out, args.quick,
                                             args.zero23, args.repeat)
    rows = collect(list(BENCHMARKS), args.workload, out)  # also earlier runs' files in out
    table = markdown(rows, args.workload)
    print(table)
    (out / "peer_table.md").write_text(table)
    (out / "peer_table.json").write_text(json.dumps(
        {"workload": args.workload, "quick": args.quick, "seconds": took, "rows": rows},
        indent=1) + "\n")
    print(f"wrote {out / 'peer_table.json'} and {out / 'peer_table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
