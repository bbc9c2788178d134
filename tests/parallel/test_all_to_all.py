"""Expert groups and all-to-all on gloo ranks (4 and 8), checked number by number.

Each rank builds :class:`ProcessGroups` with the expert groups, checks them against
:class:`ParallelDims`' expert view, and runs on its ep group (n ranks, index i):
  equal splits     x_i [n m, 3]; row block j goes to rank j; out_i = [x_0 block i; ...]
  variable splits  s(i, j) = (i + 2 j) mod 3 rows from i to j (zeros included), output
                   splits exchanged first; then backward of L = sum_j <w_j, y_j> (float64):
                   dL/dx_i[r] = w_j[p] for the rank j and row p that row r of x_i lands in
  async            the equal-split exchange through a Handle
Bytes: payload B_in; wire what leaves the rank, (n-1)/n B_in for equal splits,
sum_{j != i} s(i, j) x row bytes for variable ones; the split exchange 8 (n-1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from colonnade.parallel.all_to_all import all_to_all, all_to_all_rows, exchange_splits
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups

COLS, M = 3, 2  # columns per row; rows per block with equal splits
ROW_BYTES = COLS * 8  # float64
LAYOUTS: list[tuple[int, dict[str, int]]] = [
    (4, dict(tp=2, dp=2, ep=2, etp=1)),  # ep groups = tp groups: shares their pg
    (8, dict(tp=2, dp=4, ep=4, etp=1)),  # ep spans half a stage, edp 2
    (8, dict(tp=2, dp=2, pp=2, ep=2)),  # etp = tp; ep groups [0, 2], [1, 3], ...
]


def _splits(i: int, n: int) -> list[int]:
    """Rows rank i sends to each rank j of an n-rank group."""
    return [(i + 2 * j) % 3 for j in range(n)]


def _rows(rank: int, count: int) -> torch.Tensor:
    """[count, 3] float64 rows naming their sender: 1000 rank + 10 row + column."""
    r = torch.arange(count, dtype=torch.float64).unsqueeze(1)
    c = torch.arange(COLS, dtype=torch.float64).unsqueeze(0)
    return 1000.0 * rank + 10.0 * r + c


def _weights(i: int, count: int) -> torch.Tensor:
    """[count, 3] dyadic weights of rank i's output rows (exact in float64)."""
    r = torch.arange(count, dtype=torch.float64).unsqueeze(1)
    c = torch.arange(COLS, dtype=torch.float64).unsqueeze(0)
    return 0.5 * (i + 1) + 0.25 * r + 0.125 * c


# ----------------------------------------------------------------------------- rank function


def _exchange(layout: dict[str, int]) -> dict[str, Any]:
    dims = ParallelDims(**layout)
    groups = ProcessGroups.build(dims, timeout_s=60.0, experts=True)
    assert groups.ep is not None and groups.expert_tp is not None
    assert groups.expert_dp is not None
    rank, g = dist.get_rank(), groups.ep
    n, i = g.size, g.rank
    out: dict[str, Any] = {"ep": g.ranks, "expert_tp": groups.expert_tp.ranks,
                           "expert_dp": groups.expert_dp.ranks}
    total = torch.tensor([float(rank)], dtype=torch.float64)
    groups.expert_dp.all_reduce(total, name="edp_sum")
    out["edp_sum"] = float(total)
    # equal splits, blocking and async
    x = _rows(rank, n * M)  # [n m, 3]
    out["equal"] = all_to_all_rows(x, g, name="equal").tolist()
    recv = torch.empty_like(x)
    handle = g.all_to_all(recv, x, name="async", async_op=True)
    assert handle is not None
    handle.wait()
    out["async"] = recv.tolist()
    # variable splits, differentiable, output splits exchanged first
    send = _splits(i, n)
    xv = _rows(rank, sum(send)).requires_grad_()  # [t_in, 3]
    y = all_to_all(xv, g, in_splits=send, name="var")  # [t_out, 3]
    (y * _weights(i, y.shape[0])).sum().backward()
    assert xv.grad is not None
    out["var"], out["grad"] = y.detach().tolist(), xv.grad.tolist()
    out["out_splits"] = exchange_splits(send, g, name="check")
    out["stats"] = groups.stats.snapshot()
    return out


# ----------------------------------------------------------------------------- expectations


