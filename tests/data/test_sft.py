"""SFT data: `prepare --data.format=sft` writes tokens + a loss mask; training masks prompts.

Checked: the mask marks exactly the response (assistant) tokens and the EOD; collate turns the
labels of masked targets into -100; bad records are listed (strict) or skipped; non-record
inputs are refused before any file is written; fine-tuning on the mask lowers the loss on
response tokens while the loss on prompt tokens does not fall (it does when nothing is
masked, the control run).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from colonnade.config.sections import (
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainingConfig,
)
from colonnade.config.validate import resolve, validate
from colonnade.data import CorpusError, DataError, IndexedDataset, WindowDataset, collate
from colonnade.data.sft import prepare_sft
from colonnade.parallel.groups import ProcessGroups
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX
from colonnade.training.setup import prepare_data

ANSWER = " the answer is yes."


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _records(n: int, seed: int = 0) -> list[object]:
    """Random lowercase prompts; every response is ANSWER; every 5th is chat-style."""
    r = random.Random(seed)
    out: list[object] = []
    for i in range(n):
        prompt = "".join(r.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(r.randint(8, 24)))
        if i % 5 == 0:
            out.append({"messages": [{"role": "user", "content": prompt},
                                     {"role": "assistant", "content": ANSWER}]})
        else:
            out.append({"prompt": prompt + "\nQ:", "response": ANSWER})
    return out


def test_mask_marks_response_tokens_and_eod(tmp_path: Path) -> None:
    src = _write(tmp_path / "sft.jsonl", [
        {"prompt": "hello there", "response": " general kenobi"},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hey"}]},
        {"q": "x", "a": "y"},  # custom keys
        *_records(40)])
    with pytest.raises(CorpusError, match=r"sft.jsonl:3: needs strings under 'prompt'"):
        prepare_sft(src, tmp_path / "bad", 300, progress=False, log=lambda _m: None)
    assert not (tmp_path / "bad").exists()  # a rejected prepare writes nothing
    res = prepare_sft(src, tmp_path / "out", 300, errors="skip", progress=False,
                      log=lambda _m: None)
    assert res.num_docs == 42
    tok, eod = res.tokenizer(), res.eod_id
    data = IndexedDataset(tmp_path / "out" / "data")
    mask = IndexedDataset(tmp_path / "out" / "mask")
    assert np.array_equal(data.doc_lengths, mask.doc_lengths)

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    p, r = enc("hello there"), enc(" general kenobi")
    assert data[0].tolist() == p + r + [eod]
    assert mask[0].tolist() == [0] * len(p) + [1] * len(r) + [1]
    chat = [("system: ", 0), ("be brief\n", 0), ("user: ", 0), ("hi\n", 0),
            ("assistant: ", 0), ("hey\n", 1)]
    assert data[1].tolist() == [i for t, _ in chat for i in enc(t)] + [eod]
    assert mask[1].tolist() == [m for t, m in chat for _ in enc(t)] + [1]
    again = prepare_sft(src, tmp_path / "out", 300, errors="skip", progress=False,
                        log=lambda _m: None)
    assert again.reused
    prepare_sft(_write(tmp_path / "qa.jsonl", [{"q": "x", "a": "y"}]), tmp_path / "qa",
                        None, tmp_path / "out", prompt_key="q", response_key="a",
                        progress=False, log=lambda _m: None)
    assert IndexedDataset(tmp_path / "qa" / "mask")[0].tolist() == [0] * len(enc("x")) + [1] * (
        len(enc("y")) + 1)


def test_collate_masks_labels_of_prompt_targets(tmp_path: Path) -> None:
    src = _write(tmp_path / "sft.jsonl", _records(60))
    res = prepare_sft(src, tmp_path / "out", 300, progress=False, log=lambda _m: None)
    ds = WindowDataset(res.dataset(), 16, "train", 0.1)
    sample = ds[3]
    assert sample.shape == (2, 17)
    start, end = ds.token_range(3)
    mask = IndexedDataset(tmp_path / "out" / "mask").tokens[start:end].astype(np.int64)
    tokens, labels = collate(ds, [3, 5])
    assert tokens[0].tolist() == sample[0, :-1].tolist()
    want = np.where(mask[1:] == 1, sample[0, 1:], IGNORE_INDEX)
    assert labels[0].tolist() == want.tolist()
    assert 0 < int((labels[0] == IGNORE_INDEX).sum()) < 16  # some masked, some not


def test_sft_rejects_text_inputs_and_stale_masks(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("plain text")
    with pytest.raises(DataError, match=r"data.format='sft' reads .jsonl/.json"):
        prepare_sft(tmp_path / "a.txt", tmp_path / "out", 300, progress=False)
    assert not (tmp_path / "out").exists()
    res = prepare_sft(_write(tmp_path / "s.jsonl", _records(20)), tmp_path / "out", 300,
                      progress=False, log=lambda _m: None)
    other = IndexedDataset(tmp_path / "out" / "mask")
    (tmp_path / "out" / "mask.bin").write_bytes(b"\x01\x00" * (other.num_tokens - 1))
    with pytest.raises(DataError):
        WindowDataset(res.dataset(), 8)


def test_sft_keys_named_otherwise_fail_before_the_input_is_read(tmp_path: Path) -> None:
    """A file whose records use other keys fails on its first record, before the tokenizer
    is trained or anything is logged or written, naming the options that read it; a later
    bad record is still found by the full read (and listed as examples, with the SFT fix)."""
    qa = [{"question": f"what is {i}?", "answer": f"{i}", "id": i} for i in range(50)]
    logged: list[str] = []
    with pytest.raises(CorpusError, match=r"(?s)first record of 1 file\(s\) is not an SFT "
                       r"example.*qa.jsonl:1: .*set --data.prompt_key=question "
                       r"--data.response_key=answer\n"):
        prepare_sft(_write(tmp_path / "qa.jsonl", qa), tmp_path / "out", 300, progress=False,
                    log=logged.append)
    assert logged == [] and not (tmp_path / "out").exists()
    half = [{"prompt": "p", "reply": "r"}]  # only the response key is named otherwise
    with pytest.raises(CorpusError, match=r"set --data.response_key=reply\n"):
        prepare_sft(_write(tmp_path / "half.jsonl", half), tmp_path / "out", 300,
                    progress=False, log=logged.append)
    alpaca = [{"instruction": "i", "input": "", "output": "o"}]  # which is which: not guessed
    with pytest.raises(CorpusError, match=r"set data.prompt_key / data.response_key\n"):
        prepare_sft(_write(tmp_path / "alpaca.jsonl", alpaca), tmp_path / "out", 300,
                    progress=False, log=logged.append)
    later = [*_records(10), {"question": "q", "answer": "a"}]  # first record fine
    with pytest.raises(CorpusError, match=r"(?s)^1 example\(s\) in 1 file\(s\).*later.jsonl"
                       r":11: .*--data.response_key=answer\n.*e.g. set data.prompt_key"):
        prepare_sft(_write(tmp_path / "later.jsonl", later), tmp_path / "out", 300,
                    progress=False, log=logged.append)
    assert logged == ["prepare: training a byte-level BPE tokenizer (vocab_size=300)"]
    assert not (tmp_path / "out").exists()


def _config(prepared: Path, steps: int) -> Config:
    model = ModelConfig(arch="llama", num_layers=2, hidden_size=48, num_heads=4, vocab_size=300,
                        max_seq_len=32)
    tr = TrainingConfig(steps=steps, seq_len=32, micro_batch_size=4, microbatches=2,
                        precision="fp32", seed=3, eval_interval=0)
    cfg = Config(model=model, training=tr,
                 data=DataConfig(prepared_dir=str(prepared), valid_fraction=0.1),
                 optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2))
    return validate(resolve(cfg, 1), 1)


def _split_losses(trainer: object, prepared: Path) -> tuple[float, float]:
    """Mean loss over response targets and over prompt targets of 8 valid windows."""
    from colonnade.pipeline.plan import StepPlan
    from colonnade.training.step import forward_only, mean_loss

    valid = WindowDataset(IndexedDataset(prepared / "data"), 32, "valid", 0.1)
    tokens, labels = collate(valid, list(range(8)))
    plain = torch.from_numpy(np.stack([valid[i][0, 1:] for i in range(8)]))
    prompt_labels = torch.where(labels == IGNORE_INDEX, plain, IGNORE_INDEX)
    out = []
    for lab in (labels, prompt_labels):
        groups = ProcessGroups.single()
        losses = forward_only(trainer.chunks, [(tokens, lab)], StepPlan(groups, 0))  # type: ignore[attr-defined]
        out.append(mean_loss(losses, groups, torch.device("cpu"), [(tokens, lab)]))
    return out[0], out[1]


def _fine_tune(prepared: Path, steps: int, masked: Path
               ) -> tuple[tuple[float, float], tuple[float, float]]:
    """Train on ``prepared``; response/prompt losses before and after on ``masked``'s windows."""
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime, build_data

    torch.manual_seed(0)
    cfg = _config(prepared, steps)
    groups = ProcessGroups.single()
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups), build_data(cfg, groups))
    before = _split_losses(trainer, masked)
    for _ in range(steps):
        trainer.train_step(trainer.next_batches())
    return before, _split_losses(trainer, masked)


