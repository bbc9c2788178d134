"""The Trainer is a TrainState: checkpoints and the NaN guard read it through the protocol."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from colonnade.checkpoint.state import TrainState
from colonnade.config.sections import Config, ModelConfig, TrainingConfig
from colonnade.config.validate import resolve, validate
from colonnade.parallel.groups import ProcessGroups
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime


def test_trainer_satisfies_the_train_state_protocol() -> None:
    model = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, vocab_size=64,
                        max_seq_len=16)
    tr = TrainingConfig(steps=1, seq_len=16, micro_batch_size=2, microbatches=1,
                        precision="fp64", eval_interval=0)
    cfg = validate(resolve(Config(model=model, training=tr), 1), 1)
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), ProcessGroups.single()))
    assert isinstance(trainer, TrainState)
    assert (trainer.step, len(trainer.chunks)) == (0, 1)
    fields = {name: getattr(trainer, name) for name in ("config", "groups", "chunks", "optimizer")}
    assert not isinstance(SimpleNamespace(**fields), TrainState)  # no step: not a train state
    assert isinstance(SimpleNamespace(**fields, step=3), TrainState)
