"""Fine-tuning (`colonnade train --init-from`): weights, model shape and tokenizer from a
Colonnade checkpoint or a Hugging Face directory, step / optimizer / data fresh, in any layout;
`checkpoint.load` stays exact resume and refuses what it cannot resume; tokenizer mismatches
(checkpoint vs data, data.blend) are refused before any work."""

from __future__ import annotations

import hashlib
import json
import shutil
import tomllib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from colonnade.cli import main
from tests.checkpoint import harness as H
from tests.reliability.jobs import write_corpus

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model.num_layers=2", "--model.hidden_size=32", "--model.num_heads=4",
        "--model.num_kv_heads=2", "--model.ffn_hidden_size=64", "--model.vocab_size=300",
        "--model.max_seq_len=32"]


# ---------------------------------------------------------------- rank side (pool harness)

def _run_init(layout: H.Layout, src: str, hf: bool) -> dict[str, Any]:
    """Init-from ``src`` under ``layout``: gathered params, step, optimizer step count, then
    the LR of one step (a fresh schedule's first LR) and of a fresh run's first step."""
    from colonnade.checkpoint.finetune import init_weights, with_init_from
    from colonnade.config.sections import CheckpointConfig
    from colonnade.parallel.dims import ParallelDims
    from colonnade.parallel.groups import ProcessGroups
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    torch.set_num_threads(1)
    cfg = H.make_config(layout)
    if hf:  # the model shape comes from config.json, not from the test's config
        import dataclasses

        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_size=64),
                                  checkpoint=CheckpointConfig(init_from=src))
        cfg = with_init_from(cfg, explicit=())
    groups = ProcessGroups.build(ParallelDims(tp=layout.tp, pp=layout.pp, dp=layout.dp))
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups), None)
    fresh_loss = H.train_steps(Trainer(Runtime(cfg, torch.device("cpu"), groups), None), 1)
    note = init_weights(trainer, src)
    params = {k: v.clone() for k, v in H.gathered(trainer).items()}  # before the step below
    out = {"params": params, "step": trainer.step, "note": note,
           "step_count": trainer.optimizer.step_count, "hidden": cfg.model.hidden_size,
           "arch": cfg.model.arch}
    info = trainer.train_step(H.batches_for(0, groups.dp.rank, groups.dp.size))
    out.update(lr=info["lr"], loss=info["loss"], fresh_loss=fresh_loss[0])
    return out


@pytest.mark.parametrize("layout", [H.Layout(tp=2), H.Layout(dp=2, zero=True), H.Layout(pp=2)],
                         ids=str)
def test_init_from_colonnade_checkpoint_in_another_layout(
        run_ranks: Callable[..., list[Any]], tmp_path: Path, layout: H.Layout) -> None:
    from colonnade.checkpoint.convert import read_full_model

    root = tmp_path / "ck"
    run_ranks(1, H.run_save, H.Layout(), H.path(root), 3, 0)  # 3 trained steps, saved at tp1
    _cfg, source = read_full_model(root)
    results = run_ranks(layout.world, _run_init, layout, H.path(root), False)
    params = H.merge(results)
    assert params.keys() == source.keys()
    for k in source:
        assert torch.equal(params[k], source[k]), k  # the saved weights, resharded exactly
    assert all(r["step"] == 0 and r["step_count"] == 0 for r in results)
    assert "fresh optimizer" in results[0]["note"]
    # the LR of the first step after init-from is a fresh schedule's first LR (warmup 1/2 of
    # 1e-2), not the saved run's step-4 LR; the loss is the trained model's (lower than fresh)
    assert all(r["lr"] == pytest.approx(5e-3) for r in results)
    assert results[0]["loss"] < results[0]["fresh_loss"] - 0.05


