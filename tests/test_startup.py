"""A process that does not compile never imports ``torch._dynamo`` (~1 s per process start).

In a fresh interpreter, every module of the package is imported and then one eager training
step runs (gpt2, 2 layers). Without dropout no :func:`colonnade.eager.eager` function runs, and
``torch._dynamo`` stays unimported; with dropout the dropout draws import it at their first call
and the step trains as before (a finite loss here; tests/models/test_compile checks the values).
Decorating with ``torch.compiler.disable`` imported dynamo with the modules: ``colonnade plan
--help`` took 2.9 s, against 1.6 s now.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, json, pkgutil, sys
import torch
import colonnade
torch.set_num_threads(1)
for info in pkgutil.walk_packages(colonnade.__path__, "colonnade."):
    importlib.import_module(info.name)
after_import = "torch._dynamo" in sys.modules
from colonnade.config.load import load_config
from colonnade.config.validate import resolve, validate
from colonnade.parallel.groups import ProcessGroups
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime
args = ["--model.arch=gpt2", "--model.num_layers=2", "--model.hidden_size=32",
        "--model.num_heads=4", "--model.vocab_size=64", "--model.max_seq_len=16",
        "--training.seq_len=16", "--training.micro_batch_size=2", "--training.device=cpu",
        "--model.hidden_dropout=%s", "--model.attention_dropout=%s"]
config = validate(resolve(load_config(None, args), 1), 1)
trainer = Trainer(Runtime(config, torch.device("cpu"), ProcessGroups.single()))
ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
loss = trainer.train_step([(ids[:, :-1], ids[:, 1:])])["loss"]
print(json.dumps({"after_import": after_import, "after_step": "torch._dynamo" in sys.modules,
                  "loss": loss}))
"""


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_dynamo_is_imported_only_by_an_eager_function_call(dropout: float) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE % (dropout, dropout)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after_import"] is False
    assert got["after_step"] is (dropout > 0)
    assert 0 < got["loss"] < 10
