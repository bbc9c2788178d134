"""Checks and decisions made before any rank starts, reading files and writing none.

``colonnade train`` (and every rank again, under torchrun) runs :func:`preflight` after the
config is validated, so a run that would be refused changes no file and starts no process:

* data (:func:`data_plan`): ``train`` prepares only what it is told to. With ``data.input`` it
  prepares (or reuses) that input in ``data.prepared_dir``; without it, an existing prepared
  dir is used as it is, whatever it was built from, and only the built-in locations
  (:data:`BUILTIN_PREPARED_DIRS`) are built from the built-in corpus. A missing prepared dir,
  or one built otherwise (other inputs, text keys, tokenizer, vocab size or format:
  :mod:`colonnade.data.manifest`), is an error naming the difference and the fix
  (``data.overwrite`` rebuilds).
* datasets used as they are open cleanly; the data's tokenizer is the one the checkpoints to
  resume were trained with (checked before the resume decision, so a rebuilt prepared dir is
  named as the cause, not the model fields it forces), and it fits ``model.vocab_size``.
* checkpoints: auto-resume from ``checkpoint.save`` or refuse another run's checkpoints
  (:func:`colonnade.reliability.startup.resume_config`), and an LR schedule change on resume
  (:func:`colonnade.checkpoint.training_state.preflight_resume`).

Right after it, before anything is written or started, the callers (``colonnade train`` and
``colonnade.train`` on every rank) check ``training.memory_limit_gb`` against the planner's
memory model (:func:`colonnade.analysis.memory_limit.check_memory_limit`; analysis sits above
training in the layer order, so the check is not made from here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colonnade.config.data_paths import blend_entries
from colonnade.config.sections import Config, DataConfig
from colonnade.data.errors import DataError

DEFAULT_PREPARED_DIR = DataConfig().prepared_dir
"""The default prepared dir, where the built-in corpus goes."""
BUILTIN_PREPARED_DIRS = (DEFAULT_PREPARED_DIR, "data/stdlib-2k")
"""Where the built-in corpus is prepared (the default, and configs/demo.toml / tiny-*.toml): the
only prepared dirs `train` builds without data.input (relative to the working directory)."""


@dataclass(frozen=True)
class DataPlan:
    """What ``train`` does with ``data.prepared_dir``: 'prepare' it (or reuse a matching
    build) or 'use' it as it is."""

    action: str
    prepared_dir: Path
    tokenizer: Path | None
    """The tokenizer.json the run will train with (None: a BPE trained by prepare)."""


def read_manifest(prepared_dir: Path) -> dict[str, Any] | None:
    """prepare.json of a prepared dir, or None when absent or unreadable."""
    try:
        data = json.loads((Path(prepared_dir) / "prepare.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _recorded_input(manifest: dict[str, Any]) -> str | None:
    value = manifest.get("key", {}).get("input")
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return None if value is None else str(value)


def _is_default(path: Path) -> bool:
    return any(path.resolve() == Path(p).resolve() for p in BUILTIN_PREPARED_DIRS)


def prepare_vocab(config: Config) -> int | None:
    """The vocab size `prepare` is asked for: None with data.tokenizer (the tokenizer defines
    the vocabulary; train checks it fits); else model.vocab_size for the BPE it trains. Unset,
    that is the size of the BPE data.prepared_dir already holds for this same input (a re-run
    without --model.vocab_size reuses that build rather than being refused for a size it never
    asked for), else the default (ModelConfig.vocab)."""
    if config.data.tokenizer:
        return None
    if config.model.vocab_size is None and (manifest := read_manifest(
            Path(config.data.prepared_dir))) is not None:
        from colonnade.data.manifest import trained_vocab

        return trained_vocab(manifest, config.data) or config.model.vocab
    return config.model.vocab


def check_prepare_target(config: Config) -> list[str]:
    """Refuse to prepare into a prepared dir that holds another dataset: its manifest records
    other inputs, text keys, tokenizer, vocab size or format (:mod:`colonnade.data.manifest`),
    or it holds files but no manifest; unless data.overwrite, for which the differences are
    returned (for the log; empty when the build is the same one)."""
    from colonnade.data.manifest import differences

    data = config.data
    out = Path(data.prepared_dir)
    if not out.exists():
        return []
    manifest = read_manifest(out)
    if manifest is None:
        if out.is_dir() and any(out.iterdir()) and not _is_default(out) and not data.overwrite:
            raise DataError(
                f"data.prepared_dir='{out}' holds files but no prepare.json, so it is not a "
                "dataset Colonnade built; refusing to write into it. Pick a new (empty) "
                "--data.prepared_dir, or set --data.overwrite=true to use it anyway.")
        return []
    found = differences(manifest, data, prepare_vocab(config), out)
    if found and not data.overwrite:
        raise DataError(
            f"data.prepared_dir='{out}' holds a dataset prepared {'; and '.join(found)}; "
            "refusing to overwrite it. Pick another --data.prepared_dir for this run, "
            + ("train on it as it is by leaving data.input unset, " if data.input else "")
            + "or set --data.overwrite=true to rebuild it (replacing that dataset).")
    return found


def data_plan(config: Config) -> DataPlan:
    """Decide what ``train`` does with the data (reads files, writes none); raises
    :class:`DataError` with the fix when the prepared dir is missing or is another dataset."""
    data = config.data
    out = Path(data.prepared_dir)
    manifest = read_manifest(out)
    given_tok = Path(data.tokenizer) if data.tokenizer else None
    if given_tok is not None and given_tok.is_dir():
        given_tok = given_tok / "tokenizer.json"
    if data.input is not None:
        check_prepare_target(config)
        return DataPlan("prepare", out, given_tok)
    built = (out / "tokenizer.json").is_file() and (out / "data.idx").is_file()
    if _is_default(out) and (manifest is None or _recorded_input(manifest) is None):
        return DataPlan("prepare", out, given_tok)  # the built-in corpus (make demo)
    if manifest is not None or built:
        return DataPlan("use", out, out / "tokenizer.json")
    inner = (f" {out.parent} holds one ({out} is its data.bin/.idx prefix): did you mean "
             f"--data.prepared_dir={out.parent}? (data.prepared_dir names the directory; a "
             "data.blend entry may name either.)"
             if out.name == "data" and (out.parent / "data.idx").is_file() else "")
    raise DataError(
        f"data.prepared_dir='{out}' holds no prepared dataset (no prepare.json); nothing to "
        f"train on.{inner} Prepare it first (`colonnade prepare --data.input=YOUR_TEXT "
        f"--data.prepared_dir={out}`), or pass --data.input=YOUR_TEXT to prepare it now, or "
        f"fix the path (the built-in corpus goes to {' or '.join(BUILTIN_PREPARED_DIRS)}).")


def _tokenizer_origin(plan: DataPlan) -> str:
    """Where the prepared dir's tokenizer came from, per its manifest (for messages)."""
    manifest = read_manifest(plan.prepared_dir) if plan.action == "use" else None
    if manifest is None:
        return ""
    given = manifest.get("tokenizer") or manifest.get("key", {}).get("tokenizer_sha256")
    return (f" (data.prepared_dir='{plan.prepared_dir}' was prepared with "
            + (f"the tokenizer {given})" if given else "a byte-level BPE that prepare trained "
               f"with vocab_size={manifest.get('key', {}).get('vocab_size')})"))


