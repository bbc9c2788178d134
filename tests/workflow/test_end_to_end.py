"""Issue 14's whole workflow through the real CLI, as a user runs it (tiny sizes).

1. prepare a folder of .jsonl shards plus a .parquet file with a reused Hugging Face tokenizer;
2. train tp2 x dp2 (4 ranks) into checkpoint.save, SIGTERM the launcher mid-run (the agent
   forwards it, every rank stops after the same step and saves it, exit 143 with no traceback
   and one line naming the checkpoint), re-run the same command: it resumes from that
   checkpoint and every step's loss equals an uninterrupted run's (this is also the test of
   SIGTERM save-and-resume for multi-rank jobs: tests/workflow/test_interrupt.py relies on it).
   The interrupted run has a stop gate (:func:`tests.workflow.cli.start_gated`): its ranks take
   step 13 only once the forwarded SIGTERM has reached them, and the signal is sent after step
   12 was logged, so the run is mid-way when it comes and stops after step 13 exactly, for
   every interleaving (a stalled test process cannot find it finished). The uninterrupted run
   whose losses it must equal runs in-process on the rank pool (the ``cli`` fixture): it is
   the comparison, not the workflow;
3. export to Hugging Face; transformers loads it and its greedy text equals `colonnade generate`'s
   on the export (a process) and on the checkpoint (in-process);
4. fine-tune the export on new prompt/response data with the prompt masked from the loss
   (`prepare --data.format=sft`, `train --init-from`): a new run from step 1 whose loss falls.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.reliability.jobs import WORDS, losses, start
from tests.workflow.cli import (
    JOB_TIMEOUT_S,
    Cli,
    assert_clean,
    run_cli,
    start_gated,
    steps_logged,
    stopped_at,
    wait_for_records,
)

STEPS = 26
GATE = 13  # the interrupted run stops after this step
MODEL = ["--model.num_layers=2", "--model.hidden_size=32", "--model.num_heads=4",
         "--model.num_kv_heads=2", "--model.max_seq_len=32"]
SMALL = ["--training.seq_len=16", "--training.micro_batch_size=2", "--training.device=cpu",
         "--training.eval_interval=0", "--logging.log_interval=1", "--logging.progress=false"]


def _texts(seed: int, count: int, words: int = 120) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (count, words), generator=gen).tolist()
    return [" ".join(WORDS[i] for i in row) for row in picks]


def _hf_tokenizer(root: Path) -> Path:
    """A 'Hugging Face model directory' holding only a byte-level BPE tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(7, 50), trainer)
    root.mkdir()
    tok.save(str(root / "tokenizer.json"))
    return root


def _inputs(root: Path) -> str:
    """Two .jsonl shards in a folder and a .parquet file, as one comma-separated input."""
    shards = root / "shards"
    shards.mkdir()
    for k in range(2):
        lines = [json.dumps({"text": t}) for t in _texts(k, 12)]
        (shards / f"part-{k:03d}.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": _texts(5, 12)}), root / "extra.parquet")
    return f"{shards},{root / 'extra.parquet'}"


def _train_argv(tmp: Path, name: str) -> list[str]:
    return ["train", "--nproc", "4", "--parallel.tp=2", *MODEL, *SMALL,
            f"--training.steps={STEPS}", "--optim.lr=3e-3", "--optim.warmup_steps=2",
            f"--data.prepared_dir={tmp / 'prepared'}", f"--logging.dir={tmp / name}",
            f"--checkpoint.save={tmp / (name + '_ckpt')}", "--checkpoint.interval=10"]


