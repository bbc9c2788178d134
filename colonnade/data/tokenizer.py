"""Byte-level BPE tokenizer (Hugging Face `tokenizers`): training, loading, end-of-document id.

Byte-level BPE (GPT-2 style) first maps every byte to one of 256 printable symbols, so any UTF-8
text is representable and `decode(encode(text)) == text` exactly; BPE then learns
`vocab_size - 257` merges on top of the 256 byte symbols and the special token `<|endoftext|>`,
which the pipeline appends after every document as its separator (EOD).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from colonnade.data.corpus import iter_documents
from colonnade.data.errors import TokenizerError

EOD_TOKEN = "<|endoftext|>"
"""Special token separating documents in the token stream."""

EOD_CANDIDATES: tuple[str, ...] = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
"""End-of-document tokens recognised in tokenizers not trained here, in order of preference."""

LEGACY_TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.model", "vocab.json", "merges.txt")
"""Slow-tokenizer files (SentencePiece, GPT-2 vocab/merges) a model directory may hold instead
of tokenizer.json; named in the error, with the one-line conversion."""

MIN_VOCAB_SIZE = 257
"""256 byte symbols plus the EOD special token."""


def train_bpe_tokenizer(files: Sequence[Path], vocab_size: int, out_path: Path) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `files` (strict UTF-8) and save it to `out_path`.

    Each file is read as one document. The result may hold fewer than `vocab_size` tokens when the
    corpus offers no more merges. The file is written atomically (temp file, then rename).
    """
    if not files:
        raise TokenizerError("train_bpe_tokenizer got no files; pass at least one text file")

    def texts() -> Iterable[str]:
        for file in files:
            yield from iter_documents(Path(file))

    return train_bpe_from_texts(texts(), vocab_size, out_path)


def train_bpe_from_texts(
    texts: Iterable[str], vocab_size: int, out_path: Path | None
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on an iterable of documents; save it to `out_path`
    unless that is None. An exception raised by `texts` propagates once training stops."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small for byte-level BPE; "
            f"use at least {MIN_VOCAB_SIZE} (256 bytes + {EOD_TOKEN})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if out_path is not None:
        save_tokenizer(tok, out_path)
    return tok


def save_tokenizer(tok: Tokenizer, out_path: Path) -> None:
    """Write `tok` as tokenizer.json to `out_path` atomically (temp file, then rename)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tok.save(str(tmp))
    os.replace(tmp, out_path)


def load_tokenizer(path: Path) -> Tokenizer:
    """Load any Hugging Face `tokenizer.json` (a directory holding one is accepted too)."""
    path = Path(path)
    if path.is_dir():
        legacy = [n for n in LEGACY_TOKENIZER_FILES if (path / n).is_file()]
        path = path / "tokenizer.json"
        if legacy and not path.is_file():
            raise TokenizerError(
                f"{path.parent} holds {', '.join(legacy)} but no tokenizer.json (the fast "
                "tokenizer format read here); write one with transformers: "
                f"AutoTokenizer.from_pretrained('{path.parent}').save_pretrained('{path.parent}')"
            )
    if not path.is_file():
        raise TokenizerError(
            f"{path}: tokenizer file not found; pass the path of a tokenizer.json (or a model "
            "directory holding one) or run `colonnade prepare` to train one"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON or schema
        raise TokenizerError(
            f"{path}: not a valid tokenizer.json ({exc}); re-create it with `colonnade prepare` "
            "or download the tokenizer again"
        ) from exc


def eod_id(tok: Tokenizer) -> int:
    """Id of the end-of-document token (`<|endoftext|>`, else a common EOS such as `</s>`)."""
    for token in EOD_CANDIDATES:
        tid = tok.token_to_id(token)
        if tid is not None:
            return tid
    raise TokenizerError(
        f"tokenizer has none of the end-of-document tokens {', '.join(EOD_CANDIDATES)}; "
        f"add {EOD_TOKEN} as a special token or train one with `colonnade prepare`"
    )
