"""Shared pieces of the checkpoint tests: tiny configs, synthetic batches, rank-side runs.

Functions here run inside pool ranks (imported by name ``tests.checkpoint.harness``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from colonnade.checkpoint.export import full_state
from colonnade.checkpoint.optim_state import dp_sharded
from colonnade.checkpoint.sharded import optim_entries
from colonnade.checkpoint.training_state import load_training, save_training
from colonnade.config.sections import Config, OptimConfig, ParallelConfig, TrainingConfig
from colonnade.parallel.dims import ParallelDims
from colonnade.training.setup import Runtime
from tests.parity import rank_groups, rel_err, split_micro, step_global_batch, tiny_model

GLOBAL_BATCH, MICRO, SEQ, VOCAB = 8, 2, 8, 101


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel layout of a test case."""

    tp: int = 1
    pp: int = 1
    vp: int = 1
    dp: int = 1
    sp: bool = False
    zero: bool = False
    schedule: str = ""
    """The pipeline schedule; empty: interleaved_1f1b when vp > 1, else 1f1b."""
    layers: tuple[int, ...] | None = None
    """parallel.pipeline_layout (layers per virtual stage); None: the even split."""

    @property
    def pipeline_schedule(self) -> str:
        """The schedule this layout trains with."""
        return self.schedule or ("interleaved_1f1b" if self.vp > 1 else "1f1b")

    @property
    def world(self) -> int:
        """Ranks it needs."""
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"vp{self.vp}", f"dp{self.dp}"]
        return ("".join(parts) + ("sp" if self.sp else "") + ("zero" if self.zero else "")
                + (f"-{self.schedule}" if self.schedule else "")
                + ("-" + "".join(map(str, self.layers)) if self.layers else ""))


def make_config(layout: Layout, precision: str = "fp64", arch: str = "llama",
                tie: bool = False) -> Config:
    """A tiny model whose global batch is the same in every layout."""
    model = tiny_model(arch, layers=4, hidden=32, heads=8, kv_heads=4, ffn=64, vocab=VOCAB,
                       seq=16, init_std=0.02, tie=tie)
    par = ParallelConfig(tp=layout.tp, pp=layout.pp, vp=layout.vp, dp=layout.dp, sp=layout.sp,
                         use_distributed_optimizer=layout.zero, bucket_size=1000,
                         schedule=layout.pipeline_schedule, pipeline_layout=layout.layers)
    mb = GLOBAL_BATCH // (MICRO * layout.dp)
    tr = TrainingConfig(steps=6, seq_len=SEQ, micro_batch_size=MICRO, microbatches=mb,
                        global_batch_size=GLOBAL_BATCH, precision=precision, eval_interval=0)
    opt = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, weight_decay=0.1, clip_grad=0.5)
    return Config(model=model, parallel=par, training=tr, optim=opt)


