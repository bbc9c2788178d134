"""One per-axis declaration answers every layout question, for any number of axes.

A toy expert weight [E, f, h] declared ``ep -> 0, tp -> 1`` (and a nested split of one dim by
two axes, a padded one, a replicated one), at degrees (ep, tp) = 2x2, 4x1 and 1x4:

* initialisation on each rank equals the matching slice of the single-rank value, bit for bit
  (blocks small enough that shard boundaries fall inside them);
* ``shard`` / ``unshard`` round trip, offsets follow the documented nesting order;
* replicated axes and the one writer of each piece (``owns``; a tied copy never writes);
* a checkpoint written at one split (the checkpoint's own piece writer and sliced reader) is
  read back at every other split equal number by number, each piece written once;
* one tying mechanism: a tied head shares the embedding's Parameter when both are on the rank,
  else gets a copy under the embedding's key with the same initial value.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from colonnade.checkpoint.format import CheckpointReader, merge_fragments, write_rank_shard
from colonnade.checkpoint.sharded import read_local, shard_entry
from colonnade.parallel.groups import ProcessGroups
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel import sharding as sh
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    tie_weights,
)
from colonnade.tensor_parallel.sharding import Coords, Sharding, init_full, init_shard

EXPERT = Sharding("layers.0.experts.fc.weight", (4, 8, 5), splits=(("ep", 0), ("tp", 1)))
NESTED = Sharding("toy.rows.weight", (8, 3), splits=(("dp_shard", 0), ("tp", 0)))
REPLICATED = Sharding("toy.norm.weight", (6,))
DEGREES = [{"ep": 2, "tp": 2}, {"ep": 4, "tp": 1}, {"ep": 1, "tp": 4}]


def _grid(degrees: dict[str, int]) -> list[dict[str, tuple[int, int]]]:
    """Every rank's coordinates, ep outer, tp inner."""
    axes = list(degrees)
    return [{a: (i, degrees[a]) for a, i in zip(axes, index, strict=True)}
            for index in itertools.product(*(range(degrees[a]) for a in axes))]


def _take(full: torch.Tensor, spec: Sharding, coords: Coords) -> torch.Tensor:
    offsets, lengths = spec.box(coords)
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]


