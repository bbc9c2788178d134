"""A DeepSeek-V3-shaped checkpoint reshards (issue 36): a tiny model with multi-head latent
attention, a dense first layer, then MoE layers (sigmoid router limited to 1 of 2 expert
groups, selection bias updated every step, routed scaling, a shared expert) trains 2 float64
steps at tp2 x pp2 x ep2 (sp, ep folded into tp), saves, and resumes at tp1 x ep4 (dp4) for 2
more. Every resumed loss equals the uninterrupted tp2 x pp2 x ep2 run's (rel. 1e-10), and so
do the final parameters, selection biases included."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from colonnade.config.sections import ModelConfig
from tests.families.harness import GLOBAL_BATCH, MICRO, SEQ, Layout, family_config, tiny
from tests.families.test_deepseek_v3 import MLA, MOE
from tests.parity import rel_err, split_micro, step_global_batch

TOL = 1e-10
SAVED_AT = Layout(tp=2, sp=True, pp=2, ep=2)
RESUMED_AT = Layout(dp=4, ep=4)


def _model() -> ModelConfig:
    return tiny(ModelConfig(arch="deepseek_v3", num_layers=4, hidden_size=32, num_heads=4,
                            ffn_hidden_size=48, **MLA),
                **(MOE | {"moe_router_bias_update_rate": 1e-2}))


def _run(layout: Layout, steps: int, save: str | None, load: str | None,
         save_after: int | None = None) -> dict[str, Any]:
    """Rank body: (resume from ``load``), train ``steps`` steps on the shared global batches
    (saving to ``save`` after ``save_after`` of them), return the losses and this rank's
    share of the full parameters (dp rank 0, tp rank 0 of each stage)."""
    from colonnade.checkpoint.export import full_state
    from colonnade.checkpoint.training_state import load_training, save_training
    from colonnade.parallel.dims import ParallelDims
    from colonnade.parallel.groups import ProcessGroups
    from colonnade.training.loop import Trainer
    from colonnade.training.setup import Runtime

    torch.set_num_threads(1)
    model = _model()
    cfg = family_config(model, layout)
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, steps=4))
    groups = ProcessGroups.build(ParallelDims.from_config(cfg.parallel, layout.world),
                                 experts=True)
    trainer = Trainer(Runtime(cfg, torch.device("cpu"), groups), None)
    if load is not None:
        load_training(trainer, load)
    m = GLOBAL_BATCH // (MICRO * groups.dp.size)
    losses = []
    for i in range(steps):
        if save is not None and i == save_after:
            save_training(trainer, save, keep_last=1)
        _, data = step_global_batch(trainer.step, GLOBAL_BATCH // MICRO, MICRO, SEQ,
                                    model.vocab)
        batch = split_micro(data[groups.dp.rank * m:(groups.dp.rank + 1) * m])
        losses.append(trainer.train_step(batch)["loss"])
    trainer.ddp.finish_param_gather()
    state = full_state(trainer.chunks, groups, trainer.ddp)
    keep = groups.dp_cp.rank == 0 and groups.tp.rank == 0
    return {"losses": losses, "params": state if keep else {}, "step": trainer.step}


def _merged(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for res in results:
        out.update(res["params"])
    return out


def test_tp2_pp2_ep2_checkpoint_resumes_at_tp1_ep4(run_ranks: Callable[..., list[Any]],
                                                   tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    whole = run_ranks(SAVED_AT.world, _run, SAVED_AT, 4, root, None, 2)
    resumed = run_ranks(RESUMED_AT.world, _run, RESUMED_AT, 2, None, root)
    want = whole[-1]["losses"][2:]
    for res in resumed:
        assert res["step"] == 4
        for a, b in zip(res["losses"], want, strict=True):
            assert abs(a - b) <= TOL * abs(b), f"resumed loss {a!r} != {b!r}"
    ref, got = _merged(whole), _merged(resumed)
    assert sorted(got) == sorted(ref)
    assert any(".router." in k and "bias" in k for k in ref), sorted(ref)
    worst = max(ref, key=lambda k: rel_err(got[k], ref[k]))
    err = rel_err(got[worst], ref[worst])
    assert err <= TOL, f"{worst}: rel err {err:.2e}"
