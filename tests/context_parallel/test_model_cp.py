"""The model's cp index plumbing, without ranks (a cp group of 2 or 4 ranks that never
communicates: only its size and rank are read): the labels a rank scores, the pipeline message
shape, the positions and document context of the local rows, and the hidden-dropout mask rows,
each against slices of the single-process tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from colonnade.context_parallel.layout import zigzag_index
from colonnade.models.blocks import DocReset, cp_doc_context, doc_context, hidden_dropout
from colonnade.models.gpt import ModelChunk, local_labels
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.pipeline.p2p import message_shape
from colonnade.tensor_parallel.context import ParallelContext
from tests.parity import tiny_model


def _ctx(cp: int, rank: int, *, tp: int = 1, tp_rank: int = 0, sp: bool = False,
         attention: str = "ring") -> ParallelContext:
    stats = CommStats()
    tp_group = CommGroup("tp", list(range(tp)), None, stats, tp_rank)
    cp_group = CommGroup("cp", list(range(cp)), None, stats, rank)
    return ParallelContext(group=tp_group, sp=sp, seed=3, rng=RNGTracker(3), cp=cp_group,
                           cp_attention=attention, dtype=torch.float64)


def test_context_degrees() -> None:
    ctx = _ctx(4, 3)
    assert (ctx.cp_size, ctx.cp_rank) == (4, 3)
    plain = dataclasses.replace(ctx, cp=None)
    assert (plain.cp_size, plain.cp_rank) == (1, 0)


def test_local_labels() -> None:
    labels = torch.arange(2 * 16).view(2, 16)
    single = ProcessGroups.single()
    assert local_labels(labels, single) is labels
    assert local_labels(labels, dataclasses.replace(_ctx(2, 0), cp=None)) is labels
    for rank in range(4):
        got = local_labels(labels, _ctx(4, rank))  # [b, s/cp]
        assert torch.equal(got, labels[:, zigzag_index(16, 4, rank)])
    rows = torch.cat([local_labels(labels, _ctx(2, r)) for r in range(2)], dim=1)
    assert sorted(rows[0].tolist()) == labels[0].tolist()  # every label scored once


@pytest.mark.parametrize(("tp", "sp", "cp", "want"), [
    (1, False, 1, (2, 32, 8)), (1, False, 4, (8, 2, 8)), (2, True, 2, (8, 2, 8)),
    (2, False, 2, (16, 2, 8)),
])
def test_message_shape(tp: int, sp: bool, cp: int, want: tuple[int, int, int]) -> None:
    assert message_shape((2, 32), 8, tp, sp, cp) == want


def test_message_shape_rejects_indivisible() -> None:
    with pytest.raises(ValueError, match=r"parallel\.cp=3"):
        message_shape((2, 32), 8, 1, False, 3)


def _tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, 50, (2, 16), generator=gen)
    tokens[0, [3, 9]] = 1
    tokens[1, 12] = 1
    return tokens


@pytest.mark.parametrize("attention", ["ring", "all_to_all"])
def test_cp_doc_context(attention: str) -> None:
    tokens, reset = _tokens(), DocReset(1)
    full = doc_context(tokens, reset, ids=True)
    assert full.doc_ids is not None and full.mask is not None
    for rank in range(2):
        ctx = _ctx(2, rank, attention=attention)
        doc = cp_doc_context(tokens, reset, ctx, 2, 16, tokens.device)
        idx = zigzag_index(16, 2, rank)
        assert doc.positions is not None and full.positions is not None
        assert torch.equal(doc.positions, full.positions[:, idx])  # [b, s/cp]
        if attention == "ring":
            assert doc.mask is None and doc.doc_ids is not None
            assert torch.equal(doc.doc_ids, full.doc_ids)  # [b, s] full
        else:
            assert doc.doc_ids is None and doc.mask is not None
            assert torch.equal(doc.mask, full.mask)  # [b, 1, s, s] full, natural order
        plain = cp_doc_context(None, None, ctx, 2, 16, tokens.device)
        assert plain.mask is None and plain.doc_ids is None and plain.positions is not None
        assert torch.equal(plain.positions, idx.expand(2, 8))


@pytest.mark.parametrize(("cp", "tp", "sp"), [(2, 1, False), (4, 1, False), (2, 2, True)])
def test_hidden_dropout_rows(cp: int, tp: int, sp: bool) -> None:
    """Each rank's mask rows are the single-process mask's rows of its zigzag (sp) shard (the
    single process runs batch-first: its [b, s, h] mask is the [s, b, h] one transposed)."""
    s, b, h, p = 16, 2, 4, 0.3
    ones = torch.ones(s, b, h, dtype=torch.float64)
    single = _ctx(1, 0)
    assert single.batch_first
    want = hidden_dropout(ones.transpose(0, 1).contiguous(), p, single, "site",
                          True).transpose(0, 1)  # [s, b, h]
    seen = torch.zeros(s, dtype=torch.long)
    for rank in range(cp):
        idx = zigzag_index(s, cp, rank)  # [s/cp]
        for t in range(tp):
            ctx = _ctx(cp, rank, tp=tp, tp_rank=t, sp=sp)
            n = s // cp // (tp if sp else 1)
            rows = idx[t * n:(t + 1) * n] if sp else idx
            got = hidden_dropout(ones[rows], p, ctx, "site", True)  # [n, b, h]
            assert torch.equal(got, want[rows])
            seen[rows] += 1
    assert torch.equal(seen, torch.full((s,), 1 if sp else tp))


def test_generation_refuses_cp() -> None:
    chunk = ModelChunk(tiny_model("llama"), _ctx(2, 0), [0, 1], first=True, last=True)
    with pytest.raises(ValueError, match=r"runs at parallel\.cp=1"):
        chunk.full_logits(torch.zeros(1, 4, dtype=torch.long))
