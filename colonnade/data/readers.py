"""Input formats: what a user points `data.input` at, turned into a stream of documents.

An input spec is resolved (`resolve_input`) into a sorted, deterministic list of `Source`s before
anything is read, so an unsupported format or a missing path fails before any work:

* a file, by suffix (a trailing `.gz` or `.zst` is decompressed first, except for parquet/arrow):
  text (`.txt`, `.md`, `.py`, ...: the whole file is one document), `.jsonl`/`.ndjson` (one JSON
  object per line, the string under `text_key`), `.json` (an array of such records, or of
  strings), `.csv`/`.tsv` (a header row, the `text_key` column), `.parquet` (the `text_key`
  column, via pyarrow) and `.arrow` (Arrow IPC stream or file, e.g. Hugging Face shards);
* a directory written by Hugging Face `datasets`' `save_to_disk` (`state.json` +
  `dataset_info.json` + `data-*.arrow`): its arrow shards in `state.json`'s order, read with
  pyarrow (the `datasets` package is not needed);
* any other directory: every file below it with a supported suffix, sorted by relative path
  (hidden entries are not entered; other files are listed in `ignored`, never read silently);
* a glob (`*`, `?`, `[`): its matches, sorted; a comma-separated list: each part, in order;
* any part may end in `:KEY`: its record files read their text from field/column KEY instead of
  `text_key` (`'a.jsonl,b.parquet:body'`; `config.data_paths.input_sources` parses it).

A file whose first bytes are another format's magic number (a parquet file named `.jsonl`)
is reported as that format, with the fix (rename it), instead of as undecodable text.

Reading never stops at a bad file or record: each problem (undecodable bytes, invalid JSON, a
missing column or key, a corrupt archive) is handed to a `Report` callback with where and why,
and the caller decides whether to skip it or to fail with all of them (see `corpus`).
"""

from __future__ import annotations

import csv
import glob
import gzip
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import zstandard

from colonnade.config.data_paths import input_sources, is_glob
from colonnade.data.errors import CorpusError

Report = Callable[[Path, str, str], None]
"""Called as `report(path, at, reason)` for each document or file that cannot be read; `at`
locates a record in the file (":<line>", "[<index>]", "[row <n>]") or is "" for the file."""

TEXT_SUFFIXES: tuple[str, ...] = (
    ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".html", ".py", ".c", ".h", ".cc",
    ".cpp", ".hpp", ".java", ".js", ".ts", ".go", ".rs", ".sh",
)
"""Suffixes read as plain text, one document per file."""

RECORD_FORMATS: dict[str, str] = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv",
    ".parquet": "parquet", ".arrow": "arrow",
}
"""Suffixes of record formats (one document per record) and their reader names."""

COMPRESSIONS: tuple[str, ...] = (".gz", ".zst")
"""Compression suffixes decompressed on the fly (not for the columnar parquet/arrow)."""

HF_DATASET_MARKERS: tuple[str, ...] = ("state.json", "dataset_info.json")
"""Files that mark a directory written by Hugging Face `datasets`' `save_to_disk`."""

ROWS_PER_BATCH = 1024
"""Rows per record batch read from a parquet file."""

READ_ERRORS: tuple[type[BaseException], ...] = (
    OSError, EOFError, ValueError, NotImplementedError, zstandard.ZstdError)
"""What a corrupt, truncated or unsupported file raises while read (gzip, zstd, pyarrow's
ArrowInvalid/ArrowIOError/ArrowNotImplementedError): reported as that file's problem."""


MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"PAR1", "parquet", "{stem}.parquet"), (b"ARROW1", "Arrow IPC", "{stem}.arrow"),
    (b"\x1f\x8b", "gzip", "{name}.gz"), (b"\x28\xb5\x2f\xfd", "zstd", "{name}.zst"),
)
"""(leading bytes, format, the name it needs) of binary formats recognised in a file named as
text, jsonl, json or csv: read as text they would only give 'not valid UTF-8'."""


@dataclass(frozen=True)
class Source:
    """One file to read: its path, reader name, compression suffix ('' for none) and the text
    key of its records (None: the caller's `text_key`)."""

    path: Path
    fmt: str
    compression: str = ""
    text_key: str | None = None


def supported_formats() -> str:
    """Human-readable list of what `data.input` accepts (for error messages and help)."""
    records = ", ".join(RECORD_FORMATS)
    return (f"text files ({', '.join(TEXT_SUFFIXES[:5])}, ...), {records}; "
            f"{' or '.join(COMPRESSIONS)} of text/jsonl/json/csv; a directory or glob of these; "
            "a Hugging Face datasets directory (save_to_disk)")


