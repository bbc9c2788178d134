"""How data.input and data.blend strings name files (parsed here, checked by
:mod:`colonnade.config.validate`, read by :mod:`colonnade.data`).

data.input: a path, directory, glob or comma-separated list of them, each part optionally
ending in ``:KEY`` (the field or column holding its text); data.blend: ``weight:path`` entries,
path a prepared dir or its dataset prefix.
"""

from __future__ import annotations

from pathlib import Path


def input_sources(spec: str) -> list[tuple[str, str | None]]:
    """(path or glob, text key or None) of each part of a data.input spec: the spec itself when
    it names an existing path, else its comma-separated parts. A part that is not an existing
    path and ends in ``:KEY`` (KEY without '/' or '\\') reads the text of its records from the
    field or column KEY instead of data.text_key: ``'a.jsonl,b.parquet:body'``. A path whose
    name holds ':' is taken whole when it exists (see colonnade.data.readers)."""
    text = str(spec)
    if Path(text).exists():
        return [(text, None)]
    return [_split_key(part.strip()) for part in text.split(",") if part.strip()]


def _split_key(part: str) -> tuple[str, str | None]:
    """('path', 'key') of 'path:key'; (part, None) when the part has no ':key' suffix."""
    head, sep, key = part.rpartition(":")
    if not sep or not head or Path(part).exists() or "/" in key or "\\" in key:
        return part, None
    return head, key.strip()


def normalize_input(spec: str) -> str:
    """A data.input spec with each part resolved to an absolute path (globs kept as patterns)
    and its ':key' suffix kept, comma-joined: two specs naming the same inputs from different
    directories compare equal."""
    return ",".join(str(Path(part).resolve()) + ("" if key is None else f":{key}")
                    for part, key in input_sources(spec))


def blend_prefix(path: str) -> Path:
    """The indexed-dataset prefix a data.blend entry's path names: ``DIR/data`` when the path
    is a prepared dir (it holds data.idx; the prefix `colonnade prepare` writes), the path
    without a trailing .bin/.idx when it names one of the two files, else the path itself."""
    prefix = Path(path)
    if prefix.is_dir() and (prefix / "data.idx").is_file():
        return prefix / "data"
    return prefix.with_suffix("") if prefix.suffix in (".bin", ".idx") else prefix


def blend_entries(blend: tuple[str, ...]) -> list[tuple[float, Path]]:
    """(weight, prefix) of each 'weight:path' entry of a validated data.blend (see
    :func:`blend_prefix`)."""
    out = []
    for entry in blend:
        weight, _, path = entry.partition(":")
        out.append((float(weight), blend_prefix(path)))
    return out


BLEND_SUM_TOLERANCE = 0.01
"""How far the data.blend weights may sum from 1 (0.33 + 0.33 + 0.33 is accepted)."""


def is_glob(part: str) -> bool:
    """Whether one input part is a glob pattern (and not an existing path with such a name)."""
    return any(ch in part for ch in "*?[") and not Path(part).exists()
