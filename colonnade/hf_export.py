"""``colonnade convert --to-hf``: a Colonnade checkpoint as a Hugging Face model directory that
``transformers`` loads, tokenizes and generates from without a warning.

It sits on top (beside ``cli.py``), as it reads a checkpoint (:mod:`colonnade.checkpoint`) and
its tokenizer (:mod:`colonnade.data.tokenizer`). ``--to-hf CKPT --out DIR [--dtype
bf16|fp16|fp32]`` writes

* ``config.json``: the architecture (:func:`~colonnade.checkpoint.hf.hf_config_from_model`),
  ``dtype`` / ``torch_dtype``, and ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``;
* ``generation_config.json``: the same three ids, so ``generate`` stops at the end of a
  document and pads with a real token;
* ``model.safetensors`` in the chosen dtype, streamed one HF tensor at a time
  (:func:`~colonnade.checkpoint.hf.hf_tensors`): each Colonnade tensor is read from the
  checkpoint's pieces when its HF tensor is written, so at most one HF tensor and one of its
  parts are in memory, never the whole model;
* the tokenizer: ``tokenizer.json`` as trained or imported, plus ``tokenizer_config.json``
  (``tokenizer_class`` ``PreTrainedTokenizerFast``, which reads ``tokenizer.json`` as it is) and
  ``special_tokens_map.json``.

Chat template: ``tokenizer_config.json`` always holds a ``chat_template``, so that
``AutoTokenizer.from_pretrained(out).apply_chat_template(messages, tokenize=False)`` returns the
text the model was fine-tuned on: the tokenizer's own template when it had one (an imported
tokenizer's, or the one ``prepare --data.format=sft`` applied, which the prepared data and the
checkpoint keep in their ``tokenizer_config.json``; a ``chat_template.jinja`` is folded into
the config), else :data:`colonnade.data.chat.BUILTIN_CHAT_TEMPLATE`, Colonnade's built-in
``"<role>: <content>\n"`` format.

Vocabulary: ``config.json``'s ``vocab_size`` is the model's ``model.vocab_size``, the rows of
its embedding and output head, as transformers requires. Unless ``model.vocab_size`` was set
larger (padding), that is the tokenizer's size; a padded model loads and generates in
transformers as Llama 3 / Qwen2 checkpoints do, whose ``vocab_size`` exceeds
``len(tokenizer)``: the rows past the tokenizer are never a training target, so their logits
are only pushed down, and they are exported as trained rather than cut (which would change
the softmax of every other token).

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colonnade.checkpoint.commit import resolve_checkpoint
from colonnade.checkpoint.export import gather_full
from colonnade.checkpoint.format import DTYPES as STORED_DTYPES
from colonnade.checkpoint.format import (
    TOKENIZER_FILES,
    CheckpointError,
    CheckpointReader,
    removed_on_failure,
)
from colonnade.checkpoint.hf import (
    ShapeOf,
    TensorGet,
    hf_config_from_model,
    hf_specs,
    hf_tensors,
    write_safetensors_stream,
)
from colonnade.config.load import load_config
from colonnade.config.sections import ModelConfig
from colonnade.data.chat import BUILTIN_CHAT_TEMPLATE, CHAT_TEMPLATE_FILE
from colonnade.data.tokenizer import eod_id, load_tokenizer
from colonnade.models.build import DTYPES
from colonnade.models.params import unique_params
from colonnade.parallel.groups import ProcessGroups

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
    for every role, with ``model_max_length`` = model.max_seq_len, and a ``chat_template``
    (the folder's ``chat_template.jinja``, else the config's own, else the built-in format's).
    Every id must lie inside the model's vocabulary."""
    tok = load_tokenizer(tokenizer_dir / "tokenizer.json")
    eod = tok.id_to_token(eod_id(tok))
    src = tokenizer_dir / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(src.read_text()) if src.exists() else {}
    if (tokenizer_dir / CHAT_TEMPLATE_FILE).is_file():  # transformers reads it before the key
        config["chat_template"] = (tokenizer_dir / CHAT_TEMPLATE_FILE).read_text()
    config.setdefault("chat_template", BUILTIN_CHAT_TEMPLATE)
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
        if tid >= model.vocab:
            raise CheckpointError(f"{tokenizer_dir}/tokenizer.json: {role} {text!r} has id "
                                  f"{tid}, outside model.vocab_size={model.vocab}; the "
                                  "tokenizer does not belong to this model")
        ids[f"{role}_id"] = tid
    return config, ids