def _hf_dir(where: Path, tokenizer: Path | None, vocab: int = 300, arch: str = "llama") -> Path:
    """A tiny random transformers model saved with save_pretrained (+ a tokenizer.json)."""
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            rope_theta=500.0, rms_norm_eps=1e-6, tie_word_embeddings=False))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=32,
            attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(where)
    if tokenizer is not None:
        shutil.copy(tokenizer, where / "tokenizer.json")
    return where


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_init_from_hf_dir_takes_its_config_in_tp2(run_ranks: Callable[..., list[Any]],
                                                  tmp_path: Path, arch: str) -> None:
    from colonnade.checkpoint.hf import read_hf

    hf = _hf_dir(tmp_path / "hf", None, vocab=101, arch=arch)
    _model, source = read_hf(hf)
    results = run_ranks(2, _run_init, H.Layout(tp=2), str(hf), True)
    assert results[0]["hidden"] == 32  # from config.json, not the 64 the config said
    assert results[0]["arch"] == arch
    assert "no tokenizer.json" in results[0]["note"]  # said, not silently skipped
    params = H.merge(results)
    assert params.keys() == source.keys()
    for k in source:
        assert torch.equal(params[k], source[k].double()), k
    assert all(r["step"] == 0 and r["step_count"] == 0 for r in results)


# ---------------------------------------------------------------- CLI (single process)

