"""`colonnade plan`: predict memory and step time of every layout and rank them.

Wire into the main CLI with ``add_plan_parser(subparsers)``; the sub-command calls
``run_plan(args)`` (exit status 0, or 2 with a message on stderr for bad input).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from colonnade.analysis.activations import ATTENTION_KERNELS
from colonnade.analysis.hardware import ALIASES, PRESETS, get_cluster
from colonnade.analysis.layout import ZERO_STAGES, Workload
from colonnade.analysis.search import RECOMPUTE, SCHEDULES, Constraints, PlanError, plan
from colonnade.config.choices import CP_ATTENTIONS, MOE_DISPATCHERS, PRECISIONS
from colonnade.config.load import ConfigError, load_config
from colonnade.config.sections import Config

MODEL_FLAGS = {"arch": "arch", "layers": "num_layers", "hidden": "hidden_size",
               "heads": "num_heads", "kv_heads": "num_kv_heads", "ffn": "ffn_hidden_size",
               "vocab": "vocab_size", "max_seq_len": "max_seq_len"}


def configs_dir() -> Path:
    """The repository's configs/ folder (next to the package), else ./configs."""
    here = Path(__file__).resolve().parents[2] / "configs"
    return here if here.is_dir() else Path("configs")


def model_presets() -> list[str]:
    """Names of the model presets in configs/."""
    return sorted(p.stem for p in configs_dir().glob("*.toml"))


PLAN_DESCRIPTION = """\
Choose a parallel layout before you train. For a model (a preset or your config TOML), a
cluster and a number of GPUs, plan tries every tensor / pipeline / data parallel split,
micro-batch size, recompute mode, pipeline schedule, sequence parallelism, ZeRO stage (0-3)
and, with --cp, context parallelism (ring, all-to-all or hierarchical attention), predicts
each one's memory per GPU and step time (an analytic model: parameters, gradients, optimizer states,
ZeRO buffers, activations; compute, tp/cp/pp/dp communication, pipeline bubble; for an
MoE model, with --ep and --expert-tp, the experts per rank and the token dispatch), drops
those that do not fit in memory and prints the fastest first, then the `colonnade train`
flags (best: ...) that run the best one."""