def classify(path: Path) -> Source | None:
    """The `Source` for a file by its suffixes, or None when the format is not supported."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes.pop() if suffixes and suffixes[-1] in COMPRESSIONS else ""
    suffix = suffixes[-1] if suffixes else ""
    fmt = RECORD_FORMATS.get(suffix) or ("text" if suffix in TEXT_SUFFIXES else None)
    if fmt is None or (compression and fmt in ("parquet", "arrow")):
        return None
    return Source(path, fmt, compression)


def resolve_input(spec: str | Path, ignored: list[str] | None = None) -> list[Source]:
    """Every file `spec` names, in reading order (see the module docstring); raises CorpusError
    for a missing path, an empty match or an unsupported format. Files a directory holds in
    other formats are appended to `ignored` (when given) as relative paths."""
    parts = input_sources(str(spec))
    if not parts:
        raise CorpusError("data.input is empty; give a file, directory, glob or comma list")
    sources: list[Source] = []
    for part, key in parts:
        found = _resolve_part(part, ignored)
        if key is not None and found and all(s.fmt == "text" for s in found):
            raise CorpusError(f"data.input part '{part}:{key}': {part} holds only text files, "
                              "each one document; a ':KEY' suffix names the text field of "
                              "record files (jsonl, json, csv, parquet, arrow): drop it")
        sources.extend(Source(s.path, s.fmt, s.compression, key) for s in found)
    return sources


def _resolve_part(part: str, ignored: list[str] | None) -> list[Source]:
    if is_glob(part):
        matches = sorted(glob.glob(part, recursive=True))
        if not matches:
            raise CorpusError(f"data.input glob '{part}' matches no file; check the pattern")
        out: list[Source] = []
        for match in matches:
            out.extend(_resolve_path(Path(match), ignored, explicit=False))
        if not out:
            raise CorpusError(f"data.input glob '{part}' matches no file of a supported format "
                              f"({supported_formats()})")
        return out
    return _resolve_path(Path(part), ignored, explicit=True)


def _resolve_path(path: Path, ignored: list[str] | None, *, explicit: bool) -> list[Source]:
    if not path.exists():
        raise CorpusError(f"{path}: no such file or directory; check the input path")
    if path.is_dir():
        found = _directory_sources(path, ignored)
        if not found:
            raise CorpusError(f"{path}: no files of a supported format ({supported_formats()})")
        return found
    source = classify(path)
    if source is not None:
        return [source]
    if explicit:
        suffix = "".join(path.suffixes) or "(no suffix)"
        raise CorpusError(f"{path}: unsupported input format '{suffix}'; supported: "
                          f"{supported_formats()}")
    if ignored is not None:
        ignored.append(str(path))
    return []


def _directory_sources(root: Path, ignored: list[str] | None) -> list[Source]:
    """Sources below `root`, sorted by relative path; HF datasets directories read as shards."""
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        first = root / (splits or ["train"])[0]
        raise CorpusError(f"{root} is a Hugging Face DatasetDict with splits {splits}; point "
                          f"data.input at one split's directory, e.g. {first}")
    if all((root / name).is_file() for name in HF_DATASET_MARKERS):
        return _hf_dataset_sources(root)
    out: list[Source] = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            out.extend(_directory_sources(entry, ignored))
            continue
        source = classify(entry)
        if source is not None:
            out.append(source)
        elif ignored is not None:
            ignored.append(str(entry))
    return out


def _hf_dataset_sources(root: Path) -> list[Source]:
    """The arrow shards of a `save_to_disk` directory, in the order `state.json` lists them."""
    try:
        state = json.loads((root / "state.json").read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorpusError(f"{root / 'state.json'}: not a Hugging Face datasets state file "
                          f"({exc}); re-save the dataset with save_to_disk") from exc
    missing = [name for name in names if not (root / name).is_file()]
    if missing or not names:
        raise CorpusError(f"{root}: Hugging Face dataset shards missing: {missing or 'none listed'}"
                          "; re-save the dataset with save_to_disk")
    return [Source(root / name, "arrow") for name in names]


def read_source(source: Source, text_key: str, report: Report) -> Iterator[str]:
    """The documents of one source (its records' text under `source.text_key`, else
    `text_key`); problems go to `report`, reading goes on where it can. A file that is another
    format in disguise (`sniff_mismatch`) is one problem, not one per line."""
    reader = _READERS[source.fmt]
    try:
        mismatch = sniff_mismatch(source)
        if mismatch:
            report(source.path, "", mismatch)
            return
        yield from reader(source, source.text_key or text_key, report)
    except READ_ERRORS as exc:  # a corrupt or truncated file: say so, go on with the next
        report(source.path, "", f"cannot be read ({' '.join(str(exc).split())})")


def sniff_mismatch(source: Source) -> str:
    """Why `source` is not the format its name says, when its first bytes are the magic number
    of another (`MAGIC`: a parquet file named .jsonl), else ''. Parquet and arrow files are
    read by pyarrow, which names its own errors; compressed files are checked by their
    decompressor."""
    if source.fmt in ("parquet", "arrow") or source.compression:
        return ""
    with source.path.open("rb") as fh:
        head = fh.read(8)
    for magic, name, fixed in MAGIC:
        if head.startswith(magic):
            new = fixed.format(stem=source.path.stem, name=source.path.name)
            return (f"looks like a {name} file (it starts with the magic bytes "
                    f"{magic.decode('latin-1')!r}), not {source.fmt}; rename it to {new}")
    return ""


PEEKED_FORMATS: tuple[str, ...] = ("jsonl", "csv", "tsv", "parquet", "arrow")
"""Formats whose first record is cheap to read (a line, a header, a schema): checked before the
corpus is read (`first_record_problems`). Not text (a file is a document) or `.json` (its
array is parsed whole)."""


class _FirstProblem(Exception):
    """Stops a reader at the first problem of a file (`first_record_problems`)."""


def first_record_problems(sources: list[Source], text_key: str, limit: int = 64) -> list[str]:
    """``"<where>: <reason>"`` of each of the first ``limit`` sources of a `PEEKED_FORMATS`
    format whose first record cannot be read (no `text_key`, invalid JSON, bad UTF-8, a
    corrupt file). A systematic mistake, above all a corpus that names its text field
    otherwise, shows here in milliseconds, where reading a large corpus would take minutes
    before the same error."""

    def stop(path: Path, at: str, reason: str) -> None:
        raise _FirstProblem(f"{path}{at}: {reason}")

    problems: list[str] = []
    for source in [s for s in sources if s.fmt in PEEKED_FORMATS][:limit]:
        documents = read_source(source, text_key, stop)
        try:
            next(documents, None)
        except _FirstProblem as problem:
            problems.append(str(problem))
        finally:
            documents.close()
    return problems


def _open(source: Source) -> IO[bytes]:
    """The file's bytes, decompressed according to its compression suffix."""
    if source.compression == ".gz":
        return gzip.open(source.path, "rb")
    if source.compression == ".zst":
        raw = source.path.open("rb")
        return io.BufferedReader(  # type: ignore[arg-type]
            zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True,
                                                       closefd=True))
    return source.path.open("rb")


