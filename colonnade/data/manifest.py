"""What a prepared dir was built from, and how another build would differ (`prepare.json`).

`colonnade prepare` records in `prepare.json` a key of everything its outputs depend on
(:func:`colonnade.data.prepare._manifest_key`). Part of that key decides what the token ids
*mean*: the build's :class:`Identity` (the inputs and the key each is read under, the tokenizer,
the format). A re-run whose identity differs would replace the dataset with another one (a
model trained on the old ids would read the new ones as other text), so it is refused unless
``data.overwrite`` (:func:`colonnade.training.preflight.check_prepare_target`). The rest of the
key (the input files' sizes and times, ``data.errors``, the built-in corpus cap) only says
whether the same dataset must be tokenized again: that rebuild goes ahead, and says why.

Tokenizers compare by what they are: a BPE that `prepare` trained is the same as a given
tokenizer.json with the same bytes as the one it saved (so passing back the prepared
tokenizer with data.tokenizer is not refused: the input is tokenized again, to the same ids).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colonnade.config.data_paths import input_sources, normalize_input
from colonnade.config.sections import DataConfig


@dataclass(frozen=True)
class Identity:
    """What the token ids of a build mean (see the module docstring)."""

    paths: tuple[str, ...] | None
    """The input's parts, absolute (globs as patterns); None: the built-in corpus."""
    text_keys: tuple[str, ...]
    """The key each part's records are read under (format 'text'), else ()."""
    tokenizer_sha256: str | None
    """sha256 of the given tokenizer.json's bytes; None: a byte-level BPE that prepare trains."""
    vocab_size: int | None
    """The vocab size asked of that BPE (None with a given tokenizer)."""
    sft: tuple[str, str] | None
    """(prompt_key, response_key) of data.format='sft'; None: data.format='text'."""


def file_sha256(path: Path) -> str:
    """sha256 of a tokenizer.json's bytes (a directory: its tokenizer.json; 'missing')."""
    path = path / "tokenizer.json" if path.is_dir() else path
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


def _identity(input_spec: str | None, text_key: str, tok_sha: str | None, vocab: int | None,
              sft: tuple[str, str] | None) -> Identity:
    if input_spec is None:
        return Identity(None, (), tok_sha, vocab, sft)
    sources = input_sources(input_spec)
    keys = () if sft is not None else tuple(k or text_key for _, k in sources)
    return Identity(tuple(p for p, _ in sources), keys, tok_sha, vocab, sft)


def recorded_identity(key: dict[str, Any]) -> Identity:
    """The identity of a build from its manifest key."""
    sft = key.get("sft")
    pair = (str(sft.get("prompt_key")), str(sft.get("response_key"))) \
        if isinstance(sft, dict) else None
    value = key.get("input")
    if isinstance(value, list):  # manifest version 1: a list of paths
        value = ",".join(map(str, value))
    return _identity(None if value is None else str(value), str(key.get("text_key") or ""),
                     key.get("tokenizer_sha256"), key.get("vocab_size"), pair)


def planned_identity(data: DataConfig, vocab_size: int | None) -> Identity:
    """The identity `colonnade prepare` would give data.prepared_dir with this config and
    `vocab_size` (that of the BPE it would train; None when data.tokenizer is given)."""
    spec = normalize_input(data.input) if data.input else None
    tok_sha = file_sha256(Path(data.tokenizer)) if data.tokenizer else None
    sft = (data.prompt_key, data.response_key) if data.format == "sft" else None
    return _identity(spec, data.text_key, tok_sha, vocab_size, sft)


def trained_vocab(manifest: dict[str, Any], data: DataConfig) -> int | None:
    """The vocab size of the byte-level BPE that the build recorded in `manifest` trained, when
    that build read the same input, keys and format as `data` would; else None."""
    old = recorded_identity(manifest.get("key", {}))
    new = planned_identity(data, None)
    same = (old.paths, old.text_keys, old.sft) == (new.paths, new.text_keys, new.sft)
    return old.vocab_size if same and old.tokenizer_sha256 is None else None


def _describe_input(paths: tuple[str, ...] | None) -> str:
    return "the built-in corpus (no data.input)" if paths is None else f"'{','.join(paths)}'"


def _same_tokenizer(old: Identity, new: Identity, out_dir: Path) -> bool:
    if old.tokenizer_sha256 is None and new.tokenizer_sha256 is None:
        return old.vocab_size == new.vocab_size
    if new.tokenizer_sha256 is not None and old.tokenizer_sha256 is None:
        return new.tokenizer_sha256 == file_sha256(out_dir / "tokenizer.json")
    return old.tokenizer_sha256 == new.tokenizer_sha256


def _old_tokenizer(old: Identity, manifest: dict[str, Any]) -> str:
    tokens = manifest.get("result", {}).get("vocab_size")
    size = f", {tokens} tokens" if tokens is not None else ""
    if old.tokenizer_sha256 is None:
        return f"a byte-level BPE it trained (vocab_size={old.vocab_size}{size})"
    where = manifest.get("tokenizer") or f"sha256 {old.tokenizer_sha256[:12]}"
    return f"the tokenizer {where} (given with data.tokenizer{size})"


def _new_tokenizer(new: Identity, data: DataConfig) -> str:
    if new.tokenizer_sha256 is None:
        return (f"this run would train a byte-level BPE (vocab_size={new.vocab_size}, "
                "model.vocab_size) as data.tokenizer is unset")
    return f"this run gives --data.tokenizer={data.tokenizer}"


def differences(manifest: dict[str, Any], data: DataConfig, vocab_size: int | None,
                out_dir: Path) -> list[str]:
    """How the build recorded in `manifest` differs in identity from the one `data` (and
    `vocab_size`, see :func:`planned_identity`) would make in `out_dir`, one clause each
    ("prepared from 'a', not from 'b'"); empty when the tokens would mean the same."""
    old = recorded_identity(manifest.get("key", {}))
    new = planned_identity(data, vocab_size)
    out = []
    if old.paths != new.paths:
        out.append(f"from {_describe_input(old.paths)}, not from {_describe_input(new.paths)}")
    if (old.sft is None) != (new.sft is None):
        was = "sft" if old.sft is not None else "text"
        now = "sft" if new.sft is not None else "text"
        out.append(f"as data.format='{was}', where this run asks data.format='{now}'")
    elif old.sft != new.sft and old.sft is not None and new.sft is not None:
        out.append(f"with data.prompt_key='{old.sft[0]}', data.response_key='{old.sft[1]}', "
                   f"where this run reads '{new.sft[0]}', '{new.sft[1]}'")
    if old.paths == new.paths and old.text_keys and new.text_keys:
        for path, was, now in zip(new.paths or (), old.text_keys, new.text_keys, strict=True):
            if was != now:
                out.append(f"reading the text of {path} under key '{was}', where this run "
                           f"reads '{now}'")
    if not _same_tokenizer(old, new, out_dir):
        out.append(f"with {_old_tokenizer(old, manifest)}, where {_new_tokenizer(new, data)}"
                   + _reuse_hint(old, manifest))
    return out


def _reuse_hint(old: Identity, manifest: dict[str, Any]) -> str:
    """The setting under which this run would reuse the recorded build's tokenizer."""
    if old.tokenizer_sha256 is None:
        return (f" (to reuse it, leave data.tokenizer unset with "
                f"--model.vocab_size={old.vocab_size})")
    given = manifest.get("tokenizer")
    return f" (to reuse it, pass --data.tokenizer={given})" if given else ""