PLAN_EXAMPLES = """\
examples:
  colonnade plan --model llama3-8b --cluster h200 --gpus 64
  colonnade plan --model gpt3-175b --cluster a100-80gb --gpus 1024 --global-batch 1536 \\
      --seq-len 2048
  colonnade plan --model configs/my-model.toml --cluster h100 --gpus 16 --tp 8 --json plan.json
  colonnade plan --model llama3-8b --cluster h100 --gpus 16 --seq-len 65536 \\
      --max-seq-len 65536 --cp 1,2,4,8 --cp-attention ring,all_to_all
  colonnade plan --model llama3-8b --set model.num_experts=8 --set model.moe_top_k=2 \\
      --cluster h100 --gpus 16 --ep 1,2,4,8          # an 8-expert MoE: ep searched
  colonnade plan --calibrate --save-cluster configs/clusters/cpu-local.toml   # this machine
  colonnade plan --validate       # the planner against every published figure, held out"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Description and examples kept as written; an option's default shown after its help
    when it has one that the help does not already state."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (default is None or default is argparse.SUPPRESS or isinstance(default, bool)
                or default == [] or "default" in text):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `plan` sub-command to ``subparsers`` and return its parser."""
    p = subparsers.add_parser(
        "plan", help="predict memory and step time of every parallel layout and rank them",
        description=PLAN_DESCRIPTION, epilog=PLAN_EXAMPLES, formatter_class=_HelpFormatter)
    add_plan_arguments(p)
    return p


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `colonnade plan` (see --help)."""
    g = p.add_argument_group("workload")
    g.add_argument("--model", help=f"a preset in configs/ ({', '.join(model_presets())}) or "
                   "a config TOML file")
    for flag, fld in MODEL_FLAGS.items():
        g.add_argument(f"--{flag.replace('_', '-')}", dest=flag, default=None,
                       help=f"override model.{fld}")
    g.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="any other config override (repeatable)")
    g.add_argument("--global-batch", type=int, help="samples per step (default: the config's)")
    g.add_argument("--seq-len", type=int, help="tokens per sample (default: the config's)")
    g.add_argument("--precision", choices=PRECISIONS,
                   help="default: the config's training.precision")
    g.add_argument("--attention", choices=("auto", *ATTENTION_KERNELS), default="auto",
                   help="attention kernel: fused SDPA ('flash'), blockwise with dropout "
                   "('blockwise': no scores kept) or materialised scores ('eager', Megatron "
                   "2021); auto = blockwise with attention dropout, else flash, as colonnade "
                   "runs")
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", default="a100-80gb",
                   help=f"{', '.join(sorted(PRESETS))} (aliases {', '.join(sorted(ALIASES))}) "
                   "or a cluster TOML")
    c.add_argument("--gpus", type=int, help="devices to plan for (required unless "
                   "--calibrate)")
    f = p.add_argument_group("fixed choices (default: search all)")
    for name, what in (("tp", "only this tensor-parallel degree"),
                       ("pp", "only this pipeline-parallel degree"),
                       ("vp", "only this many virtual pipeline stages per rank"),
                       ("dp", "only this data-parallel degree")):
        f.add_argument(f"--{name}", type=int, help=what)
    f.add_argument("--micro-batch", type=int, help="only this micro-batch size (samples)")
    f.add_argument("--max-tp", type=int, help="largest tp searched (default: GPUs per node)")
    f.add_argument("--recompute", default=",".join(RECOMPUTE), help="modes to search")
    f.add_argument("--schedule", default=",".join(SCHEDULES), help="pipeline schedules to "
                   "search (gpipe allowed)")
    f.add_argument("--uneven-stages", action="store_true",
                   help="also try uneven pipeline stages (fewer layers beside the embedding "
                   "and the head) where pp x vp divides the layers; where it does not they "
                   "are always tried (e.g. DeepSeek-V3's 61 layers)")
    f.add_argument("--sp", choices=("any", "on", "off"), default="any",
                   help="sequence parallelism (with tp > 1): search both, or only on / off")
    f.add_argument("--zero", default="0,1,2,3",
                   help="ZeRO stages to search (comma list of 0-3; stages >= 1 need dp > 1)")
    f.add_argument("--reshard", choices=("default", "any", "on", "off"), default="default",
                   help="stage 3's reshard_after_forward: default (on without pp, off with "
                   "pp), both, or fixed")
    f.add_argument("--cp", default="1",
                   help="context-parallel degrees to search (comma list, e.g. 1,2,4: each rank "
                   "holds seq/cp tokens of every sample; activations per rank fall as 1/cp)")
    f.add_argument("--cp-attention", default="ring",
                   help="cp attention kinds to search at cp > 1 (comma list of ring, "
                   "all_to_all, hierarchical: every split a2a x ring of cp)")
    f.add_argument("--ep", default="1",
                   help="expert-parallel degrees to search for an MoE model (comma list, e.g. "
                   "1,2,4: each MoE layer's experts split over ep ranks folded inside tp x cp "
                   "x dp; the expert states are sharded over edp = tp cp dp / ep at ZeRO 1)")
    f.add_argument("--expert-tp", default="1",
                   help="expert tensor-parallel degrees to search for an MoE model (comma "
                   "list, e.g. 1,2: each expert's width split over expert_tp ranks, folded "
                   "with ep inside tp x cp x dp; edp = tp cp dp / (ep expert_tp))")
    f.add_argument("--moe-dispatcher", choices=MOE_DISPATCHERS, default=None,
                   help="token dispatcher under ep > 1 (default: the config's "
                   "parallel.moe_dispatcher)")
    f.add_argument("--zero-shard-size", type=int,
                   help="hybrid sharding: shard stages >= 1 over groups of this many dp ranks")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, help="layouts shown")
    o.add_argument("--json", help="write the plan as JSON here")
    o.add_argument("--plot", help="write a PNG plot here")
    o.add_argument("--calibrate", action="store_true",
                   help="measure this machine (matmul, memory, gloo) and predict tiny CPU "
                   "layouts; with --save-cluster the measurement becomes the cpu-local preset")
    o.add_argument("--save-cluster", help="with --calibrate: write the measured cluster TOML")
    o.add_argument("--validate", action="store_true",
                   help="print the planner against every published figure it knows and exit: "
                   "throughput per source and row (fitted-on rows marked, the held-out error "
                   "per device) and the memory of every published configuration against its "
                   "device (citations: colonnade/analysis/sources.py); --json writes them")


def _choice(value: str) -> tuple[bool, ...]:
    return {"any": (False, True), "on": (True,), "off": (False,)}[value]


def _stages(value: str) -> tuple[int, ...]:
    items = _list(value, tuple(str(z) for z in ZERO_STAGES), "--zero")
    return tuple(int(z) for z in items)


def _degrees(value: str, flag: str) -> tuple[int, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items or not all(v.isdigit() and int(v) >= 1 for v in items):
        raise PlanError(f"{flag}={value!r}: use a comma list of degrees >= 1, e.g. 1,2,4.")
    return tuple(int(v) for v in items)


def _reshard(value: str) -> tuple[bool | None, ...]:
    return (None,) if value == "default" else _choice(value)


def _list(value: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in allowed + ("gpipe",) * (flag == "--schedule")]
    if bad or not items:
        raise PlanError(f"{flag}={value!r}: use a comma list of {', '.join(allowed)}.")
    return items


def load_model_config(args: argparse.Namespace) -> Config:
    """The config named by --model with the dimension flags and --set applied."""
    overrides = list(args.set)
    for flag, fld in MODEL_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"--model.{fld}={value}")
    if args.model is None:
        raise PlanError("--model is required: a preset (" + ", ".join(model_presets())
                        + ") or a config TOML file.")
    path = Path(args.model)
    if not path.exists():
        preset = configs_dir() / f"{args.model}.toml"
        if not preset.exists():
            raise PlanError(f"--model={args.model!r} is neither a file nor a preset; presets: "
                            + ", ".join(model_presets()))
        path = preset
    return load_config(path, overrides)


def build(args: argparse.Namespace) -> tuple[Workload, Constraints]:
    """Workload and search constraints from the parsed arguments."""
    cfg = load_model_config(args)
    if args.precision:
        cfg = dataclasses.replace(
            cfg, training=dataclasses.replace(cfg.training, precision=args.precision))
    w = Workload.from_config(cfg, global_batch=args.global_batch, seq_len=args.seq_len,
                             attention=args.attention)
    if getattr(args, "moe_dispatcher", None):
        w = dataclasses.replace(w, moe_dispatcher=args.moe_dispatcher)
    cons = Constraints(tp=args.tp, pp=args.pp, vp=args.vp, dp=args.dp,
                       micro_batch=args.micro_batch, max_tp=args.max_tp,
                       recompute=_list(args.recompute, RECOMPUTE, "--recompute"),
                       schedules=_list(args.schedule, SCHEDULES, "--schedule"),
                       uneven_stages=getattr(args, "uneven_stages", False),
                       sp=_choice(args.sp), zero=_stages(args.zero),
                       reshard=_reshard(args.reshard), zero_shard_size=args.zero_shard_size,
                       cp=_degrees(args.cp, "--cp"),
                       cp_attention=_list(args.cp_attention, CP_ATTENTIONS,
                                          "--cp-attention"),
                       ep=_degrees(getattr(args, "ep", "1"), "--ep"),
                       expert_tp=_degrees(getattr(args, "expert_tp", "1"), "--expert-tp"))
    return w, cons


def run_validate(json_path: str | None) -> int:
    """`colonnade plan --validate`: the held-out report (colonnade.analysis.holdout)."""
    from colonnade.analysis.holdout import report

    lines, records = report()
    print("\n".join(lines))
    if json_path:
        Path(json_path).write_text(json.dumps(records, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """Run `colonnade plan`; 0 on success, 2 on bad input (message on stderr)."""
    from colonnade.analysis.report import print_table, write_json, write_plot

    try:
        if args.calibrate:
            from colonnade.analysis.calibrate import run_calibrate

            return run_calibrate(args)
        if args.validate:
            return run_validate(args.json)
        if args.gpus is None:
            raise PlanError("--gpus is required (devices to plan for).")
        w, cons = build(args)
        result = plan(w, get_cluster(args.cluster), args.gpus, cons)
    except (PlanError, ConfigError, ValueError) as err:
        print(f"colonnade plan: {err}", file=sys.stderr)
        return 2
    print_table(result, args.top)
    best = result.best
    print("best: " + " ".join(best.layout.overrides()))
    if args.json:
        write_json(result, args.top, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(result, args.top, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m colonnade.analysis.cli ...``."""
    parser = argparse.ArgumentParser(prog="colonnade plan", description=__doc__)
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
