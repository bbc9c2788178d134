"""bf16 optimizer states (optim.state_dtype='bf16') in checkpoints: saved as bf16, resharded
exactly, cast with a log line when a run resumes with the other state dtype.

A bf16 model with bf16 moments trains 2 steps at dp2 ZeRO-1, saves (A), trains one more step.
A is resumed at dp1 with fp32 states and saved again (B): every moment of B is A's, upcast
(exact), and the resume's log line names the cast. B is resumed at dp2 ZeRO-1 with bf16
states and saved (C): C's moments are A's bit for bit (a bf16 value survives fp32 and back),
the log line names the cast, and the next step's loss is the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.checkpoint.harness import Layout, batches_for, make_config


def _trainer(layout: Layout, state: str) -> Any:
    from colonnade.parallel.dims import ParallelDims
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime
    from tests.parity import rank_groups

    torch.set_num_threads(1)
    cfg = make_config(layout, "bf16")
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, state_dtype=state))
    groups = rank_groups(ParallelDims(dp=layout.dp))
    return Trainer(Runtime(cfg, torch.device("cpu"), groups), None)


def _step(trainer: Any) -> float:
    g = trainer.groups
    return trainer.train_step(batches_for(trainer.step, g.dp.rank, g.dp.size))["loss"]


def save_then_step(layout: Layout, root: str) -> list[float]:
    """Two steps, save, one more; the losses."""
    from colonnade.checkpoint.training_state import save_training

    trainer = _trainer(layout, "bf16")
    assert trainer.optimizer.exp_avg_flat.dtype == torch.bfloat16
    losses = [_step(trainer), _step(trainer)]
    save_training(trainer, root, keep_last=1)
    return [*losses, _step(trainer)]


def load_and_save(layout: Layout, state: str, src: str, dst: str, step: bool) -> dict[str, Any]:
    """Resume ``src`` with ``state`` moments (start_from: the run's log line), save to
    ``dst`` (then step once when ``step``); the log line and the step's loss."""
    from colonnade.checkpoint.training_state import save_training, start_from

    trainer = _trainer(layout, state)
    line = start_from(trainer, src)
    save_training(trainer, dst, keep_last=1)
    return {"line": line, "loss": _step(trainer) if step else None}


def _moments(root: Path) -> dict[str, torch.Tensor]:
    """Every stored moment (exp_avg, exp_avg_sq) of the checkpoint, whole, as stored."""
    from colonnade.checkpoint.format import CheckpointReader

    reader = CheckpointReader(sorted(root.glob("step_*"))[-1])
    out = {}
    for name in reader.tensors:
        if name.startswith("optim/") and name.rsplit("/", 1)[1] in ("exp_avg", "exp_avg_sq"):
            shape = reader.full_shape(name)
            out[name] = reader.read_box(name, ((0,) * len(shape), shape))
    return out


def test_bf16_states_reshard_and_cast(run_ranks: Callable[..., list[Any]],
                                      tmp_path: Path) -> None:
    zero1, single = Layout(dp=2, zero=True), Layout()
    a, b, c = (str(tmp_path / n) for n in "abc")
    losses = run_ranks(2, save_then_step, zero1, a)[0]
    to_fp32 = run_ranks(1, load_and_save, single, "fp32", a, b, False)[0]
    back = run_ranks(2, load_and_save, zero1, "bf16", b, c, True)
    ma, mb, mc = (_moments(Path(p)) for p in (a, b, c))
    assert ma.keys() == mb.keys() == mc.keys() and len(ma) > 10
    for name, value in ma.items():
        assert value.dtype == mc[name].dtype == torch.bfloat16 and mb[name].dtype == torch.float32
        assert torch.equal(mb[name], value.float()), name
        assert torch.equal(mc[name], value), name
    assert any(float(v.abs().max()) > 0 for v in ma.values())
    cast = "'exp_avg' was saved as torch.{} and is cast to torch.{}"
    assert cast.format("bfloat16", "float32") in to_fp32["line"], to_fp32["line"]
    assert "'exp_avg_sq' was saved" in to_fp32["line"]
    for res in back:
        assert cast.format("float32", "bfloat16") in res["line"], res["line"]
        assert res["loss"] == losses[2]  # the resumed step is the uninterrupted one, bit for bit
