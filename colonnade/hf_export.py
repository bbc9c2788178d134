"""``colonnade convert --to-hf``: a Colonnade checkpoint as a Hugging Face model directory that
``transformers`` loads, tokenizes and generates from without a warning.

It sits on top (beside ``cli.py``), as it reads a checkpoint (:mod:`colonnade.checkpoint`) and
its tokenizer (:mod:`colonnade.data.tokenizer`). ``--to-hf CKPT --out DIR [--dtype
bf16|fp16|fp32]`` writes

* ``config.json``: the architecture (:func:`~colonnade.checkpoint.hf.hf_config_from_model`),
  ``dtype`` / ``torch_dtype``, and ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``;
* ``generation_config.json``: the same three ids, so ``generate`` stops at the end of a
  document and pads with a real token;
* ``model.safetensors`` in the chosen dtype;
* the tokenizer: ``tokenizer.json`` as trained or imported, plus ``tokenizer_config.json``
  (``tokenizer_class`` ``PreTrainedTokenizerFast``, which reads ``tokenizer.json`` as it is) and
  ``special_tokens_map.json``.

Special tokens: Colonnade separates documents with one end-of-document token
(:func:`colonnade.data.tokenizer.eod_id`), so eos, bos and pad are all that token, as for GPT-2.
A checkpoint imported from HF keeps its own ``tokenizer_config.json`` (chat template, bos token
...); keys it lacks are filled in, and the ids in ``config.json`` follow its tokens. Without
these ids transformers falls back to GPT-2's 50256 and warns that it is out of vocabulary.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from colonnade.checkpoint.commit import resolve_checkpoint
from colonnade.checkpoint.convert import read_full_model
from colonnade.checkpoint.format import CheckpointError
from colonnade.checkpoint.hf import TOKENIZER_FILES, hf_config_from_model, to_hf_state
from colonnade.config.sections import ModelConfig
from colonnade.data.tokenizer import eod_id, load_tokenizer
from colonnade.models.build import DTYPES

EXPORT_DTYPES: dict[str, torch.dtype] = {k: DTYPES[k] for k in ("fp32", "bf16", "fp16")}
"""``--dtype`` values of ``colonnade convert --to-hf`` and the tensor dtype each writes."""

SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token")
"""Special-token roles written to tokenizer_config.json and special_tokens_map.json."""


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(tokenizer_dir: Path, model: ModelConfig) -> tuple[dict[str, Any],
                                                                      dict[str, int]]:
    """(tokenizer_config.json contents, {bos/eos/pad_token_id}) of the tokenizer in
    ``tokenizer_dir``: an existing tokenizer_config.json completed, else one naming the EOD token
    for every role, with ``model_max_length`` = model.max_seq_len. Every id must lie inside the
    model's vocabulary."""
    tok = load_tokenizer(tokenizer_dir / "tokenizer.json")
    eod = tok.id_to_token(eod_id(tok))
    src = tokenizer_dir / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(src.read_text()) if src.exists() else {}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("eos_token", eod)
    config.setdefault("bos_token", _token_text(config["eos_token"]))
    config.setdefault("pad_token", _token_text(config["eos_token"]))
    config.setdefault("clean_up_tokenization_spaces", False)
    config.setdefault("model_max_length", model.max_seq_len)
    ids: dict[str, int] = {}
    for role in SPECIAL_ROLES:
        text = _token_text(config[role])
        tid = tok.token_to_id(text) if text is not None else None
        if tid is None:
            raise CheckpointError(f"{src}: {role} {text!r} is not in tokenizer.json; fix or "
                                  "delete tokenizer_config.json")
        if tid >= model.vocab_size:
            raise CheckpointError(f"{tokenizer_dir}/tokenizer.json: {role} {text!r} has id "
                                  f"{tid}, outside model.vocab_size={model.vocab_size}; the "
                                  "tokenizer does not belong to this model")
        ids[f"{role}_id"] = tid
    return config, ids


def write_tokenizer(directory: Path, tokenizer_dir: Path, config: dict[str, Any]) -> None:
    """Copy the tokenizer files of ``tokenizer_dir``; write tokenizer_config.json (``config``,
    from :func:`special_tokens`) and special_tokens_map.json."""
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.exists() and name not in ("tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(src, directory / name)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {role: config[role] for role in SPECIAL_ROLES}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def write_hf(directory: str | Path, cfg: ModelConfig, full: dict[str, torch.Tensor],
             tokenizer_dir: str | Path | None = None, dtype: str | None = None) -> Path:
    """Write config.json, generation_config.json, model.safetensors (cast to ``dtype``, a key
    of EXPORT_DTYPES; None keeps the stored dtype) and the tokenizer of ``tokenizer_dir`` (none
    when it holds no tokenizer.json: the special ids are then null). Everything is checked
    before the first file is written."""
    _check_dtype(dtype)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    tok_config: dict[str, Any] | None = None
    ids: dict[str, int | None] = dict.fromkeys(f"{r}_id" for r in SPECIAL_ROLES)
    if tok_dir is not None and (tok_dir / "tokenizer.json").exists():
        tok_config, found = special_tokens(tok_dir, cfg)
        ids.update(found)
    state = to_hf_state(cfg, full)
    if dtype is not None:
        state = {k: v.to(EXPORT_DTYPES[dtype]) for k, v in state.items()}
    torch_dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    hf_config = {**hf_config_from_model(cfg, torch_dtype), **ids}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(ids, indent=2))
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if tok_dir is not None and tok_config is not None:
        write_tokenizer(directory, tok_dir, tok_config)
    return directory


def _check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is unknown; use one of {', '.join(EXPORT_DTYPES)}")


def to_hf(path: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Colonnade checkpoint (root or step directory) -> HF directory ``out``, tensors cast to
    ``dtype`` (a key of EXPORT_DTYPES; None keeps the stored dtype). An ``out`` that already
    holds a model is refused before anything is read or written."""
    _check_dtype(dtype)
    taken = sorted(p.name for p in Path(out).glob("*") if p.name == "config.json"
                   or p.name.startswith("model")) if Path(out).is_dir() else []
    if taken:
        raise CheckpointError(f"{out} already holds an exported model ({', '.join(taken)}); "
                              "pass a new --out directory or delete the old export first")
    ckpt = resolve_checkpoint(path)
    config, full = read_full_model(ckpt)
    model: ModelConfig = config.model
    out = Path(out)
    if out.exists():  # an empty or unrelated directory: the files go in beside what is there
        return write_hf(out, model, full, ckpt, dtype)
    tmp = out.with_name(f".{out.name}.tmp")  # a new directory appears whole or not at all
    shutil.rmtree(tmp, ignore_errors=True)
    write_hf(tmp, model, full, ckpt, dtype)
    os.replace(tmp, out)
    return out