def write_tokenizer(directory: Path, tokenizer_dir: Path, config: dict[str, Any]) -> None:
    """Copy the tokenizer files of ``tokenizer_dir``; write tokenizer_config.json (``config``,
    from :func:`special_tokens`) and special_tokens_map.json."""
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.exists() and name not in ("tokenizer_config.json", "special_tokens_map.json",
                                         CHAT_TEMPLATE_FILE):  # these three: from config
            shutil.copy(src, directory / name)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {role: config[role] for role in SPECIAL_ROLES}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def write_hf(directory: str | Path, cfg: ModelConfig,
             full: Mapping[str, torch.Tensor] | tuple[TensorGet, ShapeOf, torch.dtype],
             tokenizer_dir: str | Path | None = None, dtype: str | None = None,
             write: bool = True, progress: bool = False) -> Path:
    """Write config.json, generation_config.json, model.safetensors (cast to ``dtype``, a key
    of EXPORT_DTYPES; None keeps the stored dtype) and the tokenizer of ``tokenizer_dir`` (none
    when it holds no tokenizer.json: the special ids are then null). Everything is checked
    before the first file is written.

    ``full``: the full Colonnade tensors by key, or (get, shape_of, stored dtype) fetching
    each tensor on demand: model.safetensors is then streamed one HF tensor at a time.
    ``write=False`` (the other ranks of a collective ``get``): only drive ``get`` in the same
    order, write nothing. ``progress``: a bar of the bytes written, on a terminal."""
    _check_dtype(dtype)
    if isinstance(full, Mapping):
        values = full
        source: tuple[TensorGet, ShapeOf, torch.dtype] = (
            values.__getitem__, lambda k: tuple(values[k].shape),
            next(iter(values.values())).dtype)
    else:
        source = full
    get, shape_of, stored = source
    out_dtype = EXPORT_DTYPES[dtype] if dtype is not None else stored
    specs = hf_specs(cfg, shape_of, out_dtype)
    stream = ((n, t.to(out_dtype)) for n, t in hf_tensors(cfg, get, specs))
    directory = Path(directory)
    if not write:
        for _ in stream:
            pass
        return directory
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    tok_config: dict[str, Any] | None = None
    ids: dict[str, int | None] = dict.fromkeys(f"{r}_id" for r in SPECIAL_ROLES)
    if tok_dir is not None and (tok_dir / "tokenizer.json").exists():
        tok_config, found = special_tokens(tok_dir, cfg)
        ids.update(found)
    torch_dtype = str(out_dtype).removeprefix("torch.")
    hf_config = {**hf_config_from_model(cfg, torch_dtype), **ids}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(ids, indent=2))
    write_safetensors_stream(directory / "model.safetensors", specs, stream, progress=progress)
    if tok_dir is not None and tok_config is not None:
        write_tokenizer(directory, tok_dir, tok_config)
    return directory


def checkpoint_source(reader: CheckpointReader) -> tuple[TensorGet, ShapeOf, torch.dtype]:
    """(get, shape_of, dtype) of a checkpoint's model tensors: ``get`` reads one full tensor
    from its stored pieces (any layout and ZeRO stage) when asked."""
    def get(key: str) -> torch.Tensor:
        shape = reader.full_shape(f"model/{key}")
        return reader.read_box(f"model/{key}", ((0,) * len(shape), shape))

    def shape_of(key: str) -> tuple[int, ...]:
        return reader.full_shape(f"model/{key}")

    names = [n for n in reader.tensors if n.startswith("model/")]
    if not names:
        raise CheckpointError(f"{reader.directory}: no model tensors to export")
    return get, shape_of, STORED_DTYPES[reader.tensors[names[0]]["dtype"]]


