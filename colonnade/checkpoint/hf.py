"""Hugging Face interop: ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``MixtralForCausalLM`` and
``Qwen2MoeForCausalLM`` directories (the MoE forms: :mod:`~colonnade.checkpoint.hf_moe`).

An HF directory holds ``config.json``, ``model.safetensors`` (or an index + shards) and
tokenizer files. Each architecture's HF form (class name, config.json fields, where each of
Colonnade's global names lies in the HF tensors) is one :class:`~colonnade.checkpoint.
hf_archs.HFFormat` of :data:`~colonnade.checkpoint.hf_archs.HF_FORMATS`: pure renames for
Llama (HF's ``rotate_half`` is the half-split convention of
:func:`colonnade.models.blocks.apply_rope`; the interleaved-to-half permutation only applies to
Meta's original checkpoints, which HF's own conversion script already undid), transposed
``Conv1D`` weights and a split fused ``c_attn`` for GPT-2. A tied head
(``tie_word_embeddings``) is not stored in HF files; Colonnade stores it once as
``embedding.word.weight`` too.

Loading an HF directory into any parallel layout: :func:`load_hf_into_chunks` reads, for each
of this rank's parameters, only the box of its tp shard (:class:`HFRef` says where that box
lies in the HF tensor), one slice at a time; an expert weight the box of its ep shard (the
experts [ep_rank E/ep, (ep_rank + 1) E/ep), each expert one HF tensor).
Writing one (config.json, generation config, tokenizer with special tokens, dtype) is
:mod:`colonnade.hf_export`, which uses :func:`hf_config_from_model` and :func:`hf_tensors`:
the HF tensors are assembled one at a time, each from its Colonnade tensors fetched one at a
time (a fused GPT-2 ``c_attn`` is one HF tensor of three), and streamed into
``model.safetensors`` (:func:`write_safetensors_stream`), so an export never holds more than one
HF tensor and one of its parts, whatever the model size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from colonnade.checkpoint.format import CheckpointError
from colonnade.checkpoint.hf_archs import HFRef, swap_last
from colonnade.checkpoint.hf_moe import ALL_FORMATS
from colonnade.checkpoint.hf_moe import format_for as hf_format
from colonnade.checkpoint.hf_window import read_window, write_window
from colonnade.checkpoint.pieces import Box, pad_to_local
from colonnade.checkpoint.sharded import rank_coords
from colonnade.config.sections import ModelConfig
from colonnade.models.params import unique_params
from colonnade.parallel.groups import ProcessGroups


def is_hf_dir(path: str | Path) -> bool:
    """An HF model directory: config.json naming an architecture."""
    cfg = Path(path) / "config.json"
    return cfg.exists() and "architectures" in json.loads(cfg.read_text())


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of an HF config.json (Llama or GPT-2); rejects what Colonnade cannot run."""
    arch = (hf.get("architectures") or [""])[0]
    for fmt in ALL_FORMATS.values():
        if fmt.hf_class == arch:
            cfg = fmt.read_config(hf)
            if fmt.window is None:
                return cfg
            return dataclasses.replace(cfg, **read_window(hf, fmt.window))
    known = " or ".join(fmt.hf_class for fmt in ALL_FORMATS.values())
    raise ValueError(f"config.json: architecture {arch!r} is not supported ({known})")


