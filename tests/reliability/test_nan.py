"""NaN guard: an injected NaN gradient is caught on the step it happens, per training.on_nan.

In-process single-rank runs of ``train`` (stop: error naming step and parameter, last good
checkpoint kept; skip: no update on that step, training continues), and a tp=2 run on the rank
pool where only rank 1 sees the NaN and both ranks stop on the same step with the same message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from colonnade.checkpoint.commit import read_latest
from colonnade.checkpoint.training_state import read_metadata
from colonnade.config.load import load_config
from colonnade.config.validate import resolve, validate
from colonnade.reliability.nan import NonFiniteError, check_step
from colonnade.training.loop import Trainer, train
from tests.reliability.faults import Fault, install, uninstall
from tests.reliability.jobs import tiny_args

PARAM = "layers.1.mlp.down.weight"
DOWN_NUMEL = 32 * 128  # hidden 32 x SwiGLU width round_up(8 * 32 / 3, 64) = 128
N_PARAMS = 21  # embedding, 2 x 9 per layer, final norm, head


@pytest.fixture
def faulty(monkeypatch: pytest.MonkeyPatch) -> Callable[[Fault], list[float]]:
    """Install a fault in this process; returns the per-step parameter checksums it records."""
    monkeypatch.setattr(Trainer, "train_step", Trainer.train_step)
    sums: list[float] = []

    def arm(fault: Fault) -> list[float]:
        install(fault)
        inner = Trainer.train_step

        def recording(self: Trainer, batches: list[Any], signum: int = 0) -> dict[str, float]:
            out = inner(self, batches, signum)
            sums.append(sum(float(p.detach().double().sum()) for c in self.chunks
                            for p in c.parameters()))
            return out

        monkeypatch.setattr(Trainer, "train_step", recording)
        return sums

    return arm


def test_nan_stop_names_step_and_parameter_and_keeps_last_checkpoint(
        corpus: tuple[Path, Path], tmp_path: Path,
        faulty: Callable[[Fault], list[float]]) -> None:
    sums = faulty(Fault("nan", 0, 3, param=PARAM))
    ckpt = tmp_path / "ckpt"
    cfg = load_config(None, tiny_args(*corpus, tmp_path / "run", training__steps=6,
                                      checkpoint__save=ckpt, checkpoint__interval=2))
    with pytest.raises(NonFiniteError) as info:
        train(cfg)
    message = str(info.value)
    assert "non-finite gradient at step 3" in message, message
    assert (f"{PARAM} (grad) on rank 0 (tp 0 pp 0 dp 0): {DOWN_NUMEL} NaN, 0 Inf of "
            f"{DOWN_NUMEL}") in message, message
    assert f"1 of {N_PARAMS} parameters affected" in message, message
    assert "was not applied" in message and "training.on_nan='skip'" in message, message
    assert len(sums) == 3 and sums[2] == sums[1]  # step 3 changed no parameter
    latest = read_latest(ckpt)
    assert latest is not None and latest.name == "step_00000002"
    assert read_metadata(ckpt)["step"] == 2


def test_nan_skip_drops_that_update_and_continues(
        corpus: tuple[Path, Path], tmp_path: Path,
        faulty: Callable[[Fault], list[float]],
        capsys: pytest.CaptureFixture[str]) -> None:
    sums = faulty(Fault("nan", 0, 3, param=PARAM))
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    cfg = load_config(None, tiny_args(*corpus, run, training__steps=5, training__on_nan="skip",
                                      checkpoint__save=ckpt))
    train(cfg)
    out = capsys.readouterr().out
    assert "skipped step 3 (non-finite gradient at step 3" in out and PARAM in out, out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["skipped"] for r in records] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert sums[2] == sums[1] and sums[3] != sums[2]  # no update on step 3, updates after it
    meta = read_metadata(ckpt)
    assert meta["step"] == 5 and meta["optimizer"]["step_count"] == 4


def _nan_on_one_tp_rank() -> str:
    """tp=2: rank 1's shard of q gets a NaN gradient on step 2; returns 'step|message'."""
    from colonnade.parallel.dims import ParallelDims
    from colonnade.parallel.groups import ProcessGroups
    from colonnade.training.setup import Runtime

    overrides = ["--model.num_layers=2", "--model.hidden_size=32", "--model.num_heads=4",
                 "--model.vocab_size=300", "--model.max_seq_len=32", "--training.seq_len=16",
                 "--training.micro_batch_size=2", "--parallel.tp=2", "--training.device=cpu"]
    cfg = validate(resolve(load_config(None, overrides), 2), 2)
    groups = ProcessGroups.build(ParallelDims.from_config(cfg.parallel, 2))
    install(Fault("nan", 1, 2, param="layers.0.attn.q.weight"))
    try:
        trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups), None)
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            tokens = torch.randint(0, 300, (2, 16), generator=gen)
            metrics = trainer.train_step([(tokens, tokens.roll(-1, dims=1))])
            try:
                check_step(trainer, metrics)
            except NonFiniteError as err:
                return f"{trainer.step}|{err}"
        return "no error"
    finally:
        uninstall()


def test_nan_on_one_rank_stops_every_rank_on_that_step(
        run_ranks: Callable[..., list[Any]]) -> None:
    results = run_ranks(2, _nan_on_one_tp_rank)
    assert results[0] == results[1], results
    step, message = results[0].split("|", 1)
    assert step == "2", message
    shard = 16 * 32  # q: [heads x head_dim / tp, hidden] on each tp rank
    assert (f"layers.0.attn.q.weight (grad) on rank 1 (tp 1 pp 0 dp 0): {shard} NaN, 0 Inf of "
            f"{shard}") in message, message
    assert "rank 0 (" not in message, message  # rank 0's gradients were finite
