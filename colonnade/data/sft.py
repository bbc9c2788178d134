"""Supervised fine-tuning data: prompt/response records -> tokens plus a loss mask.

`colonnade prepare --data.format=sft` reads `.jsonl` / `.json` records (also `.gz` / `.zst`;
files, directories, globs and comma lists as `readers.resolve_input` takes them). A record is
either

* ``{prompt_key: str, response_key: str}`` (default keys "prompt" and "response"): the prompt
  text, then the response text, tokenized separately and joined (put any separator such as
  "\\n" or "Answer:" in the texts themselves); or
* chat-style ``{"messages": [{"role": str, "content": str}, ...]}``, rendered as text by
  :mod:`colonnade.data.chat`: with the tokenizer's own chat template when the given tokenizer
  (``data.tokenizer``) has one (transformers' ``apply_chat_template``; the template is then
  stored as ``tokenizer_config.json`` beside ``tokenizer.json``, travels into checkpoints and
  is what the HF export writes), else in the built-in format, one ``"<role>: <content>\\n"``
  per message (``"user: hi\\nassistant: hey\\n"``). Only the assistant replies are trained on.

Each example becomes one document of the indexed dataset, its tokens then EOD, exactly like a
pretraining document, and a second indexed dataset `mask.bin/.idx` with the same document
lengths holds one 0/1 per token: 1 for response (assistant) tokens and the closing EOD, 0 for
prompt, role headers and other turns. Training samples are packed windows over the token
stream, as in pretraining (:class:`colonnade.data.dataset.WindowDataset`; a window may end one
example and start the next): `WindowDataset` finds `mask.*` beside `data.*` and `collate` sets
the label of every position whose target token has mask 0 to IGNORE_INDEX (-100), so the loss
(:mod:`colonnade.training.step`) counts only response tokens.

The tokenizer, the manifest (`prepare.json`, reuse of unchanged inputs), the strict/skip policy
for bad records and the atomic write are the ones of :mod:`colonnade.data.prepare`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from colonnade.checkpoint.format import removed_on_failure
from colonnade.data.chat import (
    ChatTemplate,
    Segment,
    builtin_segments,
    check_messages,
    config_damage,
    find_chat_template,
    tokenizer_config,
    write_tokenizer_config,
)
from colonnade.data.corpus import (
    ERROR_POLICIES,
    DocumentStats,
    ErrorPolicy,
    no_documents_message,
    problems_message,
)
from colonnade.data.dataset import MASK_NAME, load_loss_mask
from colonnade.data.errors import CorpusError, DataError
from colonnade.data.indexed import IndexedDataset, IndexedDatasetWriter
from colonnade.data.prepare import (
    PreparedData,
    _changed_since,
    _given_tokenizer,
    _log_summary,
    _manifest_key,
    _try_reuse,
    _write_manifest,
)
from colonnade.data.readers import Source, _open, json_problem, resolve_input, sniff_mismatch
from colonnade.data.tokenizer import eod_id, save_tokenizer, train_bpe_from_texts

SFT_FORMATS = ("jsonl", "json")
"""Reader formats that hold SFT records."""


@dataclass(frozen=True)
class RecordFormat:
    """How records are read: the prompt/response keys, and the tokenizer's chat template for
    "messages" records (None: the built-in format)."""

    prompt_key: str = "prompt"
    response_key: str = "response"
    chat: ChatTemplate | None = None


def example_segments(record: Any, fmt: RecordFormat) -> list[Segment] | str:
    """The segments of one record (see the module docstring), or why it cannot be used."""
    prompt_key, response_key = fmt.prompt_key, fmt.response_key
    if not isinstance(record, dict):
        return "not a JSON object"
    if isinstance(record.get("messages"), list):
        messages = check_messages(record["messages"])
        if isinstance(messages, str):
            return messages
        return builtin_segments(messages) if fmt.chat is None else fmt.chat.segments(messages)
    prompt, response = record.get(prompt_key), record.get(response_key)
    if not isinstance(prompt, str) or not isinstance(response, str):
        keys = ", ".join(map(str, record))[:120]
        return (f"needs strings under {prompt_key!r} and {response_key!r} or a 'messages' list "
                f"(keys: {keys}); {_key_fix(record, prompt_key, response_key)}")
    return [(prompt, False), (response, True)]


def _key_fix(record: dict[Any, Any], prompt_key: str, response_key: str) -> str:
    """The options that would read ``record``: each missing key named when the record's other
    string fields are exactly as many, in their order (``{"question": .., "answer": ..}`` ->
    ``--data.prompt_key=question --data.response_key=answer``), else the fields to set."""
    options = {"prompt_key": prompt_key, "response_key": response_key}
    missing = [name for name, key in options.items() if not isinstance(record.get(key), str)]
    spare = [str(k) for k, v in record.items()
             if isinstance(v, str) and k not in options.values()]
    if len(spare) != len(missing):
        return "set data.prompt_key / data.response_key"
    return "set " + " ".join(f"--data.{name}={key}" for name, key in zip(missing, spare,
                                                                            strict=True))


def _records(source: Source, report: Callable[[Path, str, str], None]) -> Iterator[tuple[Any,
                                                                                          str]]:
    """(record, where) of one .jsonl or .json source; unreadable lines go to ``report`` (the
    JSON error in full, :func:`~colonnade.data.readers.json_problem`), and a file that is
    another format in disguise (:func:`~colonnade.data.readers.sniff_mismatch`: a parquet file
    named .jsonl) is one problem, not one per line."""
    mismatch = sniff_mismatch(source)
    if mismatch:
        report(source.path, "", mismatch)
        return
    with _open(source) as fh:
        if source.fmt == "json":
            try:
                data = json.loads(fh.read().decode("utf-8"))
            except UnicodeDecodeError as exc:
                report(source.path, "", f"not valid UTF-8 ({exc})")
                return
            except json.JSONDecodeError as exc:
                report(source.path, "", json_problem(exc, exc.lineno))
                return
            for i, record in enumerate(data if isinstance(data, list) else [data]):
                yield record, f"[{i}]"
            return
        for line_no, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                report(source.path, f":{line_no}", f"not valid UTF-8 ({exc})")
                continue
            except json.JSONDecodeError as exc:
                report(source.path, f":{line_no}", json_problem(exc, line_no))
                continue
            yield record, f":{line_no}"


def iter_examples(input: str | Path, fmt: RecordFormat, errors: ErrorPolicy,
                  stats: DocumentStats) -> Iterator[list[Segment]]:
    """Every usable example of ``input``, in order: an iterator that reads as it is consumed,
    returned once the checks passed. Bad records are counted in ``stats``; under
    errors='strict' one error listing them all is raised once the input is read, and the
    first record of each .jsonl file is checked by this call (:func:`first_example_problems`),
    so keys named otherwise fail at once rather than after a full read."""
    sources = resolve_input(input, stats.ignored)
    wrong = [f"{s.path} ({s.fmt})" for s in sources if s.fmt not in SFT_FORMATS]
    if wrong:
        raise DataError(f"data.format='sft' reads .jsonl/.json records of prompt/response or "
                        f"messages; these inputs are not: {', '.join(wrong[:5])}; convert them "
                        "or use data.format='text'")
    if errors == "strict" and (first := first_example_problems(sources, fmt)):
        raise CorpusError(
            f"the first record of {len(first)} file(s) is not an SFT example (checked before "
            "reading the input):\n" + "\n".join(f"  - {line}" for line in first)
            + "\nfix them, or leave unusable records out with data.errors='skip' "
            "(--data.errors=skip)")
    return _read_examples(sources, fmt, errors, stats)


def first_example_problems(sources: list[Source], fmt: RecordFormat, limit: int = 64
                           ) -> list[str]:
    """``"<where>: <reason>"`` for each of the first ``limit`` .jsonl sources whose first
    record is not a usable example, one line per file (reading stops at its first problem: a
    line, milliseconds; a .json array is parsed whole and is checked with the rest)."""
    problems: list[str] = []

    class FirstProblem(Exception):
        """Stops reading a file at its first problem."""

    def note(path: Path, at: str, reason: str) -> None:
        problems.append(f"{path}{at}: {reason}")
        raise FirstProblem

    for source in [s for s in sources if s.fmt == "jsonl"][:limit]:
        records = _records(source, note)
        try:
            first = next(records, None)
        except FirstProblem:
            continue
        finally:
            records.close()
        if first is not None:
            record, at = first
            segments = example_segments(record, fmt)
            if isinstance(segments, str):
                problems.append(f"{source.path}{at}: {segments}")
    return problems


def _read_examples(sources: list[Source], fmt: RecordFormat, errors: ErrorPolicy,
                   stats: DocumentStats) -> Iterator[list[Segment]]:
    for source in sources:
        for record, at in _records(source, stats.report):
            segments = example_segments(record, fmt)
            if isinstance(segments, str):
                stats.report(source.path, at, segments)
                continue
            stats.documents += 1
            stats.bytes += sum(len(text.encode("utf-8")) for text, _ in segments)
            yield segments
    if errors == "strict" and stats.problems:
        fix = "set data.prompt_key / data.response_key"
        if fmt.chat is not None:  # its refusals are the records' roles or turns, not keys
            fix = f"messages the chat template of {fmt.chat.directory} accepts; or {fix}"
        raise CorpusError(problems_message(stats, what="example(s)", fix=fix))


def encode_example(tok: Tokenizer, eod: int, segments: list[Segment]) -> tuple[np.ndarray,
                                                                               np.ndarray]:
    """Token ids of an example (its segments tokenized one by one, then EOD) and its mask:
    1 on tokens of trained segments and on the EOD, 0 elsewhere; both int64 [n]."""
    encodings = tok.encode_batch([text for text, _ in segments], add_special_tokens=False)
    ids = [i for enc in encodings for i in enc.ids] + [eod]
    mask = [int(trained) for enc, (_, trained) in zip(encodings, segments, strict=True)
            for _ in enc.ids] + [1]
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64)


def prepare_sft(input: str | Path, out_dir: Path, vocab_size: int | None,
                tokenizer_path: Path | None = None, *, prompt_key: str = "prompt",
                response_key: str = "response", errors: ErrorPolicy = "strict",
                progress: bool = True, log: Callable[[str], None] = print) -> PreparedData:
    """Tokenize SFT records into ``out_dir``: tokenizer.json, data.* and mask.* (see the module
    docstring). Arguments as :func:`colonnade.data.prepare.prepare`; checks run before any file
    is touched and a failure leaves ``out_dir`` as it was."""
    out_dir = Path(out_dir)
    if errors not in ERROR_POLICIES:
        raise DataError(f"data.errors={errors!r} must be one of {', '.join(ERROR_POLICIES)}")
    if not input:
        raise DataError("data.format='sft' needs data.input: a .jsonl/.json file (or folder) "
                        "of prompt/response or messages records")
    given = _given_tokenizer(tokenizer_path, vocab_size)
    chat = find_chat_template(tokenizer_path)
    fmt = RecordFormat(prompt_key, response_key, chat)
    tok_config = tokenizer_config(tokenizer_path, chat.template if chat else None)
    key = _manifest_key(input, vocab_size, tokenizer_path, "", errors, 0)
    key["sft"] = {"prompt_key": prompt_key, "response_key": response_key}
    if tok_config is not None:  # its chat template shapes the tokens
        key["sft"]["tokenizer_config_sha256"] = hashlib.sha256(
            json.dumps(tok_config, sort_keys=True).encode()).hexdigest()
    reused, damage = _try_reuse(out_dir, key)
    if reused is not None and not (damage := _mask_damage(reused)
                                   or config_damage(out_dir, tok_config)):
        log(f"prepare: reusing {out_dir} ({reused.num_docs} SFT examples, {reused.num_tokens} "
            "tokens; inputs unchanged)")
        return reused
    if damage:
        log(f"prepare: {out_dir} was built from these inputs but {damage}; tokenizing again")
    elif changed := _changed_since(out_dir, key):
        log(f"prepare: {out_dir} was built before {changed}; tokenizing again")
    if chat is not None:
        log(f"prepare: rendering chat records with the chat template of {chat.directory} "
            "(assistant replies trained on)")

    def examples(stats: DocumentStats) -> Iterator[list[Segment]]:
        return iter_examples(input, fmt, errors, stats)

    if given is None:
        first = examples(DocumentStats())  # the input's checks raise here, before the log
        log(f"prepare: training a byte-level BPE tokenizer (vocab_size={vocab_size})")
        with tqdm(first, desc="train tokenizer", unit="example",  # reads the input
                  disable=None if progress else True) as read:  # None: off when not a terminal
            given = train_bpe_from_texts(("".join(t for t, _ in ex) for ex in read),
                                         int(vocab_size or 0), None)
    with removed_on_failure(out_dir):
        result, stats = _write(given, examples, out_dir, tok_config, progress, log, input)
    _write_manifest(out_dir, key, result, stats, tokenizer_path)
    _log_summary(result, stats, log)
    return result


def _write(tok: Tokenizer, examples: Callable[[DocumentStats], Iterator[list[Segment]]],
           out_dir: Path, tok_config: dict[str, Any] | None, progress: bool,
           log: Callable[[str], None], input: str | Path
           ) -> tuple[PreparedData, DocumentStats]:
    """data.* and mask.* under temporary names, renamed into place only when all is read and
    gave an example (else CorpusError naming the files of ``input``); then tokenizer.json and
    tokenizer_config.json (``tok_config``; None: none)."""
    stats, eod = DocumentStats(), eod_id(tok)
    trained = 0
    start = time.perf_counter()
    with (IndexedDatasetWriter(out_dir / "data", tok.get_vocab_size()) as data,
          IndexedDatasetWriter(out_dir / MASK_NAME, 2) as mask,
          tqdm(desc="tokenize sft", unit="example",
               disable=None if progress else True) as bar):  # None: off when not a terminal
        for segments in examples(stats):
            ids, keep = encode_example(tok, eod, segments)
            data.add_document(ids)
            mask.add_document(keep)
            trained += int(keep.sum())
            bar.update(1)
        if not data.num_docs:  # raised here, the writers drop their temporary files
            raise CorpusError(no_documents_message(resolve_input(input), stats))
        (out_dir / "prepare.json").unlink(missing_ok=True)  # files change from here on
        save_tokenizer(tok, out_dir / "tokenizer.json")
        write_tokenizer_config(out_dir, tok_config)
    seconds = time.perf_counter() - start
    log(f"prepare: tokenized {data.num_docs} SFT examples in {seconds:.1f}s: {data.num_tokens} "
        f"tokens, {trained} of them trained on (responses + EOD), the rest masked")
    result = PreparedData(out_dir=out_dir, tokenizer_path=out_dir / "tokenizer.json",
                          prefix=out_dir / "data", vocab_size=tok.get_vocab_size(), eod_id=eod,
                          num_docs=data.num_docs, num_tokens=data.num_tokens, reused=False)
    return result, stats


def _mask_damage(prepared: PreparedData) -> str:
    """'' when the loss mask matches the data document for document, else what is wrong."""
    try:
        load_loss_mask(IndexedDataset(prepared.prefix))
    except DataError as err:
        return f"its loss mask is damaged ({err})"
    return ""