def hf_config_from_model(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """config.json contents for a ModelConfig; ``dtype`` (e.g. 'bfloat16') is written as
    ``dtype`` and as ``torch_dtype``, the key older transformers releases read."""
    fmt = hf_format(cfg)
    if fmt.window is None and cfg.sliding_window is not None:
        raise ValueError(f"cannot express as {fmt.hf_class}: model.sliding_window="
                         f"{cfg.sliding_window} (the class has no sliding-window attention); "
                         "unset it, or train an arch whose class has one (mistral, qwen2)")
    common = {"vocab_size": cfg.vocab, "tie_word_embeddings": cfg.tie_embeddings,
              "initializer_range": cfg.init_std, "dtype": dtype, "torch_dtype": dtype}
    window = write_window(cfg, fmt.window, fmt.hf_class) if fmt.window is not None else {}
    return {**common, "architectures": [fmt.hf_class], **fmt.write_config(cfg), **window}


def hf_refs(cfg: ModelConfig) -> dict[str, HFRef]:
    """Colonnade key -> where its values are in the HF checkpoint (see :class:`HFRef`)."""
    return hf_format(cfg).refs(cfg)


def hf_slice(ref: HFRef, box: Box, stored: tuple[int, ...]) -> tuple[slice, ...]:
    """Index into the HF tensor (shape ``stored``) of box ``box`` of our tensor."""
    offsets, shape = box
    if ref.transpose:
        offsets, shape = swap_last(offsets), swap_last(shape)
    out = [slice(o, o + n) for o, n in zip(offsets, shape, strict=True)]
    if ref.interleave:  # the strided block's rows lie inside this contiguous run
        out[-1] = slice(out[-1].start * ref.blocks, out[-1].stop * ref.blocks)
        return tuple(out)
    shift = ref.block * (stored[-1] // ref.blocks)
    out[-1] = slice(out[-1].start + shift, out[-1].stop + shift)
    return tuple(out)


def take_box(get: Callable[[str, tuple[slice, ...]], torch.Tensor],
             shape_of: Callable[[str], tuple[int, ...]], ref: HFRef, box: Box) -> torch.Tensor:
    """Box ``box`` of our tensor, read as one slice of the HF tensor through ``get`` (a
    stacked-experts tensor: one slice of each expert's HF tensor in the box, stacked)."""
    if ref.experts:
        (o0, *offsets), (n0, *shape) = box
        sub = (tuple(offsets), tuple(shape))
        return torch.stack([take_box(get, shape_of, one, sub)
                            for one in ref.per_expert()[o0:o0 + n0]])  # [n0, ...]
    values = get(ref.name, hf_slice(ref, box, shape_of(ref.name)))
    if ref.interleave:
        values = values[..., ref.block::ref.blocks]
    return values.transpose(-1, -2).contiguous() if ref.transpose else values.contiguous()


def from_hf_state(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full Colonnade tensors from an HF state dict."""
    def get(name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return _take(hf, name)[index].clone()

    def shape_of(name: str) -> tuple[int, ...]:
        return tuple(_take(hf, name).shape)

    out = {}
    for ours, ref in hf_refs(cfg).items():
        full = ref.our_shape(shape_of(ref.tensor_name()))
        out[ours] = take_box(get, shape_of, ref, ((0,) * len(full), full))
    return out


def to_hf_state(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state dict from full Colonnade tensors (inverse of :func:`from_hf_state`)."""
    return hf_format(cfg).to_hf(cfg, full)


TensorGet = Callable[[str], torch.Tensor]
"""Our key -> its full tensor (read or gathered on demand, one at a time)."""
ShapeOf = Callable[[str], tuple[int, ...]]
"""Our key -> its full shape (no values read)."""
HFSpec = tuple[str, tuple[int, ...], torch.dtype]
"""(HF name, shape, dtype) of one HF tensor."""


def hf_parts(cfg: ModelConfig) -> dict[str, list[tuple[str, HFRef]]]:
    """HF tensor name -> the (our key, ref) parts it is made of, in block order, sorted by
    HF name (the order :func:`hf_tensors` yields them); a stacked-experts tensor's HF tensors
    (one per expert, ``ref.expert`` = j) are consecutive, sorted by its name pattern and j."""
    out: dict[str, list[tuple[str, HFRef]]] = {}
    order: dict[str, tuple[str, int]] = {}
    for ours, stacked in hf_refs(cfg).items():
        for ref in stacked.per_expert():
            out.setdefault(ref.name, []).append((ours, ref))
            order[ref.name] = (stacked.name, -1 if ref.expert is None else ref.expert)
    return {name: sorted(out[name], key=lambda part: part[1].block)
            for name in sorted(out, key=order.__getitem__)}


def hf_specs(cfg: ModelConfig, shape_of: ShapeOf, dtype: torch.dtype) -> list[HFSpec]:
    """(name, shape, dtype) of every HF tensor, from our shapes only: a part's shape is ours
    (reversed when stored transposed) and the parts are concatenated along the last dim."""
    out = []
    for name, parts in hf_parts(cfg).items():
        ours_shapes = [(shape_of(ours)[1:] if ref.expert is not None else shape_of(ours), ref)
                       for ours, ref in parts]
        shapes = [swap_last(shape) if ref.transpose else shape for shape, ref in ours_shapes]
        out.append((name, (*shapes[0][:-1], sum(s[-1] for s in shapes)), dtype))
    return out


def hf_tensors(cfg: ModelConfig, get: TensorGet, specs: Sequence[HFSpec]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of :func:`hf_specs` one at a time: each part ``get(ours)`` (fetched when
    needed, dropped once copied) written transposed or not into its block of the last dim.
    Equal to :func:`to_hf_state` of the full tensors. A stacked-experts tensor [E, ...] is
    fetched once for its E consecutive HF tensors (expert j's is its slice j) and kept until
    another key is asked for: besides the HF tensor, at most one part or one stacked tensor is
    alive."""
    parts_of = hf_parts(cfg)
    kept: dict[str, torch.Tensor] = {}
    for name, shape, dtype in specs:
        out = torch.empty(shape, dtype=dtype)
        at = 0
        for ours, ref in parts_of[name]:
            if ref.expert is None:
                kept.clear()
                part = get(ours)
            else:
                if ours not in kept:
                    kept.clear()
                    kept[ours] = get(ours)
                part = kept[ours][ref.expert]
            part = part.transpose(-1, -2) if ref.transpose else part
            n = part.shape[-1]
            if ref.interleave:
                out[..., ref.block::ref.blocks] = part
            else:
                out[..., at:at + n] = part
            at += n
            del part  # one part alive at a time
        yield name, out


SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
"""torch dtype -> safetensors header dtype."""


def write_safetensors_stream(path: str | Path, specs: Sequence[HFSpec],
                             tensors: Iterator[tuple[str, torch.Tensor]],
                             metadata: dict[str, str] | None = None,
                             progress: bool = False) -> None:
    """Write a safetensors file tensor by tensor: the header (8-byte little-endian length,
    JSON {name: dtype, shape, data_offsets}, space-padded to 8 bytes) from ``specs``, then each
    tensor's bytes as ``tensors`` yields it (same order as ``specs``), then fsync. Only one
    tensor is in memory at a time (``safetensors.save_file`` takes them all at once).
    ``progress``: a bar of the bytes written, on a terminal (minutes for a 7B model)."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with (open(path, "wb") as f,
          tqdm(total=offset, unit="B", unit_scale=True, desc=f"write {Path(path).name}",
               disable=None if progress else True) as bar):  # None: off when not a terminal
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, shape, dtype), (got, t) in zip(specs, tensors, strict=True):
            if got != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{path}: tensor {got} {tuple(t.shape)} {t.dtype} does not "
                                 f"match the header's {name} {tuple(shape)} {dtype}")
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            bar.update(t.numel() * t.element_size())
        f.flush()
        os.fsync(f.fileno())


def _take(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise CheckpointError(f"HF checkpoint has no tensor '{name}'")
    return hf[name]


def _shard_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no model*.safetensors (pickled .bin checkpoints "
                              "are not loaded; re-save with safe_serialization=True)")
    return files


def _hf_config(directory: Path) -> ModelConfig:
    """The ModelConfig of an HF directory's config.json; what Colonnade cannot run (a class,
    rope type or setting it does not know, a missing key) is a :class:`CheckpointError`
    naming the file: bad input, refused in one line (exit 2) by every command."""
    if not is_hf_dir(directory):
        raise CheckpointError(f"{directory}/config.json missing or without 'architectures': "
                              "not a Hugging Face model directory")
    try:
        cfg = model_config_from_hf(json.loads((directory / "config.json").read_text()))
    except KeyError as err:
        raise CheckpointError(f"{directory}/config.json has no {err} key") from err
    except ValueError as err:
        raise CheckpointError(f"{directory}/config.json: "
                              f"{str(err).removeprefix('config.json: ')}") from err
    fit = hf_format(cfg).fit
    if fit is None:
        return cfg
    names: set[str] = set()
    for f in _shard_files(directory):
        try:
            with safe_open(str(f), framework="pt") as handle:
                names.update(handle.keys())
        except Exception as err:
            raise CheckpointError(f"{f}: cannot read ({err}); truncated or corrupted") from err
    return fit(cfg, names)


def read_hf(directory: str | Path, progress: bool = False
            ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and full Colonnade tensors of an HF directory (safetensors only); for one
    process that needs the whole model (conversion, ``generate``). ``progress``: a bar of the
    shard bytes read, on a terminal."""
    directory = Path(directory)
    cfg = _hf_config(directory)
    hf: dict[str, torch.Tensor] = {}
    files = _shard_files(directory)
    with tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
              desc=f"read {directory.name}", disable=None if progress else True) as bar:
        for f in files:
            done = 0
            try:
                with safe_open(str(f), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                        hf[name] = handle.get_tensor(name)
                        size = hf[name].numel() * hf[name].element_size()
                        bar.update(size)
                        done += size
            except Exception as err:
                raise CheckpointError(f"{f}: cannot read ({err}); truncated or "
                                      "corrupted") from err
            bar.update(f.stat().st_size - done)  # the file's header
    return cfg, from_hf_state(cfg, hf)


class HFReader:
    """An HF directory's safetensors shards, read one slice of one tensor at a time.

    Opening reads only each file's header (names, shapes); :meth:`read` takes just the slice
    asked for (``get_slice``). ``bytes_read`` counts the tensor bytes taken.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.config = _hf_config(self.directory)
        self.bytes_read = 0
        self._where: dict[str, tuple[Path, Any]] = {}
        for f in _shard_files(self.directory):
            try:
                handle = safe_open(str(f), framework="pt")
                names = list(handle.keys())
            except Exception as err:
                raise CheckpointError(f"{f}: cannot read ({err}); truncated or "
                                      "corrupted") from err
            for name in names:
                self._where[name] = (f, handle)

    def _locate(self, name: str) -> tuple[Path, Any]:
        if name not in self._where:
            raise CheckpointError(f"HF checkpoint {self.directory} has no tensor '{name}'")
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of HF tensor ``name`` (from the file header)."""
        _, handle = self._locate(name)
        return tuple(handle.get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Elements ``index`` of HF tensor ``name``, and nothing else."""
        path, handle = self._locate(name)
        try:
            t = handle.get_slice(name)[index]
        except Exception as err:
            raise CheckpointError(f"{path}: cannot read '{name}' ({err}); truncated or "
                                  "corrupted") from err
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        """Drop the file handles."""
        self._where.clear()


def load_hf_into_chunks(chunks: list[nn.Module], groups: ProcessGroups,
                        directory: str | Path, ddp: Any = None) -> int:
    """Load an HF directory into this rank's chunks (any layout), checking every shape.

    Reads only this rank's parameters (its pipeline stage's layers) and of each only the box of
    its tp shard, one tensor slice at a time: a tp x pp rank reads about 1/(tp pp) of the file.
    ZeRO-3 (``ddp.param_shards``): the values go into this rank's shard, the flat ranges
    ``ddp.owned_param_segments()`` names, one tensor's local shard at a time.
    Returns the bytes read.
    """
    reader = HFReader(directory)
    refs = hf_refs(reader.config)
    shards = getattr(ddp, "param_shards", None) if ddp is not None else None
    ranges: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    if shards is not None:
        shards.free_all()  # a bucket still gathered would keep the old values
        for q, lo, hi, values in ddp.owned_param_segments():
            ranges.setdefault(id(q), []).append((lo, hi, values))
    for p in unique_params(chunks):
        s = p.sharding  # type: ignore[attr-defined]
        coords = rank_coords(groups, sharding=s)  # tp, or ep for an expert weight
        value = _hf_local(reader, refs, s, coords, p.dtype, directory)  # [local_shape]
        with torch.no_grad():
            if shards is None or id(p) not in ddp.buffers.slots:  # whole (not in shards)
                p.copy_(value.to(p.device))
                continue
            flat = value.reshape(-1)
            for lo, hi, values in ranges.get(id(p), []):
                values.copy_(flat[lo:hi].to(values.device))
    reader.close()
    return reader.bytes_read


def _hf_local(reader: HFReader, refs: dict[str, HFRef], s: Any, coords: dict[str, Any],
              dtype: torch.dtype, directory: str | Path) -> torch.Tensor:
    """This rank's local tp shard [local_shape] (zero padded) of our tensor ``s.key``."""
    if s.key not in refs:
        raise CheckpointError(f"{directory}: tensor '{s.key}' missing")
    ref = refs[s.key]
    theirs = ref.our_shape(reader.shape(ref.tensor_name()))
    if theirs != s.full_shape:
        raise CheckpointError(f"{directory}: tensor '{s.key}' has shape {theirs} but the "
                              f"model expects {s.full_shape}; the [model] config does not "
                              "match the checkpoint")
    box = s.box(coords)
    if 0 in box[1]:
        return torch.zeros(s.local_shape(coords), dtype=dtype)
    return pad_to_local(take_box(reader.read, reader.shape, ref, box).to(dtype), s, coords)
