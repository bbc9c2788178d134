"""Issue 19's single-process step costs: the summed loss and the host allocator setting.

* ``cross_entropy(reduction='sum')`` (what training uses: the kernel reduces) equals the sum of
  the per-token losses, with masked labels and label smoothing, gradient included, on one tp
  rank (F.cross_entropy) and through the padded-vocabulary path; a bad reduction is refused.
* :func:`colonnade.device.keep_host_pages` applies on glibc: a loop that makes and frees an
  8 MiB and a 64 MiB tensor takes ~160,000 page faults a pass without it and none with it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colonnade.parallel.groups import ProcessGroups
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX, cross_entropy


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_summed_loss_equals_sum_of_token_losses(padded: bool, smoothing: float) -> None:
    vocab, s, b = 37, 6, 3
    width = vocab + 3 if padded else vocab  # padded columns take the vocab-parallel path
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(s, b, width, dtype=torch.float64, generator=gen)
    targets = torch.randint(0, vocab, (s, b), generator=gen)
    targets[1, 2] = targets[4, 0] = IGNORE_INDEX
    group = ProcessGroups.single().tp
    grads = []
    for reduction in ("none", "sum"):
        z = logits.clone().requires_grad_()
        loss = cross_entropy(z, targets, group, vocab, smoothing, reduction=reduction)
        assert loss.shape == ((s, b) if reduction == "none" else ())
        total = loss.sum() if reduction == "none" else loss
        total.backward()
        grads.append((float(total.detach()), z.grad))
    (l0, g0), (l1, g1) = grads
    assert abs(l0 - l1) < 1e-12 * abs(l0)
    assert float((g0 - g1).abs().max()) < 1e-14
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, targets, group, vocab, reduction="mean")


CHURN = """
import resource, sys, torch
from colonnade.device import keep_host_pages

def churn():  # an 8 MiB and a 64 MiB activation per pass, made and freed
    for _ in range(10):
        a = torch.empty(2048, 1024); a.fill_(1.0)
        b = torch.empty(16, 1024, 1024); b.fill_(1.0)
        del a, b

def faults_of_second_pass():
    churn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    churn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

without = faults_of_second_pass()
applied = keep_host_pages()
print(without, applied, faults_of_second_pass())
"""


def test_keep_host_pages_stops_refaulting() -> None:
    """In a fresh process: without the setting glibc maps the 64 MiB block afresh on every
    pass (above its largest dynamic mmap threshold, 32 MiB), faulting each page in again;
    with it the second pass takes no fault."""
    out = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2]).stdout.split()
    without, applied, with_setting = int(out[0]), out[1] == "True", int(out[2])
    assert applied
    assert without > 10 * 16384 // 2, without  # 10 x 64 MiB = 163,840 pages, most refaulted
    assert with_setting < 100, with_setting