def test_sft_fine_tuning_lowers_response_loss_only(tmp_path: Path) -> None:
    """Through `prepare_data` (the CLI's path) with data.format='sft': after 25 steps the
    response loss falls below a tenth of its start while the prompt loss does not fall; the
    control without the mask (the same tokens, mask.* removed) lowers the prompt loss too."""
    src = _write(tmp_path / "sft.jsonl", _records(300))
    prepared = tmp_path / "prep"
    data = DataConfig(input=str(src), prepared_dir=str(prepared), format="sft")
    cfg = dataclasses.replace(_config(prepared, 1), data=data)
    prepare_data(cfg, log=False)
    (resp0, prompt0), (resp1, prompt1) = _fine_tune(prepared, 25, prepared)
    assert resp0 > 4.5 and prompt0 > 4.5  # ~log(300) at initialisation
    assert resp1 < resp0 / 10, (resp0, resp1)  # measured 5.71 -> 0.16
    assert prompt1 > prompt0 * 0.9, (prompt0, prompt1)  # measured 5.72 -> 9.61
    control = tmp_path / "control"
    control.mkdir()
    for name in ("data.bin", "data.idx", "tokenizer.json", "prepare.json"):
        (control / name).write_bytes((prepared / name).read_bytes())
    _, (_, prompt_control) = _fine_tune(control, 25, prepared)
    assert prompt_control < prompt0 * 0.75, (prompt0, prompt_control)  # measured 3.36


