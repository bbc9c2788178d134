"""On-disk format of a distributed checkpoint: safetensors shards plus a JSON index.

A checkpoint directory (``step_000100/``) holds:

* ``rank-00003.safetensors``: the pieces rank 3 owns, each stored under ``NAME@k`` (a rank
  that owns none, e.g. a dp replica without ZeRO-1, writes no file);
* ``rank-00003.json``: that rank's fragment of the index (written after its shard is durable);
* ``index.json``: merged by rank 0 at commit: for every logical tensor (``model/<key>``,
  ``optim/<key>/<state>``) its full shape, dtype and pieces (file, stored name, box in full
  coordinates, optional flat range, crc32 of the bytes);
* ``metadata.json`` (step, layout, sampler, LR, scaler, RNG; see :mod:`.training_state`),
  ``config.toml`` (the resolved config) and the tokenizer when known: ``tokenizer.json``, and
  the other files of :data:`TOKENIZER_FILES` found beside it (``tokenizer_config.json`` with
  its special tokens and chat template, which the HF export writes back).

Why safetensors + JSON rather than ``torch.distributed.checkpoint`` (DCP): ZeRO-1 ranks own
*flat ranges* of a tp shard, which are not rectangular boxes of the full tensor and so cannot be
described as DTensor / ShardedTensor chunks without first gathering; DCP's metadata file is a
pickle, so loading it executes pickled code; and its planner needs a process group of the saved
shape or a rewrite for resharding. Here a piece is (box, flat range), resharding is box
intersection in :mod:`.pieces`, loading never unpickles (safetensors + JSON), every file is
readable by hand, and the same reader serves one process (conversion, ``generate``) and any
layout. Integrity: each piece carries a crc32; a missing, truncated or corrupted file or piece
raises :class:`CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from colonnade.checkpoint.pieces import Box, Piece
from colonnade.checkpoint.reads import PieceRead, plan_reads

FORMAT_VERSION = 1
INDEX = "index.json"

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
    torch.float16: "float16", torch.int64: "int64", torch.uint8: "uint8",
}
DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")
"""Tokenizer files a checkpoint keeps (from the prepared data or an imported HF directory)."""


def tokenizer_files(directory: str | Path) -> dict[str, bytes]:
    """The contents of the :data:`TOKENIZER_FILES` present in ``directory``, by name."""
    found = {name: Path(directory) / name for name in TOKENIZER_FILES}
    return {name: path.read_bytes() for name, path in found.items() if path.is_file()}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, broken or does not fit the model; names file and tensor."""


@dataclass
class Entry:
    """One piece a rank writes: logical tensor ``name``, its values and where they sit."""

    name: str
    tensor: torch.Tensor
    """The piece's values: shaped like ``piece.shape``, or 1-D for a flat range."""
    piece: Piece
    full_shape: tuple[int, ...]


def crc32(t: torch.Tensor) -> int:
    """crc32 of a tensor's bytes (row-major)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(flat.numpy()) if flat.numel() else 0


def fsync_path(path: Path) -> None:
    """Flush a file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON durably: temporary file, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def removed_on_failure(out_dir: Path) -> Iterator[None]:
    """Run the body; if it fails (an error, Ctrl-C, SIGTERM) and ``out_dir`` was created by
    it, remove it with whatever the body left there, temporary files included (a failed
    prepare or conversion leaves no trace; a directory that existed before is never
    removed)."""
    created = not out_dir.exists()
    try:
        yield
    except BaseException:
        if created and out_dir.is_dir():
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def shard_file(rank: int) -> str:
    """Name of rank ``rank``'s shard file (its index fragment is the same name in .json)."""
    return f"rank-{rank:05d}.safetensors"


def fragment_name(rank: int) -> str:
    """Name of rank ``rank``'s index fragment."""
    return f"rank-{rank:05d}.json"


