"""The layouts and the piece-cutting shared by the distributed Muon tests.

:func:`layout_config` makes a tiny float64 config (dense llama, or the MoE harness's model)
for one named layout; :func:`u_pieces` cuts a rank's Muon pieces out of its owned flat ranges,
each holding its slice of a seeded logical matrix U, and :func:`expected_piece` says what that
slice must hold after the exchange applied fn: the same slice of fn(U).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import torch

from colonnade.config.sections import Config, OptimConfig, ParallelConfig, TrainingConfig
from colonnade.optim.muon import MuonPiece, muon_matrices, split_matrices
from tests.moe.harness import moe_config
from tests.parity import resolved, tiny_model

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp": 2},
    "tp2-sp": {"tp": 2, "sp": True},
    "pp2": {"pp": 2},
    "dp2-ddp": {"dp": 2},
    "dp2-zero1": {"dp": 2, "zero_stage": 1},
    "dp2-zero2": {"dp": 2, "zero_stage": 2},
    "dp2-zero3": {"dp": 2, "zero_stage": 3},
    "cp2": {"cp": 2},
    "dp4-hybrid2-zero1": {"dp": 4, "zero_stage": 1, "zero_shard_size": 2},
    "tp2-pp2-dp2-zero1": {"tp": 2, "pp": 2, "dp": 2, "zero_stage": 1},
    "tp2-pp2-dp2": {"tp": 2, "pp": 2, "dp": 2},
    "ep2": {"moe": True, "ep": 2},
    "ep2-zero1": {"moe": True, "ep": 2, "dp": 2, "zero_stage": 1},
    "tp2sp-etp2": {"moe": True, "ep": 1, "etp": 2, "tp": 2, "sp": True},
    "cp2-zero1": {"cp": 2, "zero_stage": 1},
    "tp2sp-dp2-ep2-zero1": {"moe": True, "ep": 2, "dp": 2, "tp": 2, "sp": True,
                            "zero_stage": 1},
    "dp4-ep1-hybrid2-zero1": {"moe": True, "ep": 1, "dp": 4, "zero_stage": 1,
                              "zero_shard_size": 2},
    "mla-tp2-dp2-zero1": {"mla": True, "tp": 2, "dp": 2, "zero_stage": 1},
}
"""Named layouts (``moe``: the MoE harness's model; ``mla``: a tiny DeepSeek-V3 attention,
whose q_a / kv_a projections are Muon matrices replicated over tp)."""

MLA = {"mla_kv_lora_rank": 16, "mla_q_lora_rank": 24, "mla_qk_nope_head_dim": 16,
       "mla_qk_rope_head_dim": 8, "mla_v_head_dim": 12}
"""tests/families/test_deepseek_v3.py's multi-head latent attention."""


def layout_config(name: str, optimizer: str = "adamw", steps: int = 3) -> Config:
    """The resolved float64 config of layout ``name`` (small buckets, so ZeRO shards cut
    matrices in the middle); a dense model's global batch is 4 micro-batches of 2 in every
    layout (one single-process reference for all)."""
    case = dict(LAYOUTS[name])
    if case.pop("moe", False):
        config = moe_config(steps=steps, **case)
        config = dataclasses.replace(config, optim=dataclasses.replace(config.optim,
                                                                       name=optimizer))
    else:
        par = ParallelConfig(tp=case.get("tp", 1), sp=case.get("sp", False),
                             pp=case.get("pp", 1), cp=case.get("cp", 1), dp=case.get("dp", 1),
                             zero_stage=case.get("zero_stage", 0),
                             zero_shard_size=case.get("zero_shard_size"),
                             use_distributed_optimizer=case.get("zero_stage", 0) >= 1)
        training = TrainingConfig(steps=steps, seq_len=16, micro_batch_size=2,
                                  microbatches=4 // int(par.dp or 1), precision="fp64",
                                  seed=11, eval_interval=0)
        optim = OptimConfig(name=optimizer, lr=1e-2, min_lr=1e-3, warmup_steps=1,
                            weight_decay=0.1, clip_grad=0.05)
        model = tiny_model("llama", layers=2)
        if case.get("mla"):
            model = dataclasses.replace(model, arch="deepseek_v3", **MLA)  # type: ignore[arg-type]
        config = Config(model=model, parallel=par, training=training, optim=optim)
        config = resolved(config, par.tp * par.pp * par.cp * int(par.dp or 1))
    parallel = dataclasses.replace(config.parallel, bucket_size=1500)
    return dataclasses.replace(config, parallel=parallel)


def world_of(config: Config) -> int:
    """tp x pp x cp x dp."""
    par = config.parallel
    return par.tp * par.pp * par.cp * int(par.dp or 1)


def seeded(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float64 matrix drawn from a generator seeded by ``key``."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def local_matrix(param: torch.nn.Parameter, index: int | None, full: torch.Tensor,
                 coords: dict[str, tuple[int, int]]) -> torch.Tensor:
    """This rank's flattened local shard of the logical ``full`` (an expert's [A, B], or
    the parameter's [A, B])."""
    sharding = param.sharding  # type: ignore[attr-defined]
    if index is None:
        return sharding.shard(full, coords).reshape(-1)
    ep = coords.get("ep", (0, 1))[0]
    stacked = full.new_zeros(sharding.full_shape)
    stacked[ep * param.shape[0] + index] = full
    return sharding.shard(stacked, coords)[index].reshape(-1)


def seed_name(param: torch.nn.Parameter, index: int | None, ep_rank: int) -> str:
    """The seed of U: the key, an expert's with ``[global expert]``."""
    key = param.sharding.key  # type: ignore[attr-defined]
    return key if index is None else f"{key}[{ep_rank * param.shape[0] + index}]"


def u_pieces(ddp: Any, coords: dict[str, tuple[int, int]],
             expert_coords: dict[str, tuple[int, int]]) -> list[MuonPiece]:
    """This rank's pieces of every Muon matrix in buffer order, holding its slice of U."""
    buffers = ddp.buffers
    out = []
    for lo, hi in ddp.owned_ranges():
        for p, a, b in buffers.segments(lo, hi):
            found = muon_matrices(p)
            if found is None:
                continue
            start = buffers.slot(p).start
            where = expert_coords if found.stacked else coords
            for index, x, y, _ in split_matrices(p, a - start, b - start):
                full = seeded(seed_name(p, index, where.get("ep", (0, 1))[0]), found.shape)
                values = local_matrix(p, index, full, where)[x:y].clone()
                out.append(MuonPiece(p, index, x, y, values))
    return out


def cubic(full: torch.Tensor, name: str) -> torch.Tensor:
    """A non-linear function of the whole matrix that depends on its name: M M^T M c."""
    return full @ full.T @ full * (1 + zlib.crc32(name.encode()) % 7)


def expected_piece(piece: MuonPiece, coords: dict[str, tuple[int, int]],
                   expert_coords: dict[str, tuple[int, int]]) -> torch.Tensor:
    """The piece's slice of fn(U) computed on the whole logical matrix."""
    expert = piece.index is not None
    where = expert_coords if expert else coords
    seed = seed_name(piece.param, piece.index, where.get("ep", (0, 1))[0])
    shape = piece.param.sharding.full_shape  # type: ignore[attr-defined]
    full = seeded(seed, tuple(shape[1:] if expert else shape))
    return local_matrix(piece.param, piece.index, cubic(full, piece.param.sharding.key),  # type: ignore[attr-defined]
                        where)[piece.lo:piece.hi]