def _decode(raw: bytes, path: Path, at: str, report: Report, start: int = 0) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        report(path, at, f"not valid UTF-8 at byte offset {start + exc.start}")
        return None


def _read_text(source: Source, _key: str, report: Report) -> Iterator[str]:
    with _open(source) as fh:
        text = _decode(fh.read(), source.path, "", report)
    if text is not None:
        yield text


def _record_text(record: Any, text_key: str, source: Source, at: str, report: Report
                 ) -> str | None:
    """The document of one record: the string under `text_key` (or the record, if a string)."""
    if isinstance(record, str):
        return record
    value = record.get(text_key) if isinstance(record, dict) else None
    if isinstance(value, str):
        return value
    report(source.path, at, f"no string under key {text_key!r}{_key_hint(record, source)}")
    return None


def key_fix(source: Source, key: str | None = None) -> str:
    """The setting that reads `source`'s text under `key` (None: some other key): data.text_key,
    or the ':KEY' suffix of its data.input part when the part has one (issue 35, item 9)."""
    if source.text_key is None:
        return "set data.text_key" if key is None else f"set --data.text_key={key}"
    return ("fix the ':KEY' suffix of its data.input part" if key is None else
            f"write ':{key}', not ':{source.text_key}', after its data.input part")


def _key_hint(record: Any, source: Source) -> str:
    """What a record lacking the text key holds, and the fix (:func:`key_fix`): the key by name
    when exactly one of its fields is a string (the usual cause: the corpus names it
    otherwise)."""
    if not isinstance(record, dict):
        return f" (the record is a JSON {type(record).__name__}); fix the record"
    strings = [str(k) for k, v in record.items() if isinstance(v, str)]
    keys = f" (keys: {', '.join(map(str, record))[:120]})"
    return f"{keys}; {key_fix(source, strings[0] if len(strings) == 1 else None)} or fix the record"


