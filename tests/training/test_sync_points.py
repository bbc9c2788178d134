"""Device-to-host synchronisations of a training step, counted exactly.

Every call that would make the host wait for a GPU's queue is counted over N Trainer steps
by a :class:`~torch.overrides.TorchFunctionMode` that sees every tensor method and torch
function (``item``, ``tolist``, ``cpu``, ``numpy``, ``__bool__``, ``__float__``, ``__int__``,
``__index__``, ``nonzero`` and friends whose output shape depends on values) and by wrapping
the device module's waits (:func:`colonnade.device.synchronize`, :func:`~colonnade.device.
wait_event`, :meth:`~colonnade.device.DeviceEvent.wait`). A ``.to("cpu")`` of a CPU tensor
cannot be told from a same-device move on a CPU-only run; the step's code has none.

The dense step (GPT-2 and Llama: RoPE, GQA, SwiGLU; one process, tp2 + sp and pp2 1F1B on the
rank pool; fp32 and fp16 with the dynamic loss scaler) reads the device exactly ONCE per step:
the optimizer's global gradient norm (:meth:`DistributedOptimizer.grad_norm`), which decides on
the host whether the update is skipped (NaN/Inf, ``training.on_nan``) and gives clipping's
coefficient, with the step's loss reduction and the ranks' stop-signal votes riding on the
same copy (and fp16's found-inf verdict, MAX-reduced on the device first). The loss divisor N,
the per-micro-batch losses and their token weights stay on the device.

MoE is excluded from that claim, and what remains is counted: the token dispatch sizes its
all-to-all from the router's counts (the split sizes are host integers: an inherent read per
MoE layer and micro-batch in forward, and again when the backward replays the exchange) and
the routing statistics are read once per step (``end_moe_step``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from colonnade import device as device_module
from colonnade.config.load import load_config
from colonnade.config.sections import Config, ParallelConfig, TrainingConfig
from colonnade.models import build
from colonnade.moe.grouped_gemm import grouped_mm_supported
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.training import loop
from colonnade.training.loop import Trainer
from colonnade.training.setup import Runtime
from tests.parity import random_steps, rank_groups, resolved, tiny_model
from tests.reliability.conftest import corpus  # noqa: F401  (the prepared tiny corpus)
from tests.reliability.jobs import tiny_args

STEPS = 3
"""Trainer steps counted."""
SYNCING = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__",
                     "__index__", "nonzero", "argwhere", "masked_select", "unique",
                     "unique_consecutive", "bincount", "repeat_interleave", "_local_scalar_dense"})
"""Tensor methods / torch functions that copy a value (or a value-dependent shape) to the host:
on a GPU each waits for everything queued before it."""
WAITS = ("synchronize", "wait_event")
"""Functions of the device module that block the host on the device."""


class _Counter(TorchFunctionMode):
    """Counts calls of :data:`SYNCING` by name."""

    def __init__(self, counts: dict[str, int]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCING:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_syncs() -> Iterator[dict[str, int]]:
    """Count host synchronisations inside the block (usable on pool ranks: no monkeypatch)."""
    counts: dict[str, int] = {}
    saved = {name: getattr(device_module, name) for name in WAITS}
    saved_event = device_module.DeviceEvent.wait

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[f"device.{name}"] = counts.get(f"device.{name}", 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in saved.items():
        setattr(device_module, name, wrap(name, fn))
    device_module.DeviceEvent.wait = wrap("DeviceEvent.wait", saved_event)  # type: ignore[method-assign]
    try:
        with _Counter(counts):
            yield counts
    finally:
        for name, fn in saved.items():
            setattr(device_module, name, fn)
        device_module.DeviceEvent.wait = saved_event  # type: ignore[method-assign]


def _config(arch: str, *, tp: int = 1, pp: int = 1, precision: str = "fp32",
            moe: bool = False) -> Config:
    """A tiny resolved config: h 32, 2 layers, seq 16, 2 micro-batches of 2, clipping on."""
    model = tiny_model(arch, layers=2, hidden=32, heads=4, seq=16)
    if moe:
        model = dataclasses.replace(model, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32)
    cfg = Config(model=model,
                 parallel=ParallelConfig(tp=tp, pp=pp, sp=tp > 1),
                 training=TrainingConfig(steps=STEPS, seq_len=16, micro_batch_size=2,
                                         microbatches=2, precision=precision, seed=3,
                                         eval_interval=0))
    return resolved(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim,
                                                                       clip_grad=1.0)))


def count_steps(cfg: Config) -> dict[str, Any]:
    """Rank body: build a Trainer, take :data:`STEPS` steps counting host syncs per step."""
    dims = ParallelDims(tp=cfg.parallel.tp, pp=cfg.parallel.pp)
    groups = rank_groups(dims) if dims.world_size > 1 else ProcessGroups.single()
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups))
    batches = random_steps(STEPS, 2, 2, 16, seed=1, vocab=cfg.model.vocab_size)
    per_step, losses = [], []
    for step in range(STEPS):
        with counting_syncs() as counts:
            metrics = trainer.train_step(batches[step])
        per_step.append(counts)
        losses.append(metrics["loss"])
    return {"per_step": per_step, "losses": losses}


@pytest.mark.parametrize(("arch", "precision"), [("gpt2", "fp32"), ("llama", "fp32"),
                                                 ("llama", "fp16")])
def test_dense_step_reads_the_device_once(arch: str, precision: str) -> None:
    """One process: exactly one host read per step (the gradient norm with its riders)."""
    res = count_steps(_config(arch, precision=precision))
    assert res["per_step"] == [{"tolist": 1}] * STEPS, res["per_step"]
    assert all(torch.isfinite(torch.tensor(res["losses"])))
    assert len(set(res["losses"])) == STEPS  # the model trained


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_parallel_dense_step_reads_the_device_once(run_ranks: Callable[..., list[Any]],
                                                   layout: str) -> None:
    """tp2 + sp and pp2 (1F1B; the non-loss stage has no losses, the same single read)."""
    cfg = _config("llama", tp=2) if layout == "tp2_sp" else _config("llama", pp=2)
    results = run_ranks(2, count_steps, cfg)
    for rank, res in enumerate(results):
        assert res["per_step"] == [{"tolist": 1}] * STEPS, (rank, res["per_step"])
    assert results[0]["losses"] == results[1]["losses"]  # the reduced loss, on every rank


def test_moe_step_reads_what_is_counted() -> None:
    """MoE (excluded from the zero-sync claim), 2 MoE layers x 2 micro-batches at ep 1: per
    layer and micro-batch the router's and the dispatch's ``bincount`` (its output size is
    read on a GPU) and the dispatch's host split sizes (one ``tolist``); the optimizer's one
    read; the routing statistics copied to the host once (``cpu``), whose 26 ``__float__``
    then read host memory, no device. The process's first MoE step adds the one ``item`` of
    the cached ``grouped_mm_supported`` probe: cleared here, so the count does not depend on
    which tests ran before in this process."""
    grouped_mm_supported.cache_clear()
    res = count_steps(_config("llama", moe=True))
    want = {"bincount": 2 * 4, "tolist": 4 + 1, "cpu": 1, "__float__": 26}
    assert res["per_step"][1:] == [want] * (STEPS - 1), res["per_step"]
    assert res["per_step"][0] == {**want, "item": 1}, res["per_step"][0]


def test_loop_logs_compile_time_once(corpus: tuple[Path, Path], tmp_path: Path,  # noqa: F811
                                     monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``train`` with training.compile: the first step's line and record say how long this
    run compiled (dynamo's timers, faked here: no real compilation on two shared cores; the
    compile tests compile for real), later lines only after a recompilation; the device is
    waited on once per logged record (log_interval 2 over 4 steps, plus step 1: 3 waits)."""
    timer = {"s": 5.0}  # seconds compiled before this run (earlier runs in the process)
    monkeypatch.setattr(loop, "compile_seconds", lambda: timer["s"])
    monkeypatch.setattr(build, "compile_layers", lambda chunks, mode=None: len(chunks))
    inner = Trainer.train_step

    def stepping(self: Trainer, batches: list[Any], signum: int = 0) -> dict[str, float]:
        timer["s"] += 2.5 if self.step == 0 else 0.0  # the first step compiles
        return inner(self, batches, signum)

    monkeypatch.setattr(Trainer, "train_step", stepping)
    waits: list[int] = []
    monkeypatch.setattr(loop, "synchronize", lambda device: waits.append(1))
    run = tmp_path / "run"
    cfg = load_config(None, tiny_args(*corpus, run, training__steps=4, training__compile="true",
                                      logging__log_interval=2))
    loop.train(cfg)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4] and len(waits) == 3
    assert records[0]["compile_s"] == 2.5 and all("compile_s" not in r for r in records[1:])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    assert "compiled in 2.5 s" in lines[0] and all("compiled" not in ln for ln in lines[1:])
