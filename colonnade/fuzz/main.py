"""``colonnade bench fuzz``: draw cases, judge each, print the table, write the results JSON.

    colonnade bench fuzz --cases 300 --seed 7      # 300 draws of seed 7
    colonnade bench fuzz --seed 7 --case 41        # case 41 of seed 7 alone (a reproduction)
    colonnade bench fuzz --cases 20                # a fresh seed, printed first

One line per case (case, ranks, layout summary, verdict, max relative error, seconds) as it
finishes, a progress bar on a terminal, then the verdict counts, the refusals per validator
rule and, for every mismatch, late refusal or hang, the one command that reproduces it. The
JSON (``--json``) lists every case with its overrides, and every refused combination under the
rule that refused it. Exit status 1 when any case is a failure (:data:`FAILURES`).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from colonnade.fuzz.run import FAILURES, VERDICTS, Verdict, judge
from colonnade.fuzz.space import Case, draw_case
from colonnade.parallel.pool import RankPools
from colonnade.training.progress import progress_bar

DEFAULT_JSON = Path("benchmarks/results/fuzz.json")
"""Where the results JSON goes unless ``--json`` says otherwise."""
STEPS = 2
"""Optimizer steps each accepted case trains (``--steps``)."""
LIVE_RANKS = 16
"""Rank processes the pools keep alive at most (a world of 8 plus the smaller ones)."""


def reproduce_command(seed: int, index: int, steps: int = STEPS) -> str:
    """The one command that runs case ``index`` of seed ``seed`` again."""
    extra = f" --steps {steps}" if steps != STEPS else ""
    return f"colonnade bench fuzz --seed {seed} --case {index}{extra}"


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="colonnade bench fuzz", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=300, help="draws to judge (default 300)")
    ap.add_argument("--seed", type=int, default=None,
                    help="the run's seed (default: a fresh one, printed)")
    ap.add_argument("--case", type=int, action="append", default=None,
                    help="judge only this case index of --seed (repeatable)")
    ap.add_argument("--first", type=int, default=0, help="index of the first case (default 0)")
    ap.add_argument("--steps", type=int, default=STEPS,
                    help=f"optimizer steps per accepted case (default {STEPS})")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds one run may take before it is a hang (default 300)")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON,
                    help=f"results JSON (default {DEFAULT_JSON})")
    ap.add_argument("--no-hf", action="store_true",
                    help="skip the transformers twin of the cases that have one")
    ap.add_argument("--matrix", type=Path, default=None, metavar="PATH",
                    help="write the support matrix page (docs/support_matrix.md) and exit")
    return ap.parse_args(argv)


def run_cases(cases: list[Case], timeout_s: float, pools: RankPools,
              say: Any = print, hf: bool = True) -> list[Verdict]:
    """Judge every case (``hf``: with its transformers twin where it has one); ``say`` gets
    each table row as it finishes. Cases run grouped by world size, smallest first, so each
    pool of ranks starts once (a pool start costs seconds to minutes on a loaded machine);
    the verdicts come back in the cases' order."""
    verdicts: dict[int, Verdict] = {}
    order = sorted(range(len(cases)), key=lambda i: (cases[i].world, i))
    with progress_bar(len(cases), enabled=True, desc="fuzz", unit="case") as bar:
        for i in order:
            verdicts[i] = judge(cases[i], pools, timeout_s, hf=hf)
            say(row(cases[i], verdicts[i]))
            if bar is not None:
                bar.update(1)
    return [verdicts[i] for i in range(len(cases))]


HEADER = (f"{'case':>10}  {'ranks':>5}  {'layout':<58}  {'verdict':<12}  {'hf':>2}  "
          f"{'max rel err':>11}  {'s':>6}")
"""The table's header line."""


def row(case: Case, v: Verdict) -> str:
    """One table line: case, ranks, layout summary, verdict, whether the transformers twin
    was compared too, the largest relative error, seconds (a refusal: then its rules)."""
    verdict = v.verdict if v.verdict != "refused" else "refused"
    err = f"{v.max_err:.2e}" if v.errors else "-"
    twin = "✓" if v.errors and not v.hf else "-"
    rules = f"  ({', '.join(sorted({r for r, _ in v.rules}))})" if v.rules else ""
    return (f"{v.case:>10}  {case.world:>5}  {v.summary:<58.58}  {verdict:<12}  {twin:>2}  "
            f"{err:>11}  {v.seconds:6.1f}{rules}")


def report(seed: int, steps: int, cases: list[Case], verdicts: list[Verdict]) -> dict[str, Any]:
    """The results JSON: counts, refusals by rule, every case."""
    counts = collections.Counter(v.verdict for v in verdicts)
    by_rule: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for v in verdicts:
        for rule, message in v.rules:
            by_rule[rule].append({"case": v.case, "layout": v.summary, "message": message})
    return {
        "seed": seed, "steps": steps, "cases": len(verdicts),
        "verdicts": {k: counts.get(k, 0) for k in VERDICTS},
        "hf_checked": sum(1 for v in verdicts if v.errors and not v.hf),
        "refusals_by_rule": {k: by_rule[k] for k in sorted(by_rule)},
        "results": [{"case": v.case, "layout": v.summary, "verdict": v.verdict,
                     "seconds": round(v.seconds, 2), "errors": v.errors, "worst": v.worst,
                     "rules": [list(r) for r in v.rules], "world": case.world, "hf": v.hf,
                     "overrides": case.overrides(), "eod": case.eod,
                     "reproduce": reproduce_command(seed, case.index, steps),
                     "detail": v.detail[-4000:]}
                    for case, v in zip(cases, verdicts, strict=True)],
    }


def summary_lines(result: dict[str, Any]) -> list[str]:
    """Verdict counts, refusals per rule, and each failure with its reproducing command."""
    lines = ["verdicts: " + ", ".join(f"{k} {n}" for k, n in result["verdicts"].items())
             + f"; checked against transformers too: {result['hf_checked']}"]
    rules = result["refusals_by_rule"]
    if rules:
        lines.append("refusals per rule (a case may break several): " + ", ".join(
            f"{k} {len(v)}" for k, v in sorted(rules.items(), key=lambda kv: -len(kv[1]))))
    for res in result["results"]:
        if res["verdict"] in FAILURES:
            lines.append(f"{res['verdict'].upper()} {res['case']} [{res['layout']}]: "
                         f"{res['worst']}\n    reproduce: {res['reproduce']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer; 0 when no case failed, 1 otherwise."""
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.matrix is not None:
        from colonnade.fuzz.matrix import page

        args.matrix.write_text(page(), encoding="utf-8")
        print(f"wrote {args.matrix}")
        return 0
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    indices = args.case if args.case else range(args.first, args.first + args.cases)
    cases = [draw_case(seed, i, args.steps) for i in indices]
    print(f"colonnade fuzz: seed {seed}, {len(cases)} case(s), {args.steps} step(s) each "
          f"(all of them again: colonnade bench fuzz --seed {seed} --cases {args.cases})",
          flush=True)
    print(HEADER, flush=True)
    start = time.monotonic()
    pools = RankPools(max_live_ranks=LIVE_RANKS)
    try:
        verdicts = run_cases(cases, args.timeout, pools, lambda line: print(line, flush=True),
                             hf=not args.no_hf)
    finally:
        pools.close()
    result = report(seed, args.steps, cases, verdicts)
    result["seconds"] = round(time.monotonic() - start, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    for line in summary_lines(result):
        print(line)
    print(f"results: {args.json} ({result['seconds']:.0f} s)")
    return 1 if any(v.verdict in FAILURES for v in verdicts) else 0