def test_sft_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`colonnade prepare --data.format=sft` then `colonnade train` on the prepared dir: the
    mask is picked up (the logged loss is the response-only loss, far below the all-token
    loss of the same model) without any training flag."""
    from colonnade.cli import main

    src = _write(tmp_path / "sft.jsonl", _records(200))
    prep, run = tmp_path / "prep", tmp_path / "run"
    assert main(["prepare", "--data.format=sft", f"--data.input={src}",
                 f"--data.prepared_dir={prep}", "--model.vocab_size=300"]) == 0
    assert "trained on (responses + EOD)" in capsys.readouterr().out
    assert (prep / "mask.idx").is_file()
    torch.manual_seed(0)
    assert main(["train", f"--data.prepared_dir={prep}", "--model.vocab_size=300",
                 "--model.hidden_size=48", "--model.num_layers=2", "--model.num_heads=4",
                 "--model.max_seq_len=32", "--training.seq_len=32",
                 "--training.micro_batch_size=4", "--training.microbatches=2",
                 "--training.steps=20", "--training.eval_interval=20", "--optim.lr=1e-2",
                 "--optim.warmup_steps=2", "--training.device=cpu", "--data.valid_fraction=0.1",
                 f"--logging.dir={run}", "--logging.progress=false", "--logging.log_interval=10"]
                ) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = [r["valid_loss"] for r in records if "valid_loss" in r][-1]
    assert final < 1.0, final  # response tokens only; prompts stay near log(300) = 5.7