def _tree_hash(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Corpora and prepared dirs: 'a' (own BPE), 'b_same' (other text, a's tokenizer),
    'b_other' (other text, its own BPE of the same vocab size)."""
    root = tmp_path_factory.mktemp("ft")
    text_a = write_corpus(root / "text_a", docs=3, words=1200)
    text_b = root / "text_b"
    text_b.mkdir()
    for i, p in enumerate(sorted((REPO / "colonnade" / "config").glob("*.py"))):
        (text_b / f"d{i}.py").write_text(p.read_text())
    out: dict[str, Any] = {"root": root}
    for name, text, tok in (("a", text_a, None), ("b_same", text_b, root / "a/tokenizer.json"),
                            ("b_other", text_b, None)):
        args = [f"--data.input={text}", f"--data.prepared_dir={root / name}"] + (
            [f"--data.tokenizer={tok}"] if tok else [])
        assert main(["prepare", *args, "--model.vocab_size=300"]) == 0
        out[name], out[f"{name}_args"] = root / name, args  # train reuses it with these args
    assert (json.loads((root / "a/tokenizer.json").read_text())
            != json.loads((root / "b_other/tokenizer.json").read_text()))
    return out


def _run(data: dict[str, Any], prepared: str, run: Path, *extra: str) -> int:
    return main(["train", *data[f"{prepared}_args"], "--training.seq_len=16",
                 "--training.micro_batch_size=2", "--training.steps=2",
                 "--training.eval_interval=0", "--training.device=cpu",
                 "--optim.warmup_steps=1", f"--logging.dir={run}", "--logging.progress=false",
                 "--logging.tensorboard=false", "--logging.log_interval=1", *extra])


def _steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_converted_hf_checkpoint_refused_by_load_and_trained_by_init_from(
        data: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Item 9: convert --from-hf then checkpoint.load crashed with KeyError 'total_steps'."""
    hf = _hf_dir(tmp_path / "hf", data["a"] / "tokenizer.json")
    ck = tmp_path / "ck"
    assert main(["convert", "--from-hf", str(hf), "--out", str(ck)]) == 0
    for mode in ("check", "config"):
        status = _run(data, "a", tmp_path / "r0", *TINY, f"--checkpoint.load={ck}",
                      f"--checkpoint.lr_schedule={mode}")
        err = capsys.readouterr().err
        assert status == 2, err
        assert "holds weights only" in err and f"--init-from={ck}" in err, err
    assert not (tmp_path / "r0").exists()  # refused before anything was written
    run = tmp_path / "r1"
    assert _run(data, "a", run, f"--init-from={ck}") == 0  # no --model.* needed
    out = capsys.readouterr().out
    assert "initialised the weights from checkpoint" in out
    assert _steps(run) == [1, 2]
    saved = (run / "config.toml").read_text()
    assert "rope_theta = 500.0" in saved and "norm_eps = 1e-06" in saved


def test_load_of_hf_dir_points_at_init_from_which_takes_config_json(
        data: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Item 10: checkpoint.load=<HF dir> ignored config.json (every field had to be restated)."""
    hf = _hf_dir(tmp_path / "hf", data["a"] / "tokenizer.json")
    assert _run(data, "a", tmp_path / "r0", f"--checkpoint.load={hf}") == 2
    err = capsys.readouterr().err
    assert "is a Hugging Face model directory" in err and f"--init-from={hf}" in err, err
    assert _run(data, "a", tmp_path / "r1", f"--init-from={hf}", "--print-config") == 0
    printed = capsys.readouterr().out
    for line in ("hidden_size = 32", "num_layers = 2", "num_kv_heads = 2",
                 "ffn_hidden_size = 64", "vocab_size = 300", "max_seq_len = 32",
                 "rope_theta = 500.0", f'init_from = "{hf}"'):
        assert line in printed, line
    status = _run(data, "a", tmp_path / "r2", f"--init-from={hf}", "--model.hidden_size=64",
                  "--model.num_layers=3", "--model.hidden_dropout=0.1")
    err = capsys.readouterr().err
    assert status == 2
    assert "model.hidden_size=64 is set but" in err and "has 32" in err, err
    assert "model.num_layers=3" in err and "hidden_dropout" not in err, err
    assert _run(data, "a", tmp_path / "r3", f"--init-from={hf}",
                "--model.hidden_dropout=0.1") == 0  # a run-time field stays the run's own
    assert "initialised the weights from Hugging Face model" in capsys.readouterr().out
    pickled = tmp_path / "pickled"
    shutil.copytree(hf, pickled)
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"")
    assert _run(data, "a", tmp_path / "r4", f"--init-from={pickled}") == 2
    assert "no model*.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "r4").exists()


def test_colonnade_run_fine_tuned_on_new_data(data: dict[str, Any], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Item 11: a checkpoint could not be trained on new data (sampler num_samples differs)."""
    ck = tmp_path / "ck"
    assert _run(data, "a", tmp_path / "r0", *TINY, f"--checkpoint.save={ck}") == 0
    capsys.readouterr()
    status = _run(data, "b_same", tmp_path / "r1", *TINY, f"--checkpoint.load={ck}",
                  "--training.steps=4", "--checkpoint.lr_schedule=config")
    assert status != 0  # resuming is exact: the sampler of another dataset does not fit
    capsys.readouterr()
    run = tmp_path / "r2"
    assert _run(data, "b_same", run, f"--init-from={ck}", "--training.steps=3") == 0
    out = capsys.readouterr().out
    assert "initialised the weights from checkpoint (its step 2)" in out
    assert _steps(run) == [1, 2, 3]  # a new run: step 0, new data from its first sample
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["lr"] == pytest.approx(1e-3)  # warmup_steps=1: a fresh schedule


def test_tokenizer_mismatches_are_refused(data: dict[str, Any], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Item 6: a checkpoint / blend with another tokenizer of the same vocab size was accepted."""
    ck = tmp_path / "ck"
    assert _run(data, "a", tmp_path / "r0", *TINY, f"--checkpoint.save={ck}") == 0
    capsys.readouterr()
    before = {n: _tree_hash(data[n]) for n in ("a", "b_same", "b_other")}
    cases = [
        (("b_other", f"--init-from={ck}"), ["checkpoint.init_from=", "another tokenizer",
                                            "--data.tokenizer="]),
        (("b_other", *TINY, f"--checkpoint.load={ck}"), ["checkpoint.load=",
                                                         "another tokenizer"]),
        (("b_other", f"--init-from={_hf_dir(tmp_path / 'hf', data['a'] / 'tokenizer.json')}"),
         ["checkpoint.init_from=", "another tokenizer"]),
        (("a", *TINY, f"--data.blend=0.5:{data['a'] / 'data'},0.5:{data['b_other'] / 'data'}"),
         ["data.blend entry '0.5:", "b_other", "another tokenizer", "--data.tokenizer="]),
    ]
    for i, ((prepared, *extra), expected) in enumerate(cases):
        status = _run(data, prepared, tmp_path / f"bad{i}", *extra)
        err = capsys.readouterr().err
        assert status == 2, (i, err)
        for part in expected:
            assert part in err, (i, part, err)
        assert not (tmp_path / f"bad{i}").exists()
    assert {n: _tree_hash(data[n]) for n in before} == before
    # the same blend with one tokenizer trains
    blend = f"--data.blend=0.5:{data['a'] / 'data'},0.5:{data['b_same'] / 'data'}"
    assert _run(data, "a", tmp_path / "ok", *TINY, blend) == 0


def test_rerun_of_an_init_from_run_resumes_its_own_checkpoints(
        data: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Re-running a fine-tuning command whose checkpoint.save holds its checkpoints resumes
    them (auto-resume), instead of starting again from the init weights."""
    from colonnade.checkpoint.training_state import read_metadata

    hf = _hf_dir(tmp_path / "hf", data["a"] / "tokenizer.json")
    save, run = tmp_path / "ft", tmp_path / "run"
    args = (f"--init-from={hf}", f"--checkpoint.save={save}", "--checkpoint.lr_schedule=config")
    assert _run(data, "a", run, *args) == 0
    assert read_metadata(save)["step"] == 2
    capsys.readouterr()
    assert _run(data, "a", run, *args, "--training.steps=4") == 0
    out = capsys.readouterr().out
    assert f"resuming from {save}" in out and "initialised the weights" not in out, out
    assert _steps(run) == [1, 2, 3, 4]  # continued, no duplicates
    assert read_metadata(save)["step"] == 4


def test_init_from_keeps_the_set_model_fields_that_decide_no_tensor(
        data: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--init-from refused every set [model] field, even max_seq_len: a run could not reuse
    its training config, nor fine-tune at another context length. A field that decides no
    tensor is now the run's own; a shape change is refused naming the field (gpt2's
    max_seq_len among them: its learned position table)."""
    hf = _hf_dir(tmp_path / "hf", data["a"] / "tokenizer.json")  # llama, max_seq_len 32
    run = tmp_path / "long"
    assert _run(data, "a", run, f"--init-from={hf}", *TINY, "--model.max_seq_len=64",
                "--model.rope_theta=1000.0", "--training.seq_len=48") == 0
    assert "initialised the weights from Hugging Face model" in capsys.readouterr().out
    model = tomllib.loads((run / "config.toml").read_text())["model"]
    assert (model["max_seq_len"], model["rope_theta"], model["hidden_size"],
            model["norm_eps"]) == (64, 1000.0, 32, 1e-6)  # the last two: the checkpoint's
    gpt2 = _hf_dir(tmp_path / "gpt2", data["a"] / "tokenizer.json", arch="gpt2")
    status = _run(data, "a", tmp_path / "g", f"--init-from={gpt2}", "--model.max_seq_len=64")
    err = capsys.readouterr().err
    assert status == 2, err
    assert (f"model.max_seq_len=64 is set but checkpoint.init_from={gpt2} has 32 (its learned "
            "position table has max_seq_len rows; a shorter training.seq_len needs no change "
            "of max_seq_len)") in err, err
    assert not (tmp_path / "g").exists()


def test_init_from_prepares_raw_data_with_the_models_tokenizer(
        data: dict[str, Any], tmp_path: Path) -> None:
    """`train --init-from=HF --data.input=RAW` into a new prepared_dir without
    --data.tokenizer: the raw text is tokenized with the HF folder's tokenizer.json and the
    fine-tune runs (it trained a new BPE, wrote the dataset, then refused the mismatch)."""
    hf = _hf_dir(tmp_path / "hf", data["a"] / "tokenizer.json")
    prepared = tmp_path / "prep"
    raw = {"fresh_args": [f"--data.input={data['root'] / 'text_b'}",
                          f"--data.prepared_dir={prepared}"]}
    assert _run(raw, "fresh", tmp_path / "run", f"--init-from={hf}") == 0
    assert (json.loads((prepared / "tokenizer.json").read_text())
            == json.loads((data["a"] / "tokenizer.json").read_text()))
    assert _steps(tmp_path / "run") == [1, 2]
