"""Colonnade's optimizer path (flat buffers, DataParallel with dp = 1, DistributedOptimizer:
global-norm clipping, AdamW with weight decay on matrices only, the LR schedule) against
``torch.optim.AdamW`` + ``torch.nn.utils.clip_grad_norm_`` on the plain model, float64, for a
few steps: the loss of every step and every parameter after it agree to 1e-10 relative.

Both sides start from the same randomised weights; the plain side's LR per step is written out
by hand (warmup 2 steps then cosine to min_lr over 4 steps), weight decay goes to parameters
with ndim > 1 (Colonnade's rule, stated in ``OptimConfig.weight_decay``). Clipping is active
(the gradient norm is ~6 against clip_grad = 1), so the clip coefficient is checked too.
"""

from __future__ import annotations

import pytest
import torch

from colonnade.config.sections import Config, OptimConfig, TrainingConfig
from colonnade.data_parallel.ddp import build_data_parallel
from colonnade.models.build import build_reference
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.parallel.groups import ProcessGroups
from tests.reference.common import batch, model_config, randomise, spec_of
from tests.reference.plain_models import PlainLM, colonnade_names, load_from_colonnade

STEPS = 4
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, decay="cosine", weight_decay=0.1,
                    beta1=0.9, beta2=0.95, eps=1e-8, clip_grad=1.0)
HAND_LR = [5e-3, 1e-2, 1e-2, 5.5e-3]
"""lr (k + 1) / 2 for k < 2; then cosine t = (k - 2) / 2: 1e-2, 1e-3 + 9e-3 (1 + 0) / 2."""


def colonnade_run(arch: str) -> tuple[list[float], list[float], dict[str, torch.Tensor],
                                      dict[str, torch.Tensor]]:
    """(losses, LRs, initial and final parameters by name) of STEPS Colonnade updates."""
    cfg = Config(model=model_config(arch), optim=OPTIM,
                 training=TrainingConfig(precision="fp64", steps=STEPS, seed=7))
    model = build_reference(cfg)
    randomise(model)
    model.train()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = ProcessGroups.single()
    ddp = build_data_parallel([model], cfg, groups)
    opt = DistributedOptimizer(ddp, cfg.optim, groups, STEPS, "fp64")
    losses, lrs = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*batch(masked=True, seed=step))
        loss.backward()
        ddp.finish_grad_sync()
        info = opt.step()
        losses.append(loss.item())
        lrs.append(info["lr"])
    ddp.finish_param_gather()
    return losses, lrs, initial, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_steps_match_torch_adamw(arch: str) -> None:
    losses, lrs, initial, final = colonnade_run(arch)
    assert lrs == pytest.approx(HAND_LR, rel=1e-12)
    plain = PlainLM(spec_of(model_config(arch))).double().train()
    load_from_colonnade(plain, initial)
    decay = [p for p in plain.parameters() if p.ndim > 1]
    no_decay = [p for p in plain.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPTIM.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=HAND_LR[0], betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    norms = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = HAND_LR[step]
        opt.zero_grad()
        loss = plain(*batch(masked=True, seed=step))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(plain.parameters(), OPTIM.clip_grad).item())
        opt.step()
        assert abs(losses[step] - loss.item()) <= 1e-10 * abs(loss.item())
    assert min(norms) > 2 * OPTIM.clip_grad  # clipping was active every step
    plain_params = dict(plain.named_parameters())
    for ours, (theirs, start, rows) in colonnade_names(plain.spec).items():
        ref = plain_params[theirs].detach()
        ref = ref if rows < 0 else ref[start:start + rows]
        moved = (ref - initial[ours]).norm().item()
        if arch == "gpt2" and ours.endswith("attn.k.bias"):  # no RoPE: it only shifts softmax
            # zero gradient in exact arithmetic, no decay: Adam moves it by
            # lr x rounding noise / eps ~ 1e-10 on each side, differently
            assert moved < 1e-9 and (final[ours] - initial[ours]).norm() < 1e-9, ours
            continue
        assert moved > 1e-4, ours  # every other parameter was updated
        assert (final[ours] - ref).norm() <= 1e-10 * moved, ours