def _expected(group: list[int]) -> dict[int, dict[str, Any]]:
    """Per global rank of ``group``: equal-split output, variable output, gradient."""
    n = len(group)
    sends = [_splits(i, n) for i in range(n)]  # sends[i][j]: rows from i to j
    x = [_rows(group[i], sum(sends[i])) for i in range(n)]
    out: dict[int, dict[str, Any]] = {}
    for i in range(n):
        equal = torch.cat([_rows(group[j], n * M)[i * M:(i + 1) * M] for j in range(n)])
        blocks = [x[s][sum(sends[s][:i]):sum(sends[s][:i + 1])] for s in range(n)]
        grad = torch.empty(sum(sends[i]), COLS, dtype=torch.float64)
        for r in range(sum(sends[i])):
            j = _dest_of(sends[i], r)
            p = sum(sends[s][j] for s in range(i)) + r - sum(sends[i][:j])  # row on rank j
            grad[r] = _weights(j, sum(sends[s][j] for s in range(n)))[p]
        out[group[i]] = {"equal": equal.tolist(), "var": torch.cat(blocks).tolist(),
                         "grad": grad.tolist(), "out_splits": [sends[s][i] for s in range(n)],
                         "sends": sends[i]}
    return out


def _dest_of(send: list[int], r: int) -> int:
    """The receiver of row ``r`` of a sender whose blocks are ``send``."""
    edge = 0
    for j, count in enumerate(send):
        edge += count
        if r < edge:
            return j
    raise AssertionError("row past the end")


@pytest.mark.parametrize(("world", "layout"), LAYOUTS, ids=[f"{w}-{d}" for w, d in LAYOUTS])
def test_expert_groups_and_all_to_all(run_ranks: Callable[..., list[Any]], world: int,
                                      layout: dict[str, int]) -> None:
    dims = ParallelDims(**layout)
    assert dims.world_size == world
    results = run_ranks(world, _exchange, layout)
    for rank, res in enumerate(results):
        assert res["ep"] == dims.group_of(rank, "ep")
        assert res["expert_tp"] == dims.group_of(rank, "etp")
        assert res["expert_dp"] == dims.group_of(rank, "edp")
        assert res["edp_sum"] == float(sum(dims.group_of(rank, "edp")))
    for group in dims.group_ranks("ep"):
        n, want = len(group), _expected(group)
        for i, rank in enumerate(group):
            res, exp = results[rank], want[rank]
            assert res["equal"] == exp["equal"] and res["async"] == exp["equal"]
            assert res["var"] == exp["var"]
            assert res["grad"] == exp["grad"]
            assert res["out_splits"] == exp["out_splits"]
            _check_bytes(res["stats"], n, i, exp["sends"], exp["out_splits"])


def _check_bytes(stats: dict[str, dict[str, float]], n: int, i: int, sends: list[int],
                 recvs: list[int]) -> None:
    """Payload and wire bytes of every all-to-all against the formulas."""
    eq = n * M * ROW_BYTES
    for name in ("equal", "async"):
        entry = stats[f"ep/all_to_all/{name}"]
        assert entry["calls"] == 1 and entry["payload_bytes"] == eq
        assert entry["wire_bytes"] == (n - 1) / n * eq
    var = stats["ep/all_to_all/var"]
    assert var["payload_bytes"] == sum(sends) * ROW_BYTES
    assert var["wire_bytes"] == (sum(sends) - sends[i]) * ROW_BYTES  # what leaves the rank
    grad = stats["ep/all_to_all/var_grad"]  # backward: splits swapped
    assert grad["payload_bytes"] == sum(recvs) * ROW_BYTES
    assert grad["wire_bytes"] == (sum(recvs) - recvs[i]) * ROW_BYTES
    for name in ("var_splits", "check"):
        entry = stats[f"ep/all_to_all/{name}"]
        assert (entry["payload_bytes"], entry["wire_bytes"]) == (8 * n, 8 * (n - 1))


def test_single_rank_all_to_all_is_identity() -> None:
    groups = ProcessGroups.single()
    assert groups.ep is not None
    x = _rows(0, 4).requires_grad_()
    assert all_to_all(x, groups.ep, in_splits=[4]) is x
    out = torch.empty_like(x)
    groups.ep.all_to_all(out, x.detach())
    assert torch.equal(out, x.detach()) and groups.stats.snapshot() == {}
    with pytest.raises(ValueError, match="rows must divide evenly"):
        all_to_all_rows(_rows(0, 3), _FakeGroup(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give both in_splits and out_splits"):
        all_to_all_rows(_rows(0, 4), groups.ep, in_splits=[4])


class _FakeGroup:
    """Only what the argument checks read."""

    def __init__(self, size: int) -> None:
        self.size, self.name = size, "fake"
