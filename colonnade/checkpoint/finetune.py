"""Fine-tuning: start a new run from the weights of another run or of a Hugging Face model.

``checkpoint.init_from`` (``colonnade train --init-from=PATH``) names a Colonnade checkpoint
(a save directory with ``latest``, or one ``step_N`` directory; ``colonnade convert --from-hf``
output too) or a Hugging Face ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` directory. The run takes

* the model: every ``[model]`` field the user did not set, from the checkpoint's
  ``metadata.json`` (or mapped from ``config.json``), resolved by :func:`with_init_from` where
  the config is read (``colonnade train`` before launch, ``colonnade.train`` in each torchrun
  rank), so validation sees the real shape. The run-time fields :data:`RUN_FIELDS` (dropout,
  init std) are always the run's own, and so is any field the user set that decides no tensor
  (``max_seq_len`` under RoPE: fine-tuning at a longer or shorter context, ``rope_theta``,
  ``norm_eps``, ...); a tensor-deciding field (:func:`decides_tensors`, gpt2's ``max_seq_len``
  among them) set explicitly (``--config`` or ``--model.*``) to another value is refused,
  naming it;
* the tokenizer: the checkpoint's ``tokenizer.json`` must be the data's (same content), or the
  run is refused with the fix (prepare the data with ``--data.tokenizer`` = that file);
* the weights, sharded into this run's layout (any tp / pp / dp, ZeRO-1);

and starts everything else fresh: step 0, new AdamW moments and step count (the LR schedule
from its warmup), the sampler at the first sample of the new data, RNG from training.seed.

``checkpoint.load`` keeps meaning exact resume (weights, optimizer, data position, LR). It
refuses an HF directory and a weights-only checkpoint, pointing at ``--init-from``. When both
are set (a re-run or restart of a fine-tuning run resumes its own checkpoints from
``checkpoint.save``: :func:`colonnade.reliability.startup.resume_config`), ``load`` wins and
``init_from`` only supplies the model shape. The same tokenizer check guards a resume and the
datasets of ``data.blend`` (whose tokenizer.json lies beside each prefix, as ``colonnade
prepare`` writes it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any

from colonnade.checkpoint.commit import METADATA, resolve_checkpoint
from colonnade.checkpoint.format import CheckpointError, CheckpointReader
from colonnade.checkpoint.hf import is_hf_dir, load_hf_into_chunks, model_config_from_hf
from colonnade.checkpoint.sharded import load_model, load_optimizer
from colonnade.checkpoint.state import TrainState
from colonnade.config.data_paths import blend_entries
from colonnade.config.load import ConfigError, config_from_dict, load_config, parse_overrides
from colonnade.config.sections import Config, DataConfig, ModelConfig
from colonnade.models.spec import ARCH_SPECS

RUN_FIELDS = ("hidden_dropout", "attention_dropout", "init_std", "moe_aux_loss_coeff",
              "moe_aux_loss_type", "moe_z_loss_coeff", "moe_capacity_factor",
              "moe_router_bias_update_rate")
"""[model] fields that belong to the run, not to the weights: never taken from a checkpoint
(dropout, init, and the mixture-of-experts training recipe: balancing losses, capacity, the
selection-bias rate)."""


def is_weights_only(meta: dict[str, Any]) -> bool:
    """A checkpoint without optimizer, LR or data state (``colonnade convert --from-hf``)."""
    return bool(meta.get("weights_only")) or "total_steps" not in (meta.get("optimizer") or {})


def weights_only_error(path: str | Path) -> CheckpointError:
    """The refusal of ``checkpoint.load`` on a checkpoint that holds weights only."""
    return CheckpointError(
        f"checkpoint.load={path} holds weights only (no optimizer, LR schedule or data "
        "position, e.g. written by `colonnade convert --from-hf`), so there is no run to "
        f"resume: start a new run from its weights with --init-from={path} "
        "(checkpoint.init_from) instead of checkpoint.load.")


def hf_load_error(path: str | Path) -> CheckpointError:
    """The refusal of ``checkpoint.load`` on a Hugging Face model directory."""
    return CheckpointError(
        f"checkpoint.load={path} is a Hugging Face model directory; checkpoint.load resumes a "
        "Colonnade run exactly (optimizer, data position, LR). To fine-tune from its weights, "
        f"with the model shape from its config.json, use --init-from={path} "
        "(checkpoint.init_from) instead.")


def _colonnade_meta(path: str | Path) -> tuple[Path, dict[str, Any]]:
    ckpt = resolve_checkpoint(path)
    return ckpt, json.loads((ckpt / METADATA).read_text())


def source_model(path: str | Path) -> ModelConfig:
    """The [model] section of a Colonnade checkpoint or an HF directory's config.json."""
    if is_hf_dir(path) and not (Path(path) / "latest").exists():
        if not list(Path(path).glob("model*.safetensors")):
            raise ConfigError(f"checkpoint.init_from={path} has no model*.safetensors (pickled "
                              ".bin weights are not loaded): re-save it with "
                              "save_pretrained(..., safe_serialization=True).")
        try:
            return model_config_from_hf(json.loads((Path(path) / "config.json").read_text()))
        except (ValueError, KeyError) as err:
            raise ConfigError(f"checkpoint.init_from={path}: {err}") from err
    try:
        ckpt, meta = _colonnade_meta(path)
        if "model" not in meta:  # older checkpoints: the [model] section of config.toml
            return load_config(ckpt / "config.toml").model
    except (CheckpointError, OSError, ValueError) as err:
        raise ConfigError(
            f"checkpoint.init_from={path} is neither a Colonnade checkpoint (a save directory "
            "with 'latest' or a step_N directory) nor a Hugging Face model directory "
            "(config.json naming one of the classes `colonnade convert --help` lists): "
            f"{err}") from err
    return config_from_dict({"model": meta["model"]}).model


