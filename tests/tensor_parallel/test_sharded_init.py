"""Initialisation builds only the local shard, with the same global values in every layout.

* Layout independence: for column (dim 0), row (dim 1), padded-vocab and replicated
  parameters, the shards of tp 1..4 concatenate to the same full value (bit for bit), with
  blocks small enough that shard boundaries fall inside blocks; padding rows are zeros.
* Memory: a GPT-3 1.3B-shaped model (hidden 2048, 16 heads, vocab 50257, context 2048; one
  layer to keep it fast) built at tp 2 in bf16 in a fresh process raises the peak RSS by about
  its local parameters, not by the full float64 tensors (before: +984 MiB for 202 MiB of
  parameters with two layers; the full float64 embedding alone is 786 MiB).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colonnade.tensor_parallel import sharding as sh
from colonnade.tensor_parallel.sharding import (
    Sharding,
    init_full,
    init_shard,
    make_param,
    tp_coords,
)

REPO = Path(__file__).resolve().parents[2]
CASES = {
    "column": Sharding("l.q.weight", (12, 5), dim=0),
    "row": Sharding("l.o.weight", (5, 12), dim=1),
    "vocab": Sharding("emb.weight", (11, 6), dim=0),  # padded per tp below
    "replicated": Sharding("pos.weight", (9, 4)),
}


def _padded(spec: Sharding, tp: int) -> Sharding:
    pad = -spec.full_shape[0] % tp if spec.dim == 0 and spec.full_shape[0] % tp else 0
    return Sharding(spec.key, spec.full_shape, spec.dim, pad)


@pytest.mark.parametrize("name", list(CASES))
def test_shards_of_every_tp_make_the_same_full_value(monkeypatch: pytest.MonkeyPatch,
                                                     name: str) -> None:
    monkeypatch.setattr(sh, "BLOCK_ELEMENTS", 7)  # blocks of 1-2 indices: boundaries inside
    base = CASES[name]
    full = init_full(base, seed=5, std=0.5, dtype=torch.float64)
    assert full.shape == base.full_shape and full.std() > 0.2
    for tp in (1, 2, 3, 4):
        spec = _padded(base, tp)
        if spec.dim is not None and (spec.full_shape[spec.dim] + spec.padded_rows) % tp:
            continue
        shards = [init_shard(spec, tp_coords(r, tp), 5, 0.5, dtype=torch.float64)
                  for r in range(tp)]
        torch.testing.assert_close(spec.unshard(shards), full, rtol=0, atol=0)
        if spec.padded_rows:
            assert shards[-1][-spec.padded_rows:].abs().sum() == 0  # zero padding rows
        for r in range(tp):  # the parameter (any dtype) is the cast shard
            p = make_param(spec, tp_coords(r, tp), 5, 0.5, dtype=torch.bfloat16)
            torch.testing.assert_close(p.data, shards[r].to(torch.bfloat16), rtol=0, atol=0)


def test_block_tiling_depends_on_the_full_shape_only() -> None:
    spec = Sharding("mlp.fc.weight", (8192, 2048), dim=0)
    assert sh.block_len(spec) == (1 << 18) // 2048
    assert sh.block_len(Sharding("mlp.proj.weight", (2048, 8192), dim=1)) == (1 << 18) // 2048
    one = tp_coords(0, 1)
    assert init_shard(Sharding("n.weight", (4,)), one, 1, 0.0, "ones").tolist() == [1.0] * 4
    with pytest.raises(ValueError, match="unknown init kind 'uniform'"):
        init_shard(Sharding("n.weight", (4,)), one, 1, 0.0, "uniform")


_BUILD = """
import json, math
from colonnade.config.load import load_config
from colonnade.models.build import build_chunks
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups

cfg = load_config("configs/gpt3-1.3b.toml", ["--model.num_layers=1", "--parallel.tp=2"])
stats = CommStats()
def group(name, ranks):  # tp rank 0 of 2, nothing communicates while building
    return CommGroup(name, ranks, None, stats, 0)
one = [group(n, [0]) for n in ("pp", "dp", "cp", "dp_cp", "embedding")]
groups = ProcessGroups(ParallelDims(tp=2), 0, group("tp", [0, 1]), *one[:4],
                       one[4], group("world", [0, 1]), stats)
def status_kib(field):  # VmRSS: resident now; VmHWM: peak since the reset below
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:  # reset the peak: imports' pages (file-backed
    f.write("5")                               # ones may be reclaimed later) do not count
before = status_kib("VmRSS") * 1024
chunks = build_chunks(cfg, groups)
peak = status_kib("VmHWM") * 1024
local = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
full = 2 * sum(math.prod(p.sharding.full_shape) for c in chunks for p in c.parameters())
print(json.dumps({"delta": peak - before, "local": local, "full": full}))
"""


def test_tp2_gpt3_1p3b_shaped_build_allocates_about_the_local_shard() -> None:
    out = subprocess.run([sys.executable, "-c", _BUILD], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={"OMP_NUM_THREADS": "1",
                                                      "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert 150 * mib < m["local"] < 0.6 * m["full"]  # about half of the bf16 model is local
    assert m["delta"] < 1.2 * m["local"] + 48 * mib, {k: v / mib for k, v in m.items()}
    assert m["delta"] > 0.9 * m["local"]  # the measurement sees the parameters themselves
