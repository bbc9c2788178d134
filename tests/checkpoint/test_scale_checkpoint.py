"""A 4096-rank job (tp8 pp8 dp64, ZeRO-1 on and off) checkpointed without processes.

Every rank's model chunks, data-parallel buffers and optimizer are built by the code a Trainer
uses (``build_chunks``, ``build_data_parallel``, ``DistributedOptimizer``) on process-free
groups (:func:`plan_groups` partitions); the save code (``model_entries``, ``optim_entries``,
``rank_files``, ``plan_fragment``, ``merge_index``) says what each rank writes, and the load
code (``load_model``, ``load_optimizer``) runs against a reader whose only I/O step
(``_fetch``) counts the bytes its read plans take instead of reading files.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
import torch

from colonnade.checkpoint.commit import METADATA
from colonnade.checkpoint.format import (
    DTYPES,
    INDEX,
    CheckpointReader,
    merge_index,
    plan_fragment,
    rank_files,
)
from colonnade.checkpoint.optim_state import logical_state
from colonnade.checkpoint.pieces import flat_piece
from colonnade.checkpoint.reads import PieceRead, stored_numel
from colonnade.checkpoint.sharded import load_model, load_optimizer, model_entries, optim_entries
from colonnade.config.sections import Config, ModelConfig, ParallelConfig, TrainingConfig
from colonnade.data_parallel import build_data_parallel
from colonnade.models.build import build_chunks
from colonnade.models.params import unique_params
from colonnade.optim.distributed import DistributedOptimizer
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups, plan_groups
from colonnade.tensor_parallel.sharding import tp_coords

BIG = ParallelDims(tp=8, pp=8, dp=64)
COMMIT_FILES = 3  # index.json, metadata.json, config.toml


def _config(zero: bool) -> Config:
    model = ModelConfig(arch="llama", num_layers=8, hidden_size=64, num_heads=8,
                        num_kv_heads=8, ffn_hidden_size=128, vocab_size=250, max_seq_len=16)
    par = ParallelConfig(tp=BIG.tp, pp=BIG.pp, dp=BIG.dp, use_distributed_optimizer=zero,
                         bucket_size=4096)
    tr = TrainingConfig(steps=1, seq_len=16, micro_batch_size=1, microbatches=8,
                        global_batch_size=8 * BIG.dp, precision="bf16")
    return Config(model=model, parallel=par, training=tr)


@dataclasses.dataclass
class RankState:
    """What one rank holds: its groups, chunks (shared by its dp replicas) and optimizer."""

    groups: ProcessGroups
    chunks: list[Any]
    optimizer: DistributedOptimizer


def _ranks(cfg: Config) -> list[RankState]:
    plan = plan_groups(BIG)
    member = {n: {r: ranks for ranks in s.partition for r in ranks} for n, s in plan.items()}
    world = list(range(BIG.world_size))
    chunks: dict[tuple[int, int], list[Any]] = {}
    replicas: dict[tuple[int, int], DistributedOptimizer] = {}
    zero = cfg.parallel.use_distributed_optimizer
    out = []
    for rank in world:
        stats = CommStats()
        made = {n: CommGroup(n, member[n][rank], None, stats, rank) for n in plan}
        groups = ProcessGroups(dims=BIG, rank=rank, stats=stats,
                               world=CommGroup("world", world, None, stats, rank), **made)
        key = (groups.pp.rank, groups.tp.rank)
        if key not in chunks:
            chunks[key] = build_chunks(cfg, groups)
        if zero or key not in replicas:  # without ZeRO-1 dp replicas hold equal optimizers
            ddp = build_data_parallel(chunks[key], cfg, groups)  # no step runs: hooks stay idle
            replicas[key] = DistributedOptimizer(ddp, cfg.optim, groups, 1,
                                                 cfg.training.precision)
        out.append(RankState(groups, chunks[key], replicas[key]))
    return out


class PlanReader(CheckpointReader):
    """A reader of an in-memory index: executes the real read plans, counting their bytes."""

    def _fetch(self, name: str, r: PieceRead) -> torch.Tensor:
        dtype = DTYPES[self.tensors[name]["dtype"]]
        self.bytes_read += r.numel * dtype.itemsize
        shape = [s.stop - s.start for s in r.src]
        return torch.zeros(shape, dtype=dtype)


def _model_bytes(state: RankState) -> int:
    g = state.groups
    coords = tp_coords(g.tp.rank, g.tp.size)
    return sum(math.prod(p.sharding.box(coords)[1]) * p.element_size()
               for p in unique_params(state.chunks))


def _held_optim_bytes(state: RankState) -> int:
    """Bytes of the optimizer elements this rank holds (its ZeRO-1 ranges, padding cut off;
    tp-replicated parameters included, though only tp rank 0 writes them)."""
    g, out = state.groups, 0
    for states in logical_state(state.optimizer).values():
        for sl in states.values():
            _, keep = flat_piece(sl.sharding, tp_coords(g.tp.rank, g.tp.size), sl.flat)
            if keep is not None:
                out += (keep[1] - keep[0]) * sl.tensor.element_size()
    return out


def _entry_bytes(entries: list[Any]) -> int:
    return sum(e.tensor.numel() * e.tensor.element_size() for e in entries)


def _save_plan(ranks: list[RankState]) -> tuple[list[str], dict[str, Any], list[int]]:
    """Files one checkpoint writes, its index, and the optimizer bytes each rank owns."""
    files, fragments, own = [], [], []
    for rank, st in enumerate(ranks):
        model = model_entries(st.chunks, st.groups)
        optim = optim_entries(st.optimizer, st.groups)
        own.append(_entry_bytes(optim))
        files += rank_files(rank, model + optim)
        if model + optim:
            fragments.append((str(rank), plan_fragment(rank, model + optim)[1]))
    return [*files, INDEX, METADATA, "config.toml"], merge_index(fragments), own


@pytest.fixture(scope="module")
def zero_layout() -> tuple[list[RankState], list[str], dict[str, Any], list[int]]:
    torch.set_num_threads(1)
    ranks = _ranks(_config(zero=True))
    return (ranks, *_save_plan(ranks))


def test_4096_ranks_files_per_checkpoint_follow_the_owners(zero_layout: Any) -> None:
    """ZeRO-1: a rank writes only if it owns optimizer elements; without ZeRO-1 only the 64
    dp-rank-0 ranks (one per (pp, tp) shard) write: 2 files each plus 3, not 2 x 4096 + 3."""
    _, files, index, own = zero_layout
    shards = [f for f in files if f.endswith(".safetensors")]
    owners = sum(1 for b in own if b > 0)
    dp0 = BIG.tp * BIG.pp  # dp rank 0 writes the model even where it owns only padding
    assert owners <= len(shards) <= owners + dp0 and len(files) == 2 * len(shards) + COMMIT_FILES
    assert BIG.world_size // 2 < owners < BIG.world_size  # some own only bucket padding
    pieces = sum(len(t["pieces"]) for t in index["tensors"].values())
    print(f"\nZeRO-1 tp8 pp8 dp64: {len(files)} files, {len(shards)} writers, {pieces} pieces, "
          f"index {len(json.dumps(index)) / 2**20:.1f} MiB")
    plain = _ranks(_config(zero=False))
    files_plain, _, _ = _save_plan(plain)
    assert len(files_plain) == 2 * BIG.tp * BIG.pp + COMMIT_FILES  # 131 files


def test_4096_ranks_each_resume_reads_its_shard_and_range(zero_layout: Any) -> None:
    """Resuming the same layout: every rank reads exactly its model shard (replicated over dp,
    so needed by each) plus its own optimizer range; all ranks together read the optimizer
    state about once (tp-replicated norms' state is read by each tp rank)."""
    ranks, _, index, own = zero_layout
    total_optim = 0
    for rank, st in enumerate(ranks):
        reader = PlanReader("<memory>", index=index)
        load_model(reader, st.chunks, st.groups)
        model_bytes = reader.bytes_read
        load_optimizer(reader, st.optimizer, st.chunks, st.groups, 1)
        optim_bytes = reader.bytes_read - model_bytes
        assert model_bytes == _model_bytes(st), rank
        assert optim_bytes == _held_optim_bytes(st), rank
        assert own[rank] <= optim_bytes <= own[rank] + 3 * 4 * 64 * 3  # + tp-replicated norms
        total_optim += optim_bytes
    stored = sum(stored_numel(p) for name, t in index["tensors"].items()
                 if name.startswith("optim/") for p in t["pieces"]) * 4  # fp32 states
    assert stored <= total_optim <= 1.1 * stored