def source_tokenizer(path: str | Path) -> Path | None:
    """The tokenizer.json stored with a checkpoint or an HF directory, if any."""
    if is_hf_dir(path) and not (Path(path) / "latest").exists():
        found = Path(path) / "tokenizer.json"
    else:
        found = resolve_checkpoint(path) / "tokenizer.json"
    return found if found.is_file() else None


def explicit_model_fields(config_file: str | Path | None, overrides: list[str]) -> set[str]:
    """[model] fields the user set: in the TOML file or as ``--model.field=value``."""
    fields = set(parse_overrides(overrides).get("model", {}))
    if config_file is not None and Path(config_file).is_file():
        with Path(config_file).open("rb") as fh:
            fields |= set(tomllib.load(fh).get("model", {}))
    return fields


def _comparable(model: ModelConfig, name: str) -> Any:
    """A field's value with its None default resolved (kv heads, ffn width)."""
    if name == "num_kv_heads":
        return model.kv_heads
    if name == "ffn_hidden_size":
        return model.ffn_size
    if name in MOE_SHAPE_FIELDS and not model.moe:
        return None  # a dense model: the MoE fields decide no tensor
    if name == "moe_ffn_hidden_size":
        return model.expert_ffn_size
    return getattr(model, name)


def with_init_from(config: Config, explicit: Collection[str] | None = None) -> Config:
    """``config`` with the [model] of ``checkpoint.init_from`` (unchanged when unset).

    ``explicit``: the model fields the user set (None: those differing from the defaults).
    Every field the user did not set is the checkpoint's. A field the user set keeps the
    user's value when it decides no tensor (:func:`decides_tensors`): a longer or shorter
    ``max_seq_len`` under RoPE, ``rope_theta``, ``norm_eps``, dropout, ... A tensor-deciding
    field set to another value than the checkpoint's raises :class:`ConfigError` naming it.
    An unset data.tokenizer may become the checkpoint's (:func:`_with_model_tokenizer`).
    Apply it once, where the config is read (``colonnade train``, ``colonnade.train``).
    """
    path = config.checkpoint.init_from
    if not path:
        return config
    if not Path(path).exists():
        raise ConfigError(f"checkpoint.init_from='{path}' does not exist; give a Colonnade "
                          "checkpoint (save directory or step_N directory) or a Hugging Face "
                          "model directory.")
    saved, mine, default = source_model(path), config.model, ModelConfig()
    conflicts, taken = [], {}
    for f in dataclasses.fields(ModelConfig):
        name = f.name
        if name in RUN_FIELDS:
            continue
        chosen = (name in explicit) if explicit is not None else (
            getattr(mine, name) != getattr(default, name))
        if not chosen:
            taken[name] = getattr(saved, name)
        elif decides_tensors(name, saved) and _comparable(mine, name) != _comparable(saved,
                                                                                      name):
            conflicts.append(f"model.{name}={_comparable(mine, name)} is set but "
                             f"checkpoint.init_from={path} has {_comparable(saved, name)}"
                             + (POSITION_TABLE_NOTE if name == "max_seq_len" else ""))
    if conflicts:
        raise ConfigError(
            "invalid configuration:\n" + "\n".join(f"  - {c}" for c in conflicts)
            + "\n  A fine-tuned model keeps the shapes of its checkpoint's tensors: drop these "
            "model settings (they are taken from the checkpoint).")
    return dataclasses.replace(config, model=dataclasses.replace(mine, **taken),
                               data=_with_model_tokenizer(config.data, path))


