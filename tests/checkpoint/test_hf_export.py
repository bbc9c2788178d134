"""HF export (issue 14, item 14): a Colonnade checkpoint exported with ``convert --to-hf`` loads
in transformers (model, tokenizer, text-generation pipeline) without a warning, its special
tokens are the tokenizer's EOD token, transformers' greedy tokens equal ``colonnade.generate``'s
and ``--dtype bf16`` writes bf16 tensors."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from colonnade.checkpoint.convert import read_full_model, write_model_checkpoint
from colonnade.checkpoint.export import full_state, load_exported
from colonnade.config.sections import Config, ModelConfig
from colonnade.data.tokenizer import EOD_TOKEN, eod_id, load_tokenizer, train_bpe_from_texts
from colonnade.generate import generate
from colonnade.hf_export import EXPORT_DTYPES, to_hf
from colonnade.models.build import build_reference
from colonnade.parallel.groups import ProcessGroups

TEXTS = ["def foo(x):\n    return x + 1\n" * 3, "class Bar:\n    pass\n" * 4,
         "hello world, hello there " * 5, "import os\nprint(os.getcwd())\n" * 3]
PROMPT = "def foo"


def _checkpoint(root: Path, arch: str, extra_vocab: int = 3) -> Path:
    """A committed Colonnade checkpoint of a tiny random model with its BPE tokenizer.json
    (model vocabulary = the tokenizer's + ``extra_vocab``)."""
    tok = train_bpe_from_texts(TEXTS, 300, root / "tok" / "tokenizer.json")
    gpt2 = arch == "gpt2"
    model_cfg = ModelConfig(arch=arch, num_layers=2, hidden_size=32, num_heads=4,
                            num_kv_heads=None if gpt2 else 2, max_seq_len=32,
                            vocab_size=tok.get_vocab_size() + extra_vocab,
                            tie_embeddings=gpt2, bias=gpt2, init_std=0.3)
    config = Config(model=model_cfg)
    model = build_reference(config)
    write_model_checkpoint(root / "ck", config, full_state([model], ProcessGroups.single()),
                           root / "tok")
    return root / "ck"


@contextmanager
def _transformers_complaints() -> Iterator[list[str]]:
    """Every Python warning and every transformers log record of level WARNING or above."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    found: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
        found.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)
        found.extend(line for line in stream.getvalue().splitlines() if line.strip())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_export_loads_without_warnings_and_generates_like_colonnade(tmp_path: Path,
                                                                     arch: str) -> None:
    ckpt = _checkpoint(tmp_path, arch)
    out = to_hf(ckpt, tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= names
    ours = load_tokenizer(tmp_path / "tok")
    eod = eod_id(ours)
    cfg = json.loads((out / "config.json").read_text())
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] == gen_cfg[key] == eod, key
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_cfg["model_max_length"] == 32
    assert json.loads((out / "special_tokens_map.json").read_text()) == dict.fromkeys(
        ("bos_token", "eos_token", "pad_token"), EOD_TOKEN)

    with _transformers_complaints() as complaints:
        model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        tok = transformers.AutoTokenizer.from_pretrained(out)
        pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok)
        text = pipe(PROMPT, max_new_tokens=10, do_sample=False)[0]["generated_text"]
        ids = tok(PROMPT, return_tensors="pt")
        hf_out = model.generate(**ids, max_new_tokens=10, do_sample=False)
    assert complaints == [], complaints
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (eod, eod, eod)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    prompt_ids = ours.encode(PROMPT, add_special_tokens=False).ids
    assert ids["input_ids"][0].tolist() == prompt_ids

    _, mine = load_exported(ckpt)
    prompt = torch.tensor([prompt_ids])
    col_out = generate(mine, prompt, 10, temperature=0.0, eod=eod)
    assert hf_out.tolist() == col_out.tolist()
    assert col_out.shape[1] > prompt.shape[1] + 3  # it really generated
    assert text == ours.decode(col_out[0].tolist())
    with torch.no_grad():
        ref, got = mine.full_logits(col_out), model(col_out).logits
    assert float(ref.abs().max()) > 1.0
    assert float((ref - got).abs().max()) <= 1e-5


def test_export_dtype_bf16_and_refusals(tmp_path: Path) -> None:
    from colonnade.cli import build_parser, main

    ckpt = _checkpoint(tmp_path, "llama")
    out = tmp_path / "hf16"
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(out), "--dtype", "bf16"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    _, full = read_full_model(ckpt)
    state = load_file(str(out / "model.safetensors"))
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    assert torch.equal(state["model.embed_tokens.weight"],
                       full["embedding.word.weight"].to(torch.bfloat16))
    with _transformers_complaints() as complaints:
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert complaints == [] and model.dtype == torch.bfloat16

    before = (out / "model.safetensors").read_bytes()
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(out), "--dtype", "fp32"]) == 2
    assert (out / "model.safetensors").read_bytes() == before  # an export is never overwritten
    assert main(["convert", "--from-hf", str(out), "--out", str(tmp_path / "x"),
                 "--dtype", "fp16"]) == 2
    assert not (tmp_path / "x").exists()
    convert = next(a for a in build_parser()._subparsers._group_actions[0].choices["convert"]
                   ._actions if a.dest == "dtype")
    assert set(convert.choices) == set(EXPORT_DTYPES)


def test_export_keeps_an_imported_tokenizer_config(tmp_path: Path) -> None:
    """A checkpoint imported from HF keeps its tokenizer_config.json (here bos differs from eos);
    the ids in config.json follow its tokens."""
    ckpt = _checkpoint(tmp_path, "gpt2")
    step = ckpt / (ckpt / "latest").read_text().strip()
    tok = load_tokenizer(tmp_path / "tok")
    bos = tok.id_to_token(5)
    (step / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
         "chat_template": "{{ messages }}"}))
    out = to_hf(ckpt, tmp_path / "hf")
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == "{{ messages }}"
    cfg = json.loads((out / "config.json").read_text())
    eod = eod_id(tok)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (5, eod, eod)


def test_a_tokenizer_outside_the_vocabulary_is_refused_before_writing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from colonnade.cli import main

    ckpt = _checkpoint(tmp_path, "llama", extra_vocab=-10)  # model vocab 10 below the tokenizer's
    step = ckpt / (ckpt / "latest").read_text().strip()
    tok = load_tokenizer(tmp_path / "tok")
    high = tok.get_vocab_size() - 2
    (step / "tokenizer_config.json").write_text(json.dumps({"bos_token": tok.id_to_token(high)}))
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"bos_token {tok.id_to_token(high)!r} has id {high}, outside model.vocab_size=" \
        f"{tok.get_vocab_size() - 10}" in err
    assert not (tmp_path / "hf").exists()