def check_vocab(config: Config, plan: DataPlan) -> None:
    """The tokenizer the run will use must fit model.vocab_size (before anything is written);
    the error names where that tokenizer came from."""
    if (plan.tokenizer is None or not plan.tokenizer.is_file()
            or config.model.vocab_size is None):  # unset: the tokenizer's (training/vocab.py)
        return
    from colonnade.data import load_tokenizer

    vocab = load_tokenizer(plan.tokenizer).get_vocab_size()
    if vocab > config.model.vocab_size:
        raise DataError(
            f"the tokenizer {plan.tokenizer} has {vocab} tokens but model.vocab_size="
            f"{config.model.vocab_size}{_tokenizer_origin(plan)}; set "
            f"--model.vocab_size={vocab} (or larger) for a model of this data, or point "
            "--data.prepared_dir at data prepared with a tokenizer that fits.")


def check_tokenizer_history(config: Config) -> None:
    """Refuse data tokenized otherwise than the checkpoints the run would resume: those under
    checkpoint.save when checkpoint.on_existing is 'auto' or 'resume' (their tokenizer.json
    against the data's). Run before the resume decision, so that data rebuilt with another
    tokenizer is named as the cause rather than the model.vocab_size change it forces (whose
    own fix would be to delete the checkpoints)."""
    from colonnade.checkpoint.finetune import tokenizer_digest
    from colonnade.reliability.startup import latest_checkpoint

    ck, data = config.checkpoint, config.data
    latest = latest_checkpoint(ck.save) if ck.on_existing in ("auto", "resume") else None
    theirs = None if latest is None else latest / "tokenizer.json"
    if theirs is None or not theirs.is_file():
        return
    plan = data_plan(config)
    ours = plan.tokenizer if plan.action == "use" or data.tokenizer else None
    ours = ours or plan.prepared_dir / "tokenizer.json"
    if not ours.is_file() or tokenizer_digest(ours) == tokenizer_digest(theirs):
        return
    from colonnade.data import load_tokenizer

    n_ours, n_theirs = (load_tokenizer(p).get_vocab_size() for p in (ours, theirs))
    source = f"--data.input={data.input}" if data.input else "--data.input=YOUR_TEXT"
    saved = _saved_prepared_dir(latest)
    cause = ("was prepared again with another tokenizer since they were written"
             if saved is None or saved == plan.prepared_dir.resolve() else
             f"is not the data they were trained on (data.prepared_dir='{saved}')")
    if data.tokenizer and plan.action == "prepare":
        cause = f"is prepared with --data.tokenizer={data.tokenizer}"
    raise DataError(
        f"the data's tokenizer {ours} ({n_ours} tokens) is not the one the checkpoints under "
        f"checkpoint.save={ck.save} were trained with ({theirs}, {n_theirs} tokens): "
        f"data.prepared_dir='{plan.prepared_dir}' {cause}, so its token ids mean other text "
        f"to them{_tokenizer_origin(DataPlan('use', plan.prepared_dir, ours))}. To continue that "
        f"run, prepare the text with its tokenizer into a new dir (`colonnade prepare "
        f"{source} --data.tokenizer={theirs} --data.prepared_dir=NEW_DIR`) and train with "
        "--data.prepared_dir=NEW_DIR; to train a new model on this data, pick a new "
        f"--checkpoint.save (with --model.vocab_size={n_ours} or larger).")