def _with_model_tokenizer(data: DataConfig, path: str) -> DataConfig:
    """``data`` with ``tokenizer`` set to the tokenizer.json of ``checkpoint.init_from`` when
    the run prepares its own input (data.input) into a prepared_dir that holds no dataset yet
    and data.tokenizer is unset: a fine-tune tokenizes as its model was trained (it trained a
    new BPE, wrote the dataset, then refused the mismatch). An existing prepared_dir keeps
    its identity checks (reusing it with another tokenizer is refused, naming the fix)."""
    if data.tokenizer is not None or not data.input:
        return data
    if (Path(data.prepared_dir) / "tokenizer.json").exists():
        return data
    found = source_tokenizer(path)
    return data if found is None else dataclasses.replace(data, tokenizer=str(found))


POSITION_TABLE_NOTE = (" (its learned position table has max_seq_len rows; a shorter "
                       "training.seq_len needs no change of max_seq_len)")
"""Why max_seq_len is a shape of a model with learned positions (gpt2), said in the refusal."""


MOE_SHAPE_FIELDS = ("moe_ffn_hidden_size", "moe_layer_freq", "moe_first_dense_layers",
                    "moe_router", "moe_shared_expert_ffn_hidden_size",
                    "moe_shared_expert_gate", "moe_router_bias")
"""[model] fields that decide tensors only when model.num_experts > 0."""
MLA_SHAPE_FIELDS = ("mla_q_lora_rank", "mla_kv_lora_rank", "mla_qk_nope_head_dim",
                    "mla_qk_rope_head_dim", "mla_v_head_dim", "mtp_layers")
"""[model] fields of multi-head latent attention's tensor widths (deepseek_v3) and the
multi-token-prediction modules' count."""
TENSOR_FIELDS = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                 "head_dim", "ffn_hidden_size", "vocab_size", "tie_embeddings", "bias", "qkv_bias",
                 "num_experts", *MOE_SHAPE_FIELDS, *MLA_SHAPE_FIELDS)
"""[model] fields that decide which tensors a model has and their shapes (and max_seq_len for
a learned position table, gpt2's): a checkpoint loads only into a model equal in all of them.
The MoE ones decide which layers have experts, how many and how wide, the shared expert and its
gate, and (sigmoid router) the expert_bias tensor; the MLA ones (deepseek_v3) the attention's
projection widths."""


def _position_table(model: ModelConfig) -> bool:
    """Whether the model holds a learned [max_seq_len, h] position table (by its spec)."""
    spec = ARCH_SPECS.get(model.arch)
    return spec is not None and spec.positions == "learned"


def decides_tensors(name: str, model: ModelConfig) -> bool:
    """Whether [model] field ``name`` decides which tensors ``model`` has or their shapes:
    :data:`TENSOR_FIELDS`, and max_seq_len when the model has a learned position table."""
    return name in TENSOR_FIELDS or (name == "max_seq_len" and _position_table(model))