def _read_jsonl(source: Source, text_key: str, report: Report) -> Iterator[str]:
    """One document per non-blank line; byte offsets count from the start of the file."""
    offset = 0
    with _open(source) as fh:
        for line_no, raw in enumerate(fh, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            at = f":{line_no}"
            line = _decode(raw, source.path, at, report, start)
            if line is None:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                report(source.path, at, json_problem(exc, line_no))
                continue
            text = _record_text(record, text_key, source, at, report)
            if text is not None:
                yield text


def json_problem(exc: json.JSONDecodeError, line: int) -> str:
    """The whole of a JSON error, at `line` of the file (a .jsonl's record line, or the line
    in a .json document) and its column: 'invalid JSON: Invalid control character at line 3
    column 14 (a raw tab, newline or other control character inside a string: escape it as
    \\t, \\n or \\uXXXX)'."""
    where = f"line {line} column {exc.colno}"
    msg = f"{exc.msg} {where}" if exc.msg.endswith(" at") else f"{exc.msg} at {where}"
    if exc.msg.startswith("Invalid control character"):
        msg += (" (a raw tab, newline or other control character inside a string: escape it "
                "as \\t, \\n or \\uXXXX)")
    return f"invalid JSON: {msg}"


def _read_json(source: Source, text_key: str, report: Report) -> Iterator[str]:
    """A JSON array of records or strings (a single record is one document); a `.json` file
    holding one record per line (as Hugging Face's json loader accepts) is read as JSON lines."""
    with _open(source) as fh:
        text = _decode(fh.read(), source.path, "", report)
    if text is None:
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            yield from _read_jsonl(source, text_key, report)
        else:
            report(source.path, "", json_problem(exc, exc.lineno))
        return
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        report(source.path, "", "expected a JSON array of records; use .jsonl for one per line")
        return
    for i, record in enumerate(data):
        doc = _record_text(record, text_key, source, f"[{i}]", report)
        if doc is not None:
            yield doc


def _read_csv(source: Source, text_key: str, report: Report) -> Iterator[str]:
    """A header row, then one document per row from column `text_key` (tab-separated for tsv)."""
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))  # documents can be long
    delimiter = "\t" if source.fmt == "tsv" else ","
    with _open(source) as fh, io.TextIOWrapper(fh, encoding="utf-8", newline="") as text:
        rows = csv.reader(text, delimiter=delimiter)
        row_no = 1
        try:
            header = next(rows, None)
            if header is None or text_key not in header:
                report(source.path, "", f"no column {text_key!r} in the header "
                       f"({', '.join(header or [])[:200]}); {key_fix(source)}")
                return
            col = header.index(text_key)
            for row_no, row in enumerate(rows, start=2):
                if col < len(row):
                    yield row[col]
                else:
                    report(source.path, f":{row_no}", f"row has no {text_key!r} column")
        except UnicodeDecodeError as exc:
            report(source.path, "", f"not valid UTF-8 after row {row_no} ({exc.reason}); "
                   "the rows after it were not read")


def _read_columnar(source: Source, text_key: str, report: Report) -> Iterator[str]:
    """The `text_key` column of a parquet or arrow file, one document per row."""
    import pyarrow as pa

    def is_text(kind: Any) -> bool:
        return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind)
                    or pa.types.is_string_view(kind))

    batches, schema = _record_batches(source, text_key)
    if text_key not in schema.names:
        texts = [f.name for f in schema if is_text(f.type)]
        fix = key_fix(source, texts[0] if len(texts) == 1 else None)
        report(source.path, "", f"no column {text_key!r} (columns: "
               f"{', '.join(schema.names)[:200]}); {fix}")
        return
    kind = schema.field(text_key).type
    if not is_text(kind):
        report(source.path, "", f"column {text_key!r} has type {kind}, not string")
        return
    row = 0
    for batch in batches:
        for value in batch.column(text_key).to_pylist():
            if value is None:
                report(source.path, f"[row {row}]", f"null under {text_key!r}")
            else:
                yield value
            row += 1


def _record_batches(source: Source, text_key: str) -> tuple[Iterator[Any], Any]:
    """(record batches holding `text_key`, schema) of a parquet or Arrow IPC file."""
    import pyarrow as pa

    if source.fmt == "parquet":
        import pyarrow.parquet as pq

        pfile = pq.ParquetFile(source.path)
        schema = pfile.schema_arrow
        cols = [text_key] if text_key in schema.names else []
        return pfile.iter_batches(batch_size=ROWS_PER_BATCH, columns=cols), schema
    mapped = pa.memory_map(str(source.path))
    try:
        stream = pa.ipc.open_stream(mapped)
        return iter(stream), stream.schema
    except pa.ArrowInvalid:
        mapped.seek(0)
        ipc_file = pa.ipc.open_file(mapped)
        return (ipc_file.get_batch(i) for i in range(ipc_file.num_record_batches)), \
            ipc_file.schema


_READERS: dict[str, Callable[[Source, str, Report], Iterator[str]]] = {
    "text": _read_text, "jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv,
    "tsv": _read_csv, "parquet": _read_columnar, "arrow": _read_columnar,
}
