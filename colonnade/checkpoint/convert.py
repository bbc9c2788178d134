"""``colonnade convert``: HF directory <-> Colonnade checkpoint (single process, full tensors).

``--from-hf HF --out DIR`` writes a committed Colonnade checkpoint (weights only, step 0,
``"weights_only": true`` in its metadata) that ``colonnade train --init-from=DIR`` fine-tunes in
any layout (``checkpoint.load``, exact resume, refuses it: there is no run to resume) and
``colonnade generate DIR`` samples from. ``--to-hf CKPT --out DIR [--dtype bf16]`` is
:func:`colonnade.hf_export.to_hf` (above the data package, whose tokenizer it reads), which
reads the checkpoint with :func:`read_full_model`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from colonnade.checkpoint.commit import (
    LATEST,
    METADATA,
    commit,
    committed_steps,
    prepare_tmp,
    resolve_checkpoint,
    step_dirname,
)
from colonnade.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointReader,
    Entry,
    removed_on_failure,
    tokenizer_files,
    write_rank_shard,
)
from colonnade.checkpoint.hf import read_hf
from colonnade.checkpoint.pieces import Piece
from colonnade.config.load import config_to_dict, config_to_toml, load_config
from colonnade.config.sections import Config


def write_model_checkpoint(root: str | Path, config: Config, full: dict[str, torch.Tensor],
                           tokenizer_dir: str | Path | None = None) -> Path:
    """A committed step-0 checkpoint holding only model tensors (full, one rank)."""
    root = Path(root)
    tmp = prepare_tmp(root, 0)
    entries = [Entry(f"model/{k}", v.contiguous(), Piece((0,) * v.ndim, tuple(v.shape)),
                     tuple(v.shape)) for k, v in sorted(full.items())]
    write_rank_shard(tmp, 0, entries)
    meta = {"format_version": FORMAT_VERSION, "step": 0, "consumed_samples": None,
            "sampler": None, "optimizer": {"step_count": 0}, "scaler": None, "rng": None,
            "weights_only": True,
            "layout": {"tp": 1, "pp": 1, "vp": 1, "dp": 1, "world_size": 1},
            "model": config_to_dict(config)["model"]}
    files = {"config.toml": config_to_toml(config).encode()}
    if tokenizer_dir is not None:
        files.update(tokenizer_files(tokenizer_dir))
    return commit(root, tmp, 0, [0], meta, files, keep_last=0)


def from_hf(hf_dir: str | Path, out: str | Path, progress: bool = False) -> Path:
    """HF directory -> Colonnade checkpoint; returns the committed step directory
    (``progress``: a bar of the HF bytes read, on a terminal). An ``out`` that already holds
    a checkpoint is refused before the HF model is read."""
    root = Path(out)
    held = [step_dirname(s) for s in committed_steps(root)] if root.is_dir() else []
    if held or (root / LATEST).exists():
        raise CheckpointError(f"{out} already holds a checkpoint ({', '.join(held) or LATEST}); "
                              "pass a new --out directory or delete the old one first")
    with removed_on_failure(root):  # a stopped conversion leaves no half-made checkpoint dir
        model_cfg, full = read_hf(hf_dir, progress)
        return write_model_checkpoint(out, Config(model=model_cfg), full, hf_dir)


def read_full_model(path: str | Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """Config and full model tensors of a Colonnade checkpoint (root or step directory)."""
    ckpt = resolve_checkpoint(path)
    config = load_config(ckpt / "config.toml")
    reader = CheckpointReader(ckpt)
    full = {}
    for name in sorted(reader.tensors):
        if name.startswith("model/"):
            shape = reader.full_shape(name)
            full[name.removeprefix("model/")] = reader.read_box(name, ((0,) * len(shape), shape))
    return config, full


def describe(path: Path) -> str:
    """One line about a written checkpoint."""
    meta = json.loads((path / METADATA).read_text()) if (path / METADATA).exists() else {}
    return f"wrote {path} (step {meta.get('step', '-')})"