def model_mismatch(saved: dict[str, Any], model: ModelConfig) -> list[str]:
    """Every tensor-deciding field whose value in a checkpoint's metadata ``model`` differs from
    ``model``'s, as 'model.field=ours (checkpoint: theirs)'. An unset model.vocab_size differs
    from none: a run resuming the checkpoint takes its size."""
    theirs = config_from_dict({"model": saved}).model
    names = [n for n in (*TENSOR_FIELDS, "max_seq_len")
             if decides_tensors(n, model) or decides_tensors(n, theirs)]
    return [f"model.{n}={_comparable(model, n)} (checkpoint: {_comparable(theirs, n)})"
            for n in names if _comparable(model, n) != _comparable(theirs, n)
            and not (n == "vocab_size" and model.vocab_size is None)]


def tokenizer_digest(path: Path) -> str:
    """Content hash of a tokenizer.json (canonical JSON, so formatting does not count)."""
    raw = path.read_bytes()
    with contextlib.suppress(ValueError):
        raw = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()


def check_tokenizers(config: Config, data_tokenizer: Path | None = None) -> None:
    """Refuse a run whose tokenizers disagree: each data.blend dataset's, and the tokenizer of
    ``checkpoint.load`` / ``checkpoint.init_from``, against the data's (``data_tokenizer``,
    default prepared_dir/tokenizer.json). Files that do not exist yet are not compared."""
    data = data_tokenizer or Path(config.data.prepared_dir) / "tokenizer.json"
    if not data.is_file():
        return
    want = tokenizer_digest(data)
    for entry, (_, prefix) in zip(config.data.blend, blend_entries(config.data.blend),
                                  strict=True):
        beside = prefix.parent / "tokenizer.json"
        if beside.is_file() and tokenizer_digest(beside) != want:
            raise ConfigError(
                f"data.blend entry '{entry}' was tokenized with {beside}, another tokenizer "
                f"than the data's {data} (validation and the saved tokenizer come from "
                "data.prepared_dir); every blended dataset needs the same one: re-prepare it "
                f"with `colonnade prepare --data.tokenizer={data} --data.input=... "
                "--data.prepared_dir=...`.")
    for name in ("load", "init_from"):
        source = getattr(config.checkpoint, name)
        if not source or not Path(source).exists():
            continue
        try:
            theirs = source_tokenizer(source)
        except CheckpointError:
            continue  # not a checkpoint: its loader names the problem
        if theirs is not None and tokenizer_digest(theirs) != want:
            raise CheckpointError(
                f"checkpoint.{name}={source} was trained with another tokenizer ({theirs}) "
                f"than the data's ({data}), so token ids would mean other text: prepare the "
                f"data with that tokenizer (`colonnade prepare --data.tokenizer={theirs} "
                "--data.input=... --data.prepared_dir=<new dir>`) and train on that dir.")


def init_weights(trainer: TrainState, path: str | Path) -> str:
    """Load only the weights of ``path`` into ``trainer`` (any layout): step 0, a fresh
    optimizer, the sampler and RNG untouched. Returns a line for the log."""
    ddp = getattr(trainer, "ddp", None)
    if ddp is not None and hasattr(ddp, "finish_param_gather"):
        ddp.finish_param_gather()
    if is_hf_dir(path) and not (Path(path) / "latest").exists():
        load_hf_into_chunks(trainer.chunks, trainer.groups, path, ddp)
        what = "Hugging Face model"
    else:
        ckpt, meta = _colonnade_meta(path)
        bad = model_mismatch(meta["model"], trainer.config.model) if "model" in meta else []
        if bad:
            raise CheckpointError(f"{ckpt}: the model differs from the checkpoint's: "
                                  f"{', '.join(bad)}")
        reader = CheckpointReader(ckpt)
        load_model(reader, trainer.chunks, trainer.groups, ddp)
        reader.close()
        what = f"checkpoint (its step {meta['step']})"
    load_optimizer(None, trainer.optimizer, trainer.chunks, trainer.groups, 0)
    trainer.step = 0
    unchecked = ("" if source_tokenizer(path) is not None else
                 " (it has no tokenizer.json, so the data's tokenizer could not be checked "
                 "against it)")
    return (f"initialised the weights from {what} {path}; step 0, fresh optimizer and LR "
            f"schedule, data from its first sample{unchecked}")