def batches_for(step: int, dp_rank: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's micro-batches of the synthetic global batch of ``step``."""
    _, data = step_global_batch(step, GLOBAL_BATCH // MICRO, MICRO, SEQ, VOCAB)  # [g/b, b, s+1]
    m = GLOBAL_BATCH // (MICRO * dp)
    return split_micro(data[dp_rank * m:(dp_rank + 1) * m])


def make_trainer(layout: Layout, precision: str = "fp64", arch: str = "llama",
                 tie: bool = False) -> Any:
    """A Trainer of ``layout`` on this pool rank (no data: batches are fed by the test)."""
    from colonnade.training.loop import Trainer

    torch.set_num_threads(1)
    cfg = make_config(layout, precision, arch, tie)
    groups = rank_groups(ParallelDims(tp=layout.tp, pp=layout.pp, dp=layout.dp, vp=layout.vp))
    return Trainer(Runtime(cfg, torch.device("cpu"), groups), None)


def train_steps(trainer: Any, count: int) -> list[float]:
    """Run ``count`` steps on the synthetic batches; returns the losses."""
    g = trainer.groups
    return [trainer.train_step(batches_for(trainer.step, g.dp.rank, g.dp.size))["loss"]
            for _ in range(count)]


def gathered(trainer: Any) -> dict[str, torch.Tensor]:
    """Full parameters held by this rank's pipeline stage (dp 0, tp 0 returns them)."""
    ddp = getattr(trainer, "ddp", None)
    if ddp is not None:
        ddp.finish_param_gather()  # ZeRO-1 gathers params lazily (before the next forward)
    state = full_state(trainer.chunks, trainer.groups)
    g = trainer.groups
    return state if g.dp.rank == 0 and g.tp.rank == 0 else {}


def run_save(layout: Layout, root: str, before: int, after: int,
             precision: str = "fp64", arch: str = "llama", tie: bool = False) -> dict[str, Any]:
    """Train ``before`` steps, save, train ``after`` more; losses and final full params."""
    trainer = make_trainer(layout, precision, arch, tie)
    assert not layout.zero or dp_sharded(trainer.optimizer), "ZeRO-1 optimizer not sharded"
    losses = train_steps(trainer, before)
    save_training(trainer, root, keep_last=2)
    losses += train_steps(trainer, after)
    return {"losses": losses, "params": gathered(trainer)}


def run_load(layout: Layout, root: str, after: int, precision: str = "fp64",
             arch: str = "llama", tie: bool = False) -> dict[str, Any]:
    """Resume from ``root`` under ``layout`` and train ``after`` steps."""
    trainer = make_trainer(layout, precision, arch, tie)
    assert not layout.zero or dp_sharded(trainer.optimizer), "ZeRO-1 optimizer not sharded"
    load_training(trainer, root)
    losses = train_steps(trainer, after)
    return {"losses": losses, "params": gathered(trainer), "step": trainer.step}


def run_roundtrip(layout: Layout, src: str, dst: str) -> int:
    """Load ``src`` under ``layout`` and save it again to ``dst`` unchanged (no training)."""
    trainer = make_trainer(layout)
    load_training(trainer, src)
    save_training(trainer, dst, keep_last=1)
    return len(optim_entries(trainer.optimizer, trainer.groups))


def merge(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Union of every rank's gathered parameters."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r.get("params", {}))
    return out


def assert_same_run(a: list[dict[str, Any]], b: list[dict[str, Any]], tol: float,
                    skip_losses: int = 0) -> None:
    """Losses (after ``skip_losses``) and merged params of two runs agree within ``tol``."""
    la, lb = a[0]["losses"][skip_losses:], b[0]["losses"]
    assert len(la) == len(lb), (la, lb)
    for x, y in zip(la, lb, strict=True):
        assert abs(x - y) <= tol * abs(y), f"losses differ: {la} vs {lb}"
    pa, pb = merge(a), merge(b)
    assert pa.keys() == pb.keys(), sorted(set(pa) ^ set(pb))
    for k in pa:
        err = rel_err(pa[k], pb[k])
        assert err <= tol, f"{k}: rel err {err:.3e}"


def path(p: Path) -> str:
    """str for rank args."""
    return str(p)


class CountingOpen:
    """A stand-in for ``safetensors.safe_open`` that counts the tensor bytes read through it
    (``get_tensor`` and ``get_slice(...)[index]``); patch it over a module's ``safe_open``."""

    def __init__(self) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self.bytes = 0

    def __call__(self, path: str, framework: str = "pt") -> Any:
        return _CountingHandle(self, self._open(path, framework=framework))


class _CountingHandle:
    def __init__(self, counter: CountingOpen, handle: Any) -> None:
        self._c, self._h = counter, handle

    def __enter__(self) -> _CountingHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self._h.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        t = self._h.get_tensor(name)
        self._c.bytes += t.numel() * t.element_size()
        return t

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self._c, self._h.get_slice(name))


class _CountingSlice:
    def __init__(self, counter: CountingOpen, sl: Any) -> None:
        self._c, self._s = counter, sl

    def get_shape(self) -> list[int]:
        return self._s.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self._s[index]
        self._c.bytes += t.numel() * t.element_size()
        return t
