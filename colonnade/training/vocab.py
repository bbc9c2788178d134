"""The model's vocabulary size from the data's tokenizer.

``model.vocab_size`` unset (the default) means the tokenizer's size. ``train`` sets it where the
size is first known: before launch when the tokenizer exists (:func:`resolve_vocab`, from
:func:`colonnade.training.preflight.preflight`: a given tokenizer, a prepared dir, or the
checkpoint a run resumes), else in every rank once the data is prepared
(:func:`with_tokenizer_vocab`, from :func:`colonnade.training.loop.train`). A set size below the
tokenizer's is refused (:func:`colonnade.training.preflight.check_vocab`); one above it by more
than deliberate padding is warned about (:func:`vocab_warning`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from colonnade.config.sections import VOCAB_PAD_MULTIPLE, Config, ModelConfig


def tokenizer_size(path: Path) -> int:
    """Tokens of a tokenizer.json (its added special tokens included)."""
    from colonnade.data import load_tokenizer

    return load_tokenizer(path).get_vocab_size()


def with_tokenizer_vocab(config: Config, tokens: int) -> Config:
    """``config`` with model.vocab_size = ``tokens``, the tokenizer's size, when it is unset;
    unchanged when it is set."""
    if config.model.vocab_size is not None:
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                 vocab_size=tokens))


def _checkpoint_vocab(load: str) -> int | None:
    """model.vocab_size recorded in the metadata of the checkpoint ``load`` names, if any."""
    from colonnade.checkpoint.commit import METADATA, resolve_checkpoint
    from colonnade.checkpoint.format import CheckpointError

    try:
        meta = json.loads((resolve_checkpoint(load) / METADATA).read_text())
        return int(meta["model"]["vocab_size"])
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return None  # not a Colonnade checkpoint, or an old one: the loader says what is wrong


def resolve_vocab(config: Config, tokenizer: Path | None) -> Config:
    """model.vocab_size unset: a resume's checkpoint's (checkpoint.load; its tokenizer is the
    data's, checked apart), else the size of ``tokenizer`` (the tokenizer.json the run will
    train with) when it exists; unchanged when neither is known yet (a BPE still to train)."""
    if config.model.vocab_size is not None:
        return config
    saved = _checkpoint_vocab(config.checkpoint.load) if config.checkpoint.load else None
    if saved is not None:
        return with_tokenizer_vocab(config, saved)
    if tokenizer is not None and tokenizer.is_file():
        return with_tokenizer_vocab(config, tokenizer_size(tokenizer))
    return config


def padded_size(tokens: int, tp: int) -> int:
    """The largest model.vocab_size taken as deliberate padding of a ``tokens``-token
    vocabulary: ``tokens`` rounded up to a multiple of 128 x tp (Megatron's
    make-vocab-size-divisible-by)."""
    multiple = VOCAB_PAD_MULTIPLE * max(1, tp)
    return -(-tokens // multiple) * multiple


def vocab_warning(model: ModelConfig, tokens: int, tp: int) -> str | None:
    """The warning of a model.vocab_size above :func:`padded_size` of the tokenizer's
    ``tokens`` (None when it is not): the rows no token uses, their parameters, and the first
    loss they cost (about ln V at initialisation instead of ln tokens)."""
    size = model.vocab_size
    if size is None or size <= padded_size(tokens, tp):
        return None
    extra = size - tokens
    params = extra * model.hidden_size * (1 if model.tie_embeddings else 2)
    return (f"model.vocab_size={size} but the tokenizer has {tokens} tokens: {extra} embedding"
            f"{'' if model.tie_embeddings else ' and output-head'} rows ({params:,} "
            "parameters) belong to no token, and the untrained model's loss starts near "
            f"ln {size} = {math.log(size):.2f} instead of ln {tokens} = {math.log(tokens):.2f}; "
            "unset model.vocab_size (--model.vocab_size=none) to take the tokenizer's size (up to "
            f"{padded_size(tokens, tp)}, a multiple of {VOCAB_PAD_MULTIPLE} x tp, is taken as "
            "deliberate padding).")


def with_data_vocab(config: Config, world: int, tokens: int, is_logger: bool) -> Config:
    """``config`` with model.vocab_size unset taken from the data's tokenizer (``tokens``: its
    size; first known here when `prepare` has just trained the BPE), validated again for
    ``world`` ranks; the logging rank warns on stderr of a set size beyond the tokenizer's
    padding."""
    from colonnade.config.validate import validate

    config = validate(with_tokenizer_vocab(config, tokens), world)
    note = vocab_warning(config.model, tokens, config.parallel.tp)
    if note and is_logger:
        print(f"colonnade: warning: {note}", file=sys.stderr, flush=True)
    return config