def rank_files(rank: int, entries: list[Entry]) -> list[str]:
    """The files rank ``rank`` writes for ``entries``: its shard and fragment, none without
    pieces (a dp replica)."""
    return [shard_file(rank), fragment_name(rank)] if entries else []


def plan_fragment(rank: int, entries: list[Entry]) -> tuple[dict[str, torch.Tensor],
                                                            dict[str, Any]]:
    """The tensors rank ``rank`` stores (by stored name) and its index fragment (pure)."""
    file = shard_file(rank)
    tensors: dict[str, torch.Tensor] = {}
    fragment: dict[str, dict[str, Any]] = {}
    for k, e in enumerate(entries):
        stored = f"{e.name}@{k}"
        data = e.tensor.detach().contiguous()
        if tuple(data.shape) != ((e.piece.numel,) if e.piece.flat else e.piece.shape):
            raise ValueError(f"{e.name}: piece data shape {tuple(data.shape)} does not match "
                             f"{e.piece}")
        tensors[stored] = data
        info = fragment.setdefault(e.name, {"full_shape": list(e.full_shape),
                                            "dtype": DTYPE_NAMES[data.dtype], "pieces": []})
        info["pieces"].append({**e.piece.to_json(), "file": file, "tensor": stored,
                               "crc32": crc32(data)})
    return tensors, {"format_version": FORMAT_VERSION, "file": file, "tensors": fragment}


def write_rank_shard(directory: Path, rank: int, entries: list[Entry]) -> Path | None:
    """Write this rank's pieces (shard file, fsync, then its index fragment); returns the
    fragment, or None (and writes nothing) when the rank owns no piece."""
    files = rank_files(rank, entries)
    if not files:
        return None
    tensors, fragment = plan_fragment(rank, entries)
    shard, out = directory / files[0], directory / files[1]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    fsync_path(shard)
    write_json(out, fragment)
    return out


