"""Command line: ``colonnade prepare | train | generate | plot | plan | bench | convert``.

Config fields are set with ``--section.field=value`` after an optional ``--config FILE.toml``;
``colonnade train --help-config`` lists every field with its documentation.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from colonnade.analysis.cli import add_plan_parser
from colonnade.config.choices import DEVICES
from colonnade.config.load import ConfigError, config_to_toml, field_docs, load_config
from colonnade.config.sections import SECTIONS, Config
from colonnade.config.validate import resolve, validate


def _hf_classes() -> str:
    """The Hugging Face classes Colonnade reads and writes, from the formats' registry (so the
    help texts stay true as families are added)."""
    from colonnade.checkpoint.hf_moe import ALL_FORMATS

    return ", ".join(fmt.hf_class for fmt in ALL_FORMATS.values())


PREPARE_FIELDS: dict[str, tuple[str, ...] | None] = {"data": None, "model": ("vocab_size",)}
"""The config fields `colonnade prepare` reads (None: the whole section)."""


def _config_help(only: dict[str, tuple[str, ...] | None] | None = None) -> str:
    """Every config field with its default and docstring; ``only``: these sections (and, where
    a tuple is given, these fields of it)."""
    lines = ["Config fields (set with --section.field=value):"]
    for name, cls in SECTIONS.items():
        if only is not None and name not in only:
            continue
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if only is not None and only[name] is not None and f.name not in only[name]:
                continue
            default = f.default if f.default is not dataclasses.MISSING else "..."
            lines.append(f"  --{name}.{f.name}={default}\n      {docs.get(f.name, '')}")
    return "\n".join(lines)


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launching (torch elastic launcher)")
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks to start on this node (default: 1)")
    g.add_argument("--nnodes", type=int, default=1, help="number of nodes (default: 1)")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this node's index (static rdzv; default: 0)")
    g.add_argument("--rdzv-endpoint", default="127.0.0.1:29511",
                   help="host:port of rank 0 (default: 127.0.0.1:29511)")
    g.add_argument("--rdzv-id", default="colonnade",
                   help="the job's rendezvous id, the same on every node (multi-node; Slurm: "
                        "$SLURM_JOB_ID; default: colonnade)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="restart the whole job this many times after a failure (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="colonnade", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_prepare, _add_generate, _add_convert, _add_plot, _add_bench,
                add_plan_parser):
        add(sub)
    return p


def _add_train(sub: Any) -> None:
    """``colonnade train``."""
    t = sub.add_parser("train", help="train a model (any tp/sp/cp/pp/dp/ep layout)",
                       description="Train. Any --section.field=value overrides the config. "
                       "--dry-run checks a config and shows what the run would be (model, "
                       "layout, memory per rank, data) without starting it.",
                       epilog="Use --help-config to list every config field.\n\n"
                       "nothing lost: every run saves under <logging.dir>/checkpoints (or "
                       "--checkpoint.save=DIR;\n=none saves nothing) and re-running a command "
                       "resumes from there (another run's\ncheckpoints are refused: "
                       "--checkpoint.on_existing="
                       "auto|resume|overwrite|refuse);\nCtrl-C / SIGTERM finish the step, save "
                       "and exit 130 / 143; without --data.input an\nexisting "
                       "--data.prepared_dir is used as it is (never re-prepared; "
                       "--data.overwrite).\n\nexamples:\n"
                       "  colonnade train --config configs/tiny-llama.toml\n"
                       "  colonnade train --config configs/llama2-70b.toml --nproc 8 "
                       "--parallel.tp=8 --dry-run",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--config", help="TOML config file (see configs/)")
    t.add_argument("--print-config", action="store_true",
                   help="print the config as TOML and exit; the fields derived from the number "
                   "of ranks (parallel.dp, training.microbatches / global_batch_size) stay "
                   "unset, so it runs with any --nproc (with --nproc they are checked and shown "
                   "as comments)")
    t.add_argument("--help-config", action="store_true", help="list every config field")
    t.add_argument("--dry-run", action="store_true",
                   help="validate, build the model on the meta device and print parameters, "
                   "tokens per step, layout, per-rank memory (parameters, gradients, optimizer, "
                   "activations; the planner's model) and data stats; starts no rank, writes "
                   "and prepares nothing; exit 0")
    t.add_argument("--init-from", metavar="PATH",
                   help="fine-tune: start from the weights of a Colonnade checkpoint or a "
                   f"Hugging Face directory ({_hf_classes()}), with its model shape (no "
                   "--model.* needed) and tokenizer (must be the data's); step, optimizer and data "
                   "start fresh (= --checkpoint.init_from=PATH; --checkpoint.load resumes)")
    _add_launch_args(t)


def _add_prepare(sub: Any) -> None:
    """``colonnade prepare``."""
    pr = sub.add_parser("prepare", help="tokenize text into an indexed dataset",
                        description="Tokenize data.input (files, folders, globs; text, jsonl, "
                        "json, csv, parquet, HF save_to_disk) into data.prepared_dir, which "
                        "`colonnade train --data.prepared_dir=DIR` then reads.",
                        epilog=f"{_config_help(PREPARE_FIELDS)}\n\nexample:\n  colonnade "
                        "prepare --data.input=my_texts/ --data.prepared_dir=data/mine",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    pr.add_argument("--config", help="TOML config file")


def _add_generate(sub: Any) -> None:
    """``colonnade generate``."""
    g = sub.add_parser("generate", help="sample text from a saved model",
                       description="Continue a prompt with a trained model (one process).")
    g.add_argument("model_dir", help="a run's logging.dir (train saves under its "
                   "checkpoints/ unless --checkpoint.save says otherwise), a checkpoint root "
                   "or one of its step_N dirs, a `convert --from-hf` output, or a Hugging Face "
                   f"folder ({_hf_classes()}; config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--prompt", default="def ", help="text to continue (\"\": a new document, "
                   "started after the end-of-document token)")
    g.add_argument("--max-new-tokens", type=int, default=120,
                   help="tokens to generate, at most the model's context left after the "
                   "prompt (default: 120)")
    g.add_argument("--temperature", type=float, default=0.8,
                   help="divides the logits before sampling; 0 = greedy (default: 0.8)")
    g.add_argument("--top-k", type=int, default=40,
                   help="sample among the k most likely tokens; 0 = off (default: 40)")
    g.add_argument("--top-p", type=float, default=0.95,
                   help="sample among the fewest tokens whose probability reaches p (nucleus); "
                   "1 = off (default: 0.95)")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed: the same seed gives the same text (default: 0)")
    g.add_argument("--no-cache", action="store_true", help="recompute instead of a KV cache")
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the model runs: auto (default) = cuda when a GPU is visible, "
                   "else cpu")


def _add_convert(sub: Any) -> None:
    """``colonnade convert``."""
    c = sub.add_parser("convert", help="Hugging Face <-> Colonnade checkpoint conversion",
                       description=f"Convert Hugging Face directories ({_hf_classes()}). "
                       "--to-hf writes config.json, generation_config.json, model.safetensors "
                       "and the tokenizer (tokenizer.json, tokenizer_config.json, "
                       "special_tokens_map.json; bos/eos/pad = its end-of-document token) "
                       "that transformers' AutoModelForCausalLM / AutoTokenizer load.")
    way = c.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-hf", metavar="DIR", help="HF model directory to import")
    way.add_argument("--to-hf", metavar="DIR", help="Colonnade checkpoint to export: a run's "
                     "logging.dir, a checkpoint root (its latest) or a step_N dir")
    c.add_argument("--out", required=True, metavar="DIR", help="output directory")
    c.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="with --to-hf: tensor dtype of model.safetensors and config.json's "
                   "torch_dtype (default: as stored in the checkpoint)")


def _add_plot(sub: Any) -> None:
    """``colonnade plot``."""
    pl = sub.add_parser("plot", help="draw loss, perplexity, tokens/s and LR curves to a PNG",
                        description="Read each RUN_DIR's metrics.jsonl and write one PNG: "
                        "training and validation loss, validation perplexity, tokens/s and "
                        "learning rate over steps, the runs overlaid (needs matplotlib: pip "
                        "install -e '.[plot]').",
                        epilog="example:\n  colonnade plot runs/demo runs/other --out cmp.png",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    pl.add_argument("runs", nargs="+", metavar="RUN_DIR",
                    help="a run's logging.dir (or its metrics.jsonl)")
    pl.add_argument("--out", default="plot.png", help="PNG to write (default: plot.png)")


def _add_bench(sub: Any) -> None:
    """``colonnade bench``."""
    b = sub.add_parser("bench", help="list or run the side-by-side benchmark scripts",
                       description="Without NAME, list benchmarks/*.py; with it, run that "
                       "script with the remaining options (NAME --help lists them).")
    b.add_argument("name", nargs="?", help="benchmark to run, e.g. planner_cpu")
    b.add_argument("args", nargs=argparse.REMAINDER, help="options passed to the script")


def _load(args: argparse.Namespace, overrides: list[str]) -> Config:
    return load_config(getattr(args, "config", None), overrides)


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.help_config:
        print(_config_help())
        return 0
    from colonnade.checkpoint.finetune import explicit_model_fields, with_init_from

    if args.init_from:
        overrides = [*overrides, f"--checkpoint.init_from={args.init_from}"]
    config = with_init_from(_load(args, overrides), explicit_model_fields(args.config, overrides))
    ranks_given = args.nproc is not None or args.nnodes > 1
    args.nproc = 1 if args.nproc is None else args.nproc
    world = args.nproc * args.nnodes
    from colonnade.launch import check_launch_args, launch

    bad = check_launch_args(args)  # before the config: --nproc 0 is not a parallel.dp problem
    if bad:
        raise ConfigError("invalid launch arguments:\n" + "\n".join(f"  - {p}" for p in bad))
    if args.print_config:
        return _print_config(config, world if ranks_given else None)
    resolved = validate(resolve(config, world), world)
    from colonnade.training.metrics import logging_problems

    problems = logging_problems(resolved.logging)  # e.g. W&B asked for but not installed
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    if args.dry_run:
        from colonnade.analysis.dry_run import dry_run

        print(dry_run(resolved, world))
        return 0
    from colonnade.training.preflight import data_plan, finished_step, preflight

    resolved, notes = preflight(config, world)  # data, checkpoints, resume: before any rank
    from colonnade.analysis.memory_limit import check_memory_limit

    check_memory_limit(resolved, world)  # training.memory_limit_gb, before anything is written
    for note in notes:
        print(f"colonnade: {note}", flush=True)
    done = finished_step(resolved)
    if done is not None:  # a re-run of a finished run: nothing to start
        from colonnade.training.lifecycle import finished_note

        print(finished_note(resolved, done))
        return 0
    if world == 1:
        from colonnade.reliability.interrupt import exit_status
        from colonnade.training.loop import final_summary, train

        result = train(resolved)
        if result.get("interrupted"):
            return exit_status(result["interrupted"])
        if not result.get("finished"):
            print(final_summary(result))
        return 0
    from colonnade.training.setup import prepare_data

    if args.node_rank == 0 and data_plan(resolved).action == "prepare":
        prepare_data(resolved)  # once, before launch: its errors are one line
    return launch(resolved, args, overrides)


DERIVED_FIELDS = (("parallel", "dp"), ("parallel", "expert_tp"), ("training", "microbatches"),
                  ("training", "global_batch_size"))
"""Fields :func:`~colonnade.config.validate.resolve` derives from the world size."""


def _print_config(config: Config, world: int | None) -> int:
    """``train --print-config``: ``config`` as TOML, checked against ``world`` ranks (None:
    --nproc / --nnodes not given, so only the rules that need no world size). The fields
    derived from the world size stay unset unless the config sets them, so the text runs with
    any --nproc; with a world, their values for it follow as a comment."""
    if world is None:
        print(config_to_toml(validate(config)))
        return 0
    resolved = validate(resolve(config, world), world)
    print(config_to_toml(config))
    derived = [f"{section}.{name} = {getattr(getattr(resolved, section), name)}"
               for section, name in DERIVED_FIELDS
               if getattr(getattr(config, section), name) is None
               and getattr(getattr(resolved, section), name) is not None]
    if derived:
        print(f"# derived for {world} rank(s), left unset above so that this config runs with "
              f"any --nproc: {', '.join(derived)}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from colonnade.data import eod_id, load_tokenizer
    from colonnade.generate import (
        generate,
        generation_device,
        load_for_generation,
        sampling_problems,
    )

    problems = sampling_problems(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    if problems:  # before the model is loaded
        raise ConfigError("invalid generation arguments:\n"
                          + "\n".join(f"  - {p}" for p in problems))
    device = generation_device(args.device)
    model, tok_path = load_for_generation(args.model_dir, device)
    tok = load_tokenizer(tok_path)
    ids = tok.encode(args.prompt, add_special_tokens=False).ids or [eod_id(tok)]  # "": a new doc
    limit = model.cfg.max_seq_len
    if len(ids) >= limit:
        raise ConfigError(f"--prompt is {len(ids)} tokens; the model's context (max_seq_len) is "
                          f"{limit} tokens: shorten it to at most {limit - 1}")
    if len(ids) + args.max_new_tokens > limit:
        print(f"colonnade: generating {limit - len(ids)} tokens, not {args.max_new_tokens}: the "
              f"prompt's {len(ids)} and the new ones fill the model's context ({limit})",
              file=sys.stderr)
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, use_cache=not args.no_cache,
                   generator=gen)
    print(tok.decode(out[0].cpu().tolist()))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from colonnade.checkpoint import convert

    if args.from_hf and args.dtype:
        print("colonnade: --dtype applies to --to-hf only; --from-hf keeps the HF tensors' "
              "dtype", file=sys.stderr)
        return 2
    if args.from_hf:
        print(convert.describe(convert.from_hf(args.from_hf, args.out, progress=True)))
    else:
        from colonnade.hf_export import to_hf

        print(f"wrote {to_hf(args.to_hf, args.out, args.dtype, progress=True)}")
    return 0


def _failure_status(err: BaseException) -> int | None:
    """Exit status of an expected failure printed as one line (bad input 2, NaN/Inf 1), or None
    for anything else (a bug: let its traceback show)."""
    from colonnade.launch import expected_failure

    return expected_failure(err)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``colonnade`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    overrides = [a for a in rest if a.startswith("--") and "." in a.split("=", 1)[0]]
    unknown = [a for a in rest if a not in overrides]
    if unknown:
        parser.error(f"unrecognised arguments: {' '.join(unknown)} (config fields look like "
                     "--section.field=value; see `colonnade train --help-config`)")
    from colonnade.reliability.interrupt import Terminated, sigterm_interrupts

    try:
        with sigterm_interrupts():  # SIGTERM cleans up as Ctrl-C does (temporary files)
            return _run(args, overrides, rest, parser)
    except ConfigError as err:
        print(f"colonnade: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # outside the training loop (which saves and returns)
        name, status = ("SIGTERM", 143) if isinstance(err, Terminated) else ("Ctrl-C", 130)
        print(f"colonnade: interrupted ({name}) during `{args.command}` (nothing to save yet)",
              file=sys.stderr)
        return status
    except Exception as err:
        status = _failure_status(err)
        if status is None:
            raise
        print(f"colonnade: {type(err).__name__}: {err}", file=sys.stderr)
        return status


def _run(args: argparse.Namespace, overrides: list[str], rest: list[str],
         parser: argparse.ArgumentParser) -> int:
    """Run the parsed command; its exit status."""
    if args.command == "train":
        return _train(args, overrides)
    if args.command == "prepare":
        from colonnade.training.setup import prepare_data

        prepare_data(_load(args, overrides))
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "plot":
        from colonnade.plot import plot_runs

        print(f"wrote {plot_runs(args.runs, args.out)}")
        return 0
    if args.command == "convert":
        return _convert(args)
    if args.command == "bench":
        from colonnade.bench import run_bench

        return run_bench(args.name, args.args + rest)
    if args.command == "plan":
        from colonnade.analysis.cli import run_plan

        return run_plan(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
