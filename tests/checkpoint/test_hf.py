"""Hugging Face interop: random local transformers models, logits parity under tp2 x pp2,
lossless round trips, and the CLI."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

VOCAB, SEQ = 101, 12


def _hf_model(arch: str, tie: bool) -> Any:
    """A random transformers model (no download) with every weight randomised."""
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16,
            rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=tie)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4,
                                      n_positions=16, bos_token_id=0, eos_token_id=0,
                                      attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 and p.shape[0] == 32
                                                 else 0.0))
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _save(model: Any, directory: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory)
    return directory


def _parallel_logits(hf_dir: str, tp: int, pp: int) -> torch.Tensor | None:
    """Rank side: load the HF dir into tp x pp chunks, forward, gather logits [b, s, V]."""
    from colonnade.checkpoint.hf import load_hf_into_chunks, read_hf
    from colonnade.config.sections import Config, ParallelConfig, TrainingConfig
    from colonnade.models.build import build_chunks
    from colonnade.parallel.dims import ParallelDims
    from colonnade.parallel.groups import ProcessGroups
    from colonnade.pipeline.p2p import message_shape
    from colonnade.tensor_parallel import mappings as mp

    torch.set_num_threads(1)
    model_cfg, _ = read_hf(hf_dir)
    cfg = Config(model=model_cfg, parallel=ParallelConfig(tp=tp, pp=pp),
                 training=TrainingConfig(precision="fp32"))
    groups = ProcessGroups.build(ParallelDims(tp=tp, pp=pp))
    (chunk,) = build_chunks(cfg, groups)
    load_hf_into_chunks([chunk], groups, hf_dir)
    chunk.eval()
    tokens = _tokens()
    with torch.no_grad():
        x = tokens if groups.is_first_stage else torch.empty(
            message_shape(tokens.shape, model_cfg.hidden_size, tp, False))  # [b, s, h]
        if not groups.is_first_stage:
            groups.pp.p2p([], [(x, groups.pp_peer(groups.pp_rank - 1))]).wait()
        y = chunk(x)  # hidden [b, s, h] or logits [s, b, V'/tp]
        if not groups.is_last_stage:
            groups.pp.p2p([(y, groups.pp_peer(groups.pp_rank + 1))], []).wait()
            return None
        logits = mp.gather_last(y, groups.tp)[..., :VOCAB]  # [s, b, V]
    return logits.transpose(0, 1).contiguous() if groups.tp.rank == 0 else None


@pytest.mark.parametrize(("arch", "tie"), [("llama", False), ("llama", True), ("gpt2", True)])
def test_hf_logits_parity_tp2_pp2(run_ranks: Callable[..., list[Any]], tmp_path: Path,
                                  arch: str, tie: bool) -> None:
    model = _hf_model(arch, tie)
    hf_dir = _save(model, tmp_path / "hf")
    with torch.no_grad():
        ref = model(_tokens()).logits  # [b, s, V]
    out = [r for r in run_ranks(4, _parallel_logits, str(hf_dir), 2, 2) if r is not None]
    assert len(out) == 1
    err = float((out[0] - ref).abs().max())
    assert err <= 1e-5, f"max |logits diff| {err:.2e}"
    assert float(ref.abs().max()) > 1.0  # a test that cannot pass by accident


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_round_trip_is_lossless(tmp_path: Path, arch: str) -> None:
    """HF -> Colonnade -> HF gives identical tensors, a config transformers loads, same logits."""
    from safetensors.torch import load_file

    from colonnade.checkpoint.convert import from_hf, read_full_model
    from colonnade.checkpoint.export import load_exported
    from colonnade.hf_export import to_hf

    model = _hf_model(arch, tie=arch == "gpt2")
    hf_dir = _save(model, tmp_path / "hf")
    ckpt = from_hf(hf_dir, tmp_path / "ck")
    out = to_hf(tmp_path / "ck", tmp_path / "hf2")
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    _, full1 = read_full_model(ckpt)
    _, full2 = read_full_model(from_hf(out, tmp_path / "ck2"))
    assert all(torch.equal(full1[k], full2[k]) for k in full1) and full1.keys() == full2.keys()
    cls = type(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = cls.from_pretrained(out).eval()
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, model(tokens).logits)
    _, ours = load_exported(tmp_path / "ck")  # the `generate` path reads checkpoints too
    with torch.no_grad():
        mine = ours.full_logits(tokens)
        assert float((mine - model(tokens).logits).abs().max()) <= 1e-5


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    """An HF model of another width loaded into this model: the error names the tensor."""
    from colonnade.checkpoint.format import CheckpointError
    from colonnade.checkpoint.hf import load_hf_into_chunks, read_hf
    from colonnade.config.sections import Config
    from colonnade.models.build import build_reference
    from colonnade.parallel.groups import ProcessGroups

    hf_dir = _save(_hf_model("llama", False), tmp_path / "hf")
    model_cfg, _ = read_hf(hf_dir)
    import dataclasses

    other = dataclasses.replace(model_cfg, ffn_hidden_size=96)
    model = build_reference(Config(model=other))
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.up\.weight.*\(64, 32\)"):
        load_hf_into_chunks([model], ProcessGroups.single(), hf_dir)


def test_cli_convert(tmp_path: Path) -> None:
    from colonnade.cli import main

    hf_dir = _save(_hf_model("gpt2", True), tmp_path / "hf")
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "ck")]) == 0
    assert (tmp_path / "ck" / "latest").exists()
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "config.json").exists()


def test_convert_progress_bars_change_no_byte(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`colonnade convert` shows a bytes bar on a terminal (reading the HF shards, writing
    model.safetensors) and writes the same files as without it."""
    import io
    import sys

    from colonnade.checkpoint.convert import from_hf, read_full_model
    from colonnade.hf_export import to_hf

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    hf_dir = _save(_hf_model("llama", False), tmp_path / "hf")
    quiet = to_hf(from_hf(hf_dir, tmp_path / "ck0"), tmp_path / "out0")
    shown = Terminal()
    monkeypatch.setattr(sys, "stderr", shown)
    ckpt = from_hf(hf_dir, tmp_path / "ck1", progress=True)
    out = to_hf(ckpt, tmp_path / "out1", progress=True)
    monkeypatch.undo()
    text = shown.getvalue()
    assert "read hf: 100%" in text and "write model.safetensors: 100%" in text, text
    assert (out / "model.safetensors").read_bytes() == (quiet / "model.safetensors").read_bytes()
    _, a = read_full_model(ckpt)
    _, b = read_full_model(tmp_path / "ck0")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_convert_never_replaces_and_leaves_nothing_half_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--from-hf into a directory holding a checkpoint is refused (exit 2) before the HF model
    is read, the checkpoint untouched; a --to-hf stopped mid-write (Ctrl-C) leaves neither the
    output nor its hidden temporary directory, a --from-hf stopped so no checkpoint dir."""
    import colonnade.checkpoint.convert as convert
    import colonnade.hf_export as hf_export
    from colonnade.cli import main

    hf_dir = _save(_hf_model("gpt2", True), tmp_path / "hf")
    ckpt = convert.from_hf(hf_dir, tmp_path / "ck")
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())

    def no_read(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("the HF model must not be read")

    monkeypatch.setattr(convert, "read_hf", no_read)
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "ck")]) == 2
    assert f"{tmp_path / 'ck'} already holds a checkpoint ({ckpt.name})" in \
        capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before

    def stopped(path: Path, *_a: Any, **_k: Any) -> None:
        Path(path).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_export, "write_safetensors_stream", stopped)
    with pytest.raises(KeyboardInterrupt):
        hf_export.to_hf(tmp_path / "ck", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]
    monkeypatch.undo()

    def interrupted(*_a: Any, **_k: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "write_rank_shard", interrupted)  # --from-hf stopped
    with pytest.raises(KeyboardInterrupt):
        convert.from_hf(hf_dir, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]