def _saved_prepared_dir(ckpt: Path) -> Path | None:
    """data.prepared_dir of the run that wrote checkpoint ``ckpt`` (absolute), when recorded."""
    from colonnade.config.load import ConfigError, load_config

    try:
        return Path(load_config(ckpt / "config.toml").data.prepared_dir).resolve()
    except (ConfigError, OSError):
        return None


def check_datasets(config: Config, plan: DataPlan) -> None:
    """Open the indexed datasets the run will read as they are (the prepared dir when used as
    is, every data.blend prefix): a damaged one fails here, in one line, not in every rank."""
    from colonnade.data import IndexedDataset

    prefixes = [prefix for _, prefix in blend_entries(config.data.blend)]
    if plan.action == "use":
        prefixes.append(plan.prepared_dir / "data")
    for prefix in prefixes:
        IndexedDataset(prefix)


def finished_step(config: Config) -> int | None:
    """The step of the checkpoint a resume starts from when it already reached training.steps
    (a re-run of a finished run: nothing to launch), else None."""
    from colonnade.checkpoint.commit import resolve_checkpoint
    from colonnade.checkpoint.format import CheckpointError

    if not config.checkpoint.load:
        return None
    try:
        meta = json.loads((resolve_checkpoint(config.checkpoint.load) / "metadata.json")
                          .read_text())
        step = int(meta["step"])
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return None
    return step if step >= config.training.steps else None


def preflight(config: Config, world: int) -> tuple[Config, list[str]]:
    """Every check and decision before launch; returns (the config to run, notes to log).

    Raises ConfigError / DataError / CheckpointError naming the fix; writes no file."""
    from colonnade.checkpoint.training_state import preflight_resume
    from colonnade.config.load import ConfigError
    from colonnade.config.validate import resolve, resolve_save, validate
    from colonnade.reliability.startup import resume_config
    from colonnade.training.vocab import resolve_vocab

    config = resolve_save(config)  # checkpoint.save='auto': <logging.dir>/checkpoints
    check_tokenizer_history(config)  # before resume_config's model/data comparison
    config, note = resume_config(config, 0)
    try:
        config = validate(resolve(config, world), world)
    except ConfigError as err:
        if "global batch" not in note or config.training.global_batch_size is None:
            raise
        raise ConfigError(
            f"{err}\n  (training.global_batch_size={config.training.global_batch_size} is the "
            "resumed checkpoint's: a resume keeps it so the data order stays exact. Pick a "
            "layout whose micro_batch_size x dp divides it, or set "
            "--training.global_batch_size to change it.)") from None
    plan = data_plan(config)
    check_datasets(config, plan)
    config = resolve_vocab(config, plan.tokenizer)  # model.vocab_size unset: the tokenizer's
    check_vocab(config, plan)
    preflight_resume(config)
    return config, [note] if note else []