def write_hf_from_run(out: str | Path, model: ModelConfig, chunks: list[nn.Module],
                      groups: ProcessGroups, ddp: Any = None,
                      tokenizer_dir: str | Path | None = None,
                      dtype: str | None = None) -> Path:
    """Export a live run's weights as an HF directory (collective: every rank calls it; world
    rank 0 writes). Each Colonnade tensor is rebuilt when its HF tensor is written and
    dropped after: ZeRO-3 ranges all-reduced over the shard group into its local tp shard
    (``DataParallel.local_param``), then gathered over tp, so no rank
    holds more than one HF tensor and one of its parts. pp > 1 is refused (a stage holds only
    its layers): save a checkpoint and ``colonnade convert --to-hf`` it."""
    if groups.pp.size > 1:
        raise ValueError(f"HF export from a live run needs parallel.pp=1 (this run has "
                         f"pp={groups.pp.size}); save a checkpoint (--checkpoint.save=DIR) "
                         "and run `colonnade convert --to-hf DIR --out OUT`")
    if ddp is not None:
        ddp.finish_param_gather()  # ZeRO-1/2 (a no-op at stage 3)
    params = {p.sharding.key: p for p in unique_params(chunks)}  # type: ignore[attr-defined]

    def get(key: str) -> torch.Tensor:
        p = params[key]
        local = p if ddp is None else ddp.local_param(p)
        return gather_full(local, p.sharding, groups.tp, groups.ep,  # type: ignore[attr-defined]
                           groups.expert_tp)

    def shape_of(key: str) -> tuple[int, ...]:
        return params[key].sharding.full_shape  # type: ignore[attr-defined]

    stored = next(iter(params.values())).dtype
    rank0 = groups.world.rank == 0
    return write_hf(out, model, (get, shape_of, stored), tokenizer_dir, dtype, write=rank0)


def _check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is unknown; use one of {', '.join(EXPORT_DTYPES)}")


def to_hf(path: str | Path, out: str | Path, dtype: str | None = None,
          progress: bool = False) -> Path:
    """Colonnade checkpoint (root or step directory) -> HF directory ``out``, tensors cast to
    ``dtype`` (a key of EXPORT_DTYPES; None keeps the stored dtype). An ``out`` that already
    holds a model is refused before anything is read or written. ``progress``: a bar of the
    bytes written (each tensor is read from the checkpoint as it is written), on a terminal."""
    _check_dtype(dtype)
    taken = sorted(p.name for p in Path(out).glob("*") if p.name == "config.json"
                   or p.name.startswith("model")) if Path(out).is_dir() else []
    if taken:
        raise CheckpointError(f"{out} already holds an exported model ({', '.join(taken)}); "
                              "pass a new --out directory or delete the old export first")
    ckpt = resolve_checkpoint(path)
    model: ModelConfig = load_config(ckpt / "config.toml").model
    try:  # a model its HF class cannot express (biases, windows...) is refused before writing
        hf_config_from_model(model)
    except ValueError as err:
        raise CheckpointError(f"{ckpt}: {err}") from err
    reader = CheckpointReader(ckpt)
    source = checkpoint_source(reader)
    out = Path(out)
    try:
        if out.exists():  # an empty or unrelated directory: the files go in beside what is there
            return write_hf(out, model, source, ckpt, dtype, progress=progress)
        tmp = out.with_name(f".{out.name}.tmp")  # a new directory appears whole or not at all
        shutil.rmtree(tmp, ignore_errors=True)
        with removed_on_failure(tmp):  # a failure or Ctrl-C leaves no hidden half-export
            write_hf(tmp, model, source, ckpt, dtype, progress=progress)
        os.replace(tmp, out)
        return out
    finally:
        reader.close()