@pytest.mark.parametrize("degrees", DEGREES, ids=lambda d: f"ep{d['ep']}xtp{d['tp']}")
def test_two_axis_init_is_the_slice_of_the_single_rank_value(
        monkeypatch: pytest.MonkeyPatch, degrees: dict[str, int]) -> None:
    monkeypatch.setattr(sh, "BLOCK_ELEMENTS", 60)  # 1-2 experts per block: boundaries inside
    assert sh.block_len(EXPERT) == 1 and EXPERT.tiling_dim == 0 and EXPERT.dim == 1
    full = init_full(EXPERT, seed=3, std=0.5, dtype=torch.float64)
    assert full.shape == (4, 8, 5) and full.std() > 0.3
    shards = []
    for coords in _grid(degrees):
        local = init_shard(EXPERT, coords, 3, 0.5, dtype=torch.float64)
        assert local.shape == (4 // degrees["ep"], 8 // degrees["tp"], 5)
        assert torch.equal(local, _take(full, EXPERT, coords))  # bit-exact slice
        assert torch.equal(local, EXPERT.shard(full, coords))
        shards.append(local)
    assert len({tuple(s.flatten().tolist()) for s in shards}) == len(shards)  # all different
    assert torch.equal(EXPERT.unshard(shards, degrees), full)  # layout order: ep outer, tp inner
    assert EXPERT.layout(degrees) == _grid(degrees)


def test_nested_split_of_one_dim_follows_the_declared_order() -> None:
    # dp_shard outer, tp inner on dim 0: rank (d, t) of 2 x 2 holds rows [(2 d + t) 2, +2)
    for d, t in itertools.product(range(2), range(2)):
        coords = {"dp_shard": (d, 2), "tp": (t, 2)}
        assert NESTED.slice(coords) == ((4 * d + 2 * t, 0), (2, 3))
    full = torch.arange(24.0, dtype=torch.float64).view(8, 3)
    shards = [NESTED.shard(full, c) for c in NESTED.layout({"dp_shard": 2, "tp": 2})]
    assert [int(s[0, 0]) for s in shards] == [0, 6, 12, 18]
    assert torch.equal(NESTED.unshard(shards, {"dp_shard": 2, "tp": 2}), full)
    # vocab-style padding on the tp dim: 7 rows padded to 8 for 4 ranks; last shard 1 row real
    padded = Sharding("toy.vocab.weight", (7, 3), splits=(("dp_shard", 0),), dim=0,
                      padded_rows=1)
    last = {"dp_shard": (1, 2), "tp": (1, 2)}
    assert padded.slice(last) == ((6, 0), (2, 3)) and padded.box(last) == ((6, 0), (1, 3))
    init = init_shard(padded, last, 1, 1.0, dtype=torch.float64)
    assert torch.equal(init[1], torch.zeros(3, dtype=torch.float64))  # the padding row
    assert torch.equal(init[:1], init_full(padded, 1, 1.0, dtype=torch.float64)[6:])
    with pytest.raises(ValueError, match="not divisible by the 3 ranks"):
        NESTED.slice({"tp": (0, 3)})


def test_replicated_axes_and_the_one_writer() -> None:
    coords = {"ep": (1, 2), "tp": (1, 2), "dp": (0, 2)}
    assert EXPERT.replicated_axes(coords) == ("dp",)
    assert EXPERT.owns(coords)  # every (ep, tp) rank writes its own box; dp rank 0 of them
    assert not EXPERT.owns({**coords, "dp": (1, 2)})
    ep_only = Sharding("layers.0.experts.router_bias", (4,), splits=(("ep", 0),))
    assert ep_only.replicated_axes(coords) == ("tp", "dp")
    assert not ep_only.owns(coords) and ep_only.owns({**coords, "tp": (0, 2)})
    assert REPLICATED.owns({"tp": (0, 4)}) and not REPLICATED.owns({"tp": (2, 4)})
    copy = Sharding("embedding.word.weight", (11, 6), dim=0, padded_rows=1, tied_copy=True)
    assert not copy.owns({"tp": (0, 2)})  # the first stage's original is the one saved


def _write(root: Path, specs: list[Sharding], fulls: list[torch.Tensor],
           degrees: dict[str, int]) -> dict[str, int]:
    """Every rank of ``degrees`` writes its pieces with the checkpoint's own writer."""
    writers = []
    for rank, coords in enumerate(_grid(degrees)):
        entries = [shard_entry(f"model/{s.key}", s.shard(f, coords), s, coords)
                   for s, f in zip(specs, fulls, strict=True)]
        if write_rank_shard(root, rank, [e for e in entries if e is not None]) is not None:
            writers.append(rank)
    index = merge_fragments(root, writers)
    (root / "index.json").write_text(json.dumps(index))
    return {name: len(t["pieces"]) for name, t in index["tensors"].items()}


@pytest.mark.parametrize("saved", DEGREES, ids=lambda d: f"saved-ep{d['ep']}xtp{d['tp']}")
def test_checkpoint_written_at_one_split_reads_back_at_another(tmp_path: Path,
                                                               saved: dict[str, int]) -> None:
    vocab = Sharding("toy.vocab.weight", (7, 3), dim=0, padded_rows=-7 % saved["tp"])
    specs = [EXPERT, REPLICATED, vocab]
    fulls = [torch.randn(s.full_shape, dtype=torch.float64, generator=torch.Generator()
                         .manual_seed(i)) for i, s in enumerate(specs)]
    counts = _write(tmp_path, specs, fulls, saved)
    real_vocab_shards = sum(1 for c in _grid(saved) if 0 not in vocab.box(c)[1]
                            and c["ep"][0] == 0)
    assert counts == {f"model/{EXPERT.key}": saved["ep"] * saved["tp"],  # one piece per box
                      f"model/{REPLICATED.key}": 1,  # replicated everywhere: written once
                      f"model/{vocab.key}": real_vocab_shards}  # ep replicas: ep rank 0 only
    reader = CheckpointReader(tmp_path)
    for degrees in DEGREES:
        load_vocab = Sharding(vocab.key, (7, 3), dim=0, padded_rows=-7 % degrees["tp"])
        for coords in _grid(degrees):
            for spec, full in zip([EXPERT, REPLICATED, load_vocab], fulls, strict=True):
                got = read_local(reader, f"model/{spec.key}", spec, coords)
                assert torch.equal(got, spec.shard(full, coords)), (spec.key, coords)
            local = load_vocab.local_shape(coords)
            flat = read_local(reader, f"model/{vocab.key}", load_vocab, coords, flat=(1, 5))
            assert torch.equal(flat, load_vocab.shard(fulls[2], coords).reshape(-1)[1:5]), local
    reader.close()


def _ctx() -> ParallelContext:
    return ParallelContext(group=ProcessGroups.single().tp, sp=False, seed=11,
                           rng=RNGTracker(11), dtype=torch.float64)


def test_one_tying_mechanism_shares_or_copies_by_key() -> None:
    ctx = _ctx()
    same = torch.nn.Module()
    same.word = VocabParallelEmbedding(10, 4, ctx, "embedding.word", std=0.3)
    same.head = ColumnParallelLinear(4, 10, ctx, "head", bias=False, std=0.3,
                                     tied_to="embedding.word.weight")
    assert same.head.weight is None and same.head.pending_tie is not None
    with pytest.raises(RuntimeError, match="not resolved"):
        same.head(torch.zeros(2, 1, 4, dtype=torch.float64))
    tie_weights(same)
    assert same.head.weight is same.word.weight  # one Parameter, one gradient
    assert len(list(same.parameters())) == 1
    later = torch.nn.Module()  # a later pipeline stage: no embedding here
    later.head = ColumnParallelLinear(4, 10, ctx, "head", bias=False, std=0.3,
                                      tied_to="embedding.word.weight")
    tie_weights(later)
    copy = later.head.weight
    assert copy is not same.word.weight and torch.equal(copy, same.word.weight)  # same init
    assert copy.sharding.key == "embedding.word.weight" and copy.sharding.tied_copy
    assert copy.sharding.owns({"tp": (0, 1)}) is False
    bad = torch.nn.Module()
    bad.word = VocabParallelEmbedding(10, 4, ctx, "embedding.word", std=0.3)
    bad.head = ColumnParallelLinear(4, 12, ctx, "head", bias=False, std=0.3,
                                    tied_to="embedding.word.weight")
    with pytest.raises(ValueError, match=r"tied weight 'embedding\.word\.weight'"):
        tie_weights(bad)