def _interrupt_and_resume(tmp: Path, cli: Cli) -> Path:
    """SIGTERM a tp2 x dp2 job, re-run it; returns its checkpoint root."""
    status, out = cli(_train_argv(tmp, "reference"))
    assert status == 0, out
    argv = _train_argv(tmp, "run")
    job = start_gated(argv, tmp / "job.log", GATE, range(4))
    wait_for_records(job, tmp / "run", GATE - 1)
    os.kill(job.proc.pid, signal.SIGTERM)  # the launcher, as a scheduler's preemption would
    status = job.wait(JOB_TIMEOUT_S)
    out = job.output()
    assert status == 143, out
    assert_clean(out)
    ckpt = tmp / "run_ckpt"
    stopped = stopped_at(out, "SIGTERM")
    assert stopped == GATE < STEPS, out
    saved = ckpt / f"step_{stopped:08d}"
    assert f"saved checkpoint {saved}; re-run the same command to resume" in out, out
    assert f"stopped by SIGTERM; latest checkpoint {saved}" in out, out
    assert (ckpt / "latest").read_text().strip() == saved.name
    meta = json.loads((saved / "metadata.json").read_text())
    assert meta["step"] == stopped
    assert (meta["layout"]["tp"], meta["layout"]["dp"]) == (2, 2)
    assert sorted(p.name for p in saved.glob("*.safetensors")) != []  # the ranks' shards
    assert steps_logged(tmp / "run")[-1] == stopped
    again = start(argv, tmp / "again.log")
    assert again.wait(JOB_TIMEOUT_S) == 0, again.output()
    assert f"resuming from {saved}" in again.output(), again.output()
    assert steps_logged(tmp / "run") == list(range(1, STEPS + 1))  # no step twice
    want, got = losses(tmp / "reference"), losses(tmp / "run")
    assert len(got) == STEPS and got[STEPS] < got[1] - 0.5
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0.0), step
    return ckpt


def _generate(where: Path, prompt: str, cli: Cli = run_cli) -> str:
    status, out = cli(["generate", str(where), "--prompt", prompt, "--temperature", "0",
                       "--max-new-tokens", "12"])
    assert status == 0, out
    return out.strip()


def _export_and_compare(ckpt: Path, hf: Path, prompt: str, cli: Cli) -> None:
    status, out = run_cli(["convert", "--to-hf", str(ckpt), "--out", str(hf)])
    assert status == 0, out
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        new = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert new.shape[1] > ids["input_ids"].shape[1]
    theirs = tok.decode(new[0], skip_special_tokens=True)
    assert _generate(hf, prompt) == theirs.strip()
    assert _generate(ckpt, prompt, cli) == theirs.strip()


def _fine_tune(tmp: Path, hf: Path) -> None:
    records = [{"prompt": f"question {t[:20]}", "response": f" answer {t[20:60]}"}
               for t in _texts(11, 60, words=12)]
    sft = tmp / "sft.jsonl"
    sft.write_text("".join(json.dumps(r) + "\n" for r in records))
    status, out = run_cli(["prepare", "--data.format=sft", f"--data.input={sft}",
                           f"--data.tokenizer={hf}", f"--data.prepared_dir={tmp / 'sft'}"])
    assert status == 0, out
    assert (tmp / "sft" / "mask.bin").is_file()
    status, out = run_cli(["train", f"--init-from={hf}", *SMALL, "--training.steps=15",
                           "--optim.lr=3e-3", "--optim.warmup_steps=1",
                           f"--data.prepared_dir={tmp / 'sft'}", f"--logging.dir={tmp / 'ft'}"])
    assert status == 0, out
    assert "resuming from" not in out, out
    got = losses(tmp / "ft")
    assert sorted(got) == list(range(1, 16))  # a new run, not a resume of the export
    assert got[15] < got[1] - 0.3, got


def test_prepare_train_interrupt_resume_export_generate_finetune(tmp_path: Path,
                                                                 cli: Cli) -> None:
    status, out = run_cli(["prepare", f"--data.input={_inputs(tmp_path)}",
                           f"--data.tokenizer={_hf_tokenizer(tmp_path / 'hf_tok')}",
                           f"--data.prepared_dir={tmp_path / 'prepared'}"])
    assert status == 0, out
    manifest = json.loads((tmp_path / "prepared" / "prepare.json").read_text())
    assert manifest["result"]["num_docs"] == 36
    ckpt = _interrupt_and_resume(tmp_path, cli)
    _export_and_compare(ckpt, tmp_path / "hf", "the", cli)
    _fine_tune(tmp_path, tmp_path / "hf")
