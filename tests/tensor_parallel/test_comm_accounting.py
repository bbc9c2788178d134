"""Bytes moved by tensor/sequence parallelism, counted by ``groups.stats``, equal the theory.

Per transformer layer and micro-batch of s x b tokens of width h (B = s b h x 8 bytes, fp64):

* tp:  forward  2 all-reduces of B   ('g_fwd': after attention's o and the MLP's down),
       backward 2 all-reduces of B   ('f_bwd': where attention and the MLP take their input);
* sp:  forward  2 all-gathers  to B  ('sp_gather': entering attention and the MLP)
              + 2 reduce-scatters of B ('sp_reduce_scatter': leaving them),
       backward the transposes: 2 reduce-scatters ('sp_gather_bwd') + 2 all-gathers
       ('sp_reduce_scatter_bwd').

A ring all-reduce moves 2(n-1)/n B per rank, an all-gather or reduce-scatter (n-1)/n B, so sp
moves exactly the bytes of tp. Whole model adds the embedding (tp: one g forward; sp: one
reduce-scatter forward / all-gather backward), the head's entry (tp: one f backward; sp: one
all-gather forward / reduce-scatter backward) and the cross entropy's two small all-reduces
('ce_max' [s, b], 'ce_sums' [2, s, b]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from colonnade.data_parallel.finalize import reduce_sp_and_tied
from colonnade.models.blocks import rope_tables
from colonnade.models.build import build_chunks, make_context
from colonnade.models.layer import TransformerLayer
from tests.tensor_parallel.harness import make_batches, rank_groups, tiny_config

FP64 = 8


def _layer_stats(arch: str, tp: int, sp: bool) -> dict[str, dict[str, float]]:
    """Forward + backward of one TransformerLayer; the counters of that alone."""
    config = tiny_config(arch, tp, sp)
    groups = rank_groups(tp)
    ctx = make_context(config, groups, dtype=torch.float64)
    layer = TransformerLayer(config.model, ctx, 0)
    s, b, h = config.training.seq_len, config.training.micro_batch_size, config.model.hidden_size
    x = torch.randn(s, b, h, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if sp:
        x = x.chunk(tp)[groups.tp_rank]  # [s/tp, b, h]
    x.requires_grad_(True)
    rope = rope_tables(config.model, None, torch.float64) if arch == "llama" else None
    groups.stats.reset()
    y = layer(x, rope)  # [s(/tp), b, h]
    fwd = groups.stats.snapshot()
    y.backward(torch.ones_like(y))
    return {"forward": fwd, "all": groups.stats.snapshot()}


def _model_stats(arch: str, tp: int, sp: bool) -> dict[str, dict[str, float]]:
    """Forward + backward of the whole model on one micro-batch, then the sp/tied reduction."""
    config = tiny_config(arch, tp, sp)
    groups = rank_groups(tp)
    (chunk,) = build_chunks(config, groups, dtype=torch.float64)
    tokens, labels = make_batches(config)[0][0]
    groups.stats.reset()
    chunk(tokens, labels).backward()
    step = groups.stats.snapshot()
    reduce_sp_and_tied([chunk], groups, config.model.tie_embeddings)
    return {"step": step, "with_grads": groups.stats.snapshot()}


def _expect(ops: dict[str, tuple[int, int, float]]) -> dict[str, tuple[int, int, float]]:
    return dict(sorted(ops.items()))


def _observed(snapshot: dict[str, dict[str, float]]) -> dict[str, tuple[int, int, float]]:
    return {k: (int(v["calls"]), int(v["payload_bytes"]), v["wire_bytes"])
            for k, v in sorted(snapshot.items())}


def layer_theory(tp: int, sp: bool, big: int, n_layers: int = 1
                 ) -> dict[str, tuple[int, int, float]]:
    """(calls, payload bytes, wire bytes per rank) per op for n_layers layers; big = s b h x 8."""
    n, c = tp, 2 * n_layers
    if not sp:
        ar = 2 * (n - 1) / n * big
        return {"tp/all_reduce/g_fwd": (c, c * big, c * ar),
                "tp/all_reduce/f_bwd": (c, c * big, c * ar)}
    wire = (n - 1) / n * big
    return {"tp/all_gather/sp_gather": (c, c * big // n, c * wire),
            "tp/reduce_scatter/sp_reduce_scatter": (c, c * big, c * wire),
            "tp/reduce_scatter/sp_gather_bwd": (c, c * big, c * wire),
            "tp/all_gather/sp_reduce_scatter_bwd": (c, c * big // n, c * wire)}


CASES = [pytest.param(arch, tp, sp, id=f"{arch}-tp{tp}-{'sp' if sp else 'nosp'}")
         for arch in ("llama", "gpt2") for tp in (2, 4) for sp in (False, True)]


@pytest.mark.parametrize(("arch", "tp", "sp"), CASES)
def test_layer_bytes_equal_theory(run_ranks: Callable[..., list[Any]], arch: str, tp: int,
                                  sp: bool) -> None:
    config = tiny_config(arch, tp, sp)
    s, b, h = config.training.seq_len, config.training.micro_batch_size, config.model.hidden_size
    big = s * b * h * FP64
    want = layer_theory(tp, sp, big)
    for rank, res in enumerate(run_ranks(tp, _layer_stats, arch, tp, sp)):
        assert _observed(res["all"]) == _expect(want), f"rank {rank}: {res['all']}"
        fwd = {k for k in res["forward"]}
        assert fwd == {k for k in want if not k.endswith("_bwd")}, f"rank {rank} forward: {fwd}"
        wire = sum(v["wire_bytes"] for v in res["all"].values())
        assert wire == pytest.approx(4 * 2 * (tp - 1) / tp * big, rel=1e-12), (
            "tp and sp must both move 4 all-reduces' worth of bytes per layer")


@pytest.mark.parametrize(("arch", "tp", "sp"), [
    pytest.param("llama", 2, True, id="llama-tp2-sp"),
    pytest.param("gpt2", 4, False, id="gpt2-tp4-nosp"),
    pytest.param("gpt2", 2, True, id="gpt2-tp2-sp"),
])
def test_model_bytes_equal_theory(run_ranks: Callable[..., list[Any]], arch: str, tp: int,
                                  sp: bool) -> None:
    config = tiny_config(arch, tp, sp)
    m, n = config.model, tp
    s, b = config.training.seq_len, config.training.micro_batch_size
    big, small = s * b * m.hidden_size * FP64, s * b * FP64
    # The embedding and the head's entry act like one more layer's exit and entry.
    want = layer_theory(tp, sp, big, m.num_layers)
    extra = layer_theory(tp, sp, big, 1)
    for key, (calls, payload, wire) in extra.items():
        c, p, w = want[key]
        want[key] = (c + calls // 2, p + payload // 2, w + wire / 2)
    ar = 2 * (n - 1) / n
    want["tp/all_reduce/ce_max"] = (1, small, ar * small)
    want["tp/all_reduce/ce_sums"] = (1, 2 * small, ar * 2 * small)
    for rank, res in enumerate(run_ranks(tp, _model_stats, arch, tp, sp)):
        assert _observed(res["step"]) == _expect(want), f"rank {rank}: {res['step']}"
        grads = _observed(res["with_grads"])
        if sp:  # replicated params' partial grads: norms, positions (gpt2), row biases (gpt2)
            h, layers = m.hidden_size, m.num_layers
            per_layer = (2 * h + 2 * h + 2 * h) if arch == "gpt2" else 2 * h
            numel = layers * per_layer + (2 * h if arch == "gpt2" else h)
            numel += s * h if arch == "gpt2" else 0
            assert grads["tp/all_reduce/sp_grads"] == (1, numel * FP64, ar * numel * FP64)
        else:
            assert "tp/all_reduce/sp_grads" not in grads