def merge_index(fragments: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Join (name, fragment) pairs into the index, checking that full shapes agree."""
    tensors: dict[str, dict[str, Any]] = {}
    for where, frag in fragments:
        for name, info in frag["tensors"].items():
            have = tensors.setdefault(name, {"full_shape": info["full_shape"],
                                             "dtype": info["dtype"], "pieces": []})
            if have["full_shape"] != info["full_shape"]:
                raise CheckpointError(f"{where}: tensor '{name}' has full shape "
                                      f"{info['full_shape']} but another rank wrote "
                                      f"{have['full_shape']}")
            have["pieces"].extend(info["pieces"])
    return {"format_version": FORMAT_VERSION, "tensors": tensors}


def merge_fragments(directory: Path, writers: list[int]) -> dict[str, Any]:
    """Join the fragments of the ranks ``writers`` in ``directory`` into the index."""
    frags = []
    for rank in writers:
        path = directory / fragment_name(rank)
        frags.append((str(path), json.loads(path.read_text())))
    return merge_index(frags)


class CheckpointReader:
    """Reads any box (or flat range of a box) of any logical tensor of one checkpoint.

    Every read follows a plan (:func:`~colonnade.checkpoint.reads.plan_reads`) and takes only
    the requested elements from the shard files (``get_slice``), so a tp shard reads its box
    and a ZeRO-1 rank its range. ``bytes_read`` counts the tensor bytes taken. A stored piece
    read whole is checked against its crc32; a part of a piece (resharding) is not (the crc
    covers the whole piece).
    """

    def __init__(self, directory: str | Path, verify: bool = True,
                 index: dict[str, Any] | None = None) -> None:
        self.directory = Path(directory)
        self.verify = verify
        self.bytes_read = 0
        path = self.directory / INDEX
        if index is None:
            index = _load_index(path, self.directory)
        version = index.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(f"{path}: format_version {version} is not supported (this "
                                  f"Colonnade reads version {FORMAT_VERSION})")
        self.tensors: dict[str, dict[str, Any]] = index["tensors"]
        self._files: dict[str, Any] = {}

    def has(self, name: str) -> bool:
        """Whether the logical tensor ``name`` is stored."""
        return name in self.tensors

    def full_shape(self, name: str) -> tuple[int, ...]:
        """Full (logical) shape of a stored tensor."""
        return tuple(self.tensors[name]["full_shape"])

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        """Raise naming the tensor when the stored full shape differs from the model's."""
        if not self.has(name):
            raise CheckpointError(f"{self.directory}/{INDEX}: tensor '{name}' missing from the "
                                  "checkpoint (was it saved from a different model?)")
        got = self.full_shape(name)
        if got != tuple(expected):
            raise CheckpointError(f"{self.directory}: tensor '{name}' has shape {got} in the "
                                  f"checkpoint but {tuple(expected)} in this model; the "
                                  "checkpoint comes from a different model shape (check "
                                  "the [model] section)")

    def plan(self, name: str, box: Box, flat: tuple[int, int] | None = None) -> list[PieceRead]:
        """The reads :meth:`read` does for this request (raises when pieces are missing)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.directory}/{INDEX}: tensor '{name}' missing")
        reads, covered = plan_reads(info["pieces"], box, flat)
        want = math.prod(box[1]) if flat is None else flat[1] - flat[0]
        if covered != want:
            what = f"box {box}" + (f" range {flat}" if flat is not None else "")
            raise CheckpointError(f"{self.directory}: tensor '{name}' {what} is only "
                                  f"{covered}/{want} covered by stored pieces (a rank's shard "
                                  "is missing)")
        return reads

    def read(self, name: str, box: Box, flat: tuple[int, int] | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values of ``box`` of tensor ``name`` (shaped like the box), or of the flat range
        ``flat`` of the box's row-major flattening (1-D)."""
        reads = self.plan(name, box, flat)
        shape = box[1] if flat is None else (flat[1] - flat[0],)
        out = torch.empty(shape, dtype=DTYPES[self.tensors[name]["dtype"]])
        flat_out = out.view(-1)
        for r in reads:
            values = self._fetch(name, r)
            if r.flat_dst:
                flat_out[r.dst[0]] = values.reshape(-1)
            else:
                out[r.dst] = values
        return out if dtype is None else out.to(dtype)

    def read_box(self, name: str, box: Box, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values of ``box`` of tensor ``name``, assembled from every intersecting piece."""
        return self.read(name, box, None, dtype)

    def _handle(self, file: str) -> Any:
        if file not in self._files:
            path = self.directory / file
            if not path.exists():
                raise CheckpointError(f"{path} missing (the checkpoint is incomplete)")
            try:
                self._files[file] = safe_open(str(path), framework="pt")
            except Exception as err:
                raise CheckpointError(f"{path}: cannot open shard ({err}); the file is "
                                      "truncated or corrupted") from err
        return self._files[file]

    def _fetch(self, name: str, r: PieceRead) -> torch.Tensor:
        """Execute one planned read (only the requested elements leave the file)."""
        p = r.piece
        path = self.directory / p["file"]
        handle = self._handle(p["file"])
        try:
            t = handle.get_slice(p["tensor"])[r.src]
        except Exception as err:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' (stored as "
                                  f"'{p['tensor']}'): {err}; the file is truncated or "
                                  "corrupted") from err
        self.bytes_read += t.numel() * t.element_size()
        if self.verify and r.whole and crc32(t) != p["crc32"]:
            raise CheckpointError(f"{path}: tensor '{name}' (stored as '{p['tensor']}') fails "
                                  "its crc32 check; the file is corrupted")
        return t

    def close(self) -> None:
        """Drop open file handles."""
        self._files.clear()


def _load_index(path: Path, directory: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"{path} missing: {directory} is not a committed "
                              "checkpoint (pass the checkpoint root or a step_* directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); the file is "
                              "corrupted") from err
