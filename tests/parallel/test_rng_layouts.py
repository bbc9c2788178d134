"""Dropout masks across layouts (float64, 2 gloo ranks): every rank draws only its part, and
what it draws is the single-process model's mask at the same global elements.

Each rank runs one training micro-batch (forward and backward) of a tiny model with hidden and
attention dropout, recording every draw with its full shape and global index. The reference
(tp1, dp1, in this process) runs the global micro-batches 0 and 1. Then for every draw
* the full shape is the reference's and the mask equals the reference's mask at the index;
* the elements evaluated are only the rank's slice (the largest tensor the draw makes has
  the slice's element count): attention masks a_total / tp heads, hidden
  (residual/embedding) masks s / tp rows under sp, and the whole mask where the tensor is
  replicated (tp without sp); under dp each rank draws its own micro-batch's masks only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from colonnade.config.sections import Config
from colonnade.models.build import build_chunks, build_reference
from colonnade.models.gpt import ModelChunk
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.pipeline.plan import set_rng_context
from tests.tensor_parallel.harness import tiny_config

P = 0.2
Draw = tuple[str, int, tuple[int, ...], tuple[slice, ...], torch.Tensor]
"""(site, global micro-batch, full shape, index, keep-mask)."""


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op creates inside ``with``."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@dataclass
class IndexRecorder(RNGTracker):
    """Keeps every forward draw with its full shape and global index, and the largest
    tensor (elements) the draw made."""

    draws: list[Draw] = field(default_factory=list)
    largest: list[int] = field(default_factory=list)

    def keep_mask(self, site: str, full_shape: tuple[int, ...], p: float,
                  index: tuple[slice, ...], device: torch.device) -> torch.Tensor:
        with LargestTensor() as meter:
            mask = super().keep_mask(site, full_shape, p, index, device)
        self.draws.append((site, self.microbatch, full_shape, index, mask.clone()))
        self.largest.append(meter.numel)
        return mask


def _tokens(config: Config, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + microbatch)
    tr = config.training
    tokens = torch.randint(0, config.model.vocab_size, (tr.micro_batch_size, tr.seq_len + 1),
                           generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _train_microbatch(chunk: ModelChunk, config: Config, microbatch: int) -> None:
    tokens, labels = _tokens(config, microbatch)
    chunk.train()
    chunk(tokens, labels).backward()


def rank_draws(arch: str, tp: int, sp: bool, dp: int) -> dict[str, Any]:
    """Rank body: one micro-batch of this rank (global index dp_rank), draws recorded."""
    torch.set_num_threads(1)
    config = tiny_config(arch, tp, sp, dropout=P)
    groups = ProcessGroups.build(ParallelDims(tp=tp, dp=dp))
    (chunk,) = build_chunks(config, groups, dtype=torch.float64)
    recorder = IndexRecorder(config.training.seed)
    chunk.ctx.rng = recorder
    plan = SimpleNamespace(step=0, groups=groups)
    set_rng_context([chunk], plan, 0, 1)  # type: ignore[arg-type]
    _train_microbatch(chunk, config, groups.dp_rank)
    return {"draws": recorder.draws, "largest": recorder.largest, "tp_rank": groups.tp_rank,
            "dp_rank": groups.dp_rank}


def reference_masks(arch: str) -> dict[tuple[str, int], tuple[tuple[int, ...], torch.Tensor]]:
    """(site, micro-batch) -> (full shape, full mask) of the single-process model."""
    config = tiny_config(arch, 1, False, dropout=P)
    chunk = build_reference(config, torch.float64)
    recorder = IndexRecorder(config.training.seed)
    chunk.ctx.rng = recorder
    for microbatch in (0, 1):
        recorder.set_context(0, microbatch)
        _train_microbatch(chunk, config, microbatch)
    out = {}
    for site, mb, full_shape, _, mask in recorder.draws:
        assert mask.shape == full_shape, f"{site}: the reference draws the whole mask"
        out[(site, mb)] = (full_shape, mask)
    return out


@pytest.mark.parametrize(("arch", "tp", "sp", "dp"), [
    pytest.param("llama", 2, False, 1, id="llama-tp2"),
    pytest.param("llama", 2, True, 1, id="llama-tp2-sp"),
    pytest.param("gpt2", 2, True, 1, id="gpt2-tp2-sp"),
    pytest.param("llama", 1, False, 2, id="llama-dp2"),
])
def test_each_rank_draws_only_its_slice_of_the_reference_mask(
        run_ranks: Callable[..., list[Any]], arch: str, tp: int, sp: bool, dp: int) -> None:
    ref = reference_masks(arch)
    layers = tiny_config(arch, 1, False).model.num_layers
    for res in run_ranks(tp * dp, rank_draws, arch, tp, sp, dp):
        who = f"{arch} tp{tp}{'+sp' if sp else ''} dp{dp} rank (tp {res['tp_rank']}, dp " \
              f"{res['dp_rank']})"
        sites = {draw[0] for draw in res["draws"]}
        assert len(res["draws"]) == len(sites) == 1 + 3 * layers, f"{who}: {sorted(sites)}"
        for (site, mb, full_shape, index, mask), largest in zip(res["draws"], res["largest"],
                                                                strict=True):
            assert mb == res["dp_rank"], f"{who} {site}: micro-batch {mb}"
            ref_shape, ref_mask = ref[(site, mb)]
            assert full_shape == ref_shape, f"{who} {site}: full shape {full_shape}"
            assert torch.equal(mask, ref_mask[index]), f"{who} {site}: mask differs"
            split = tp if site.endswith("attn_dropout") or sp else 1
            assert mask.numel() * split == ref_mask.numel(), (
                f"{who} {site}: drew {mask.numel()} of {ref_mask.numel()} elements")
            assert largest == mask.numel(), (
                f"{who} {site}: the draw made a tensor of {largest} elements for a slice of "
                f"{mask.numel()}")
            assert 0 < int((~mask).sum()) < mask.numel(), f"{who} {site}: degenerate mask"
