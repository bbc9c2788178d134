"""CommGroup byte/call/time accounting and ProcessGroups membership on gloo ranks.

Wire bytes per rank follow the ring algorithms: all-reduce 2(n-1)/n B, all-gather (n-1)/n B_out,
reduce-scatter (n-1)/n B_in, broadcast and send B. Size-1 groups communicate and count nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from colonnade.parallel.comm import CommError, CommGroup, CommStats
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import ProcessGroups

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`

# ----------------------------------------------------------------------------- rank functions


def _accounting() -> dict[str, Any]:
    """Every operation once on a 2-rank pp group; returns values and the stats snapshot."""
    groups = ProcessGroups.build(ParallelDims(pp=2))
    g, r = groups.pp, groups.rank
    x = torch.full((10,), float(r + 1), dtype=torch.float32)  # 40 bytes
    g.all_reduce(x, name="sum")
    gathered = torch.empty(2, 3, dtype=torch.float64)  # 48 bytes out, 24 in
    g.all_gather_into(gathered, torch.full((1, 3), float(r), dtype=torch.float64), name="ag")
    scattered = torch.empty(2, dtype=torch.float32)
    g.reduce_scatter_into(scattered, torch.arange(4, dtype=torch.float32) + r, name="rs")
    b = torch.full((5,), float(r), dtype=torch.int64)  # 40 bytes
    g.broadcast(b, src=1, name="bc")
    send = torch.full((6,), float(r), dtype=torch.float32)  # 24 bytes
    recv = torch.empty(6, dtype=torch.float32)
    peer = groups.pp_peer(r + 1)
    g.p2p([(send, peer)], [(recv, peer)], name="swap").wait()
    m = torch.tensor([float(r)])
    g.all_reduce(m, op=dist.ReduceOp.MAX, name="max")
    # size-1 groups: no communication, nothing counted
    y = torch.ones(4)
    groups.tp.all_reduce(y)
    out = torch.empty(4)
    groups.dp.all_gather_into(out, y)
    handle = groups.cp.all_reduce(y, async_op=True)
    assert handle is not None and handle.done
    handle.wait()
    return {"x": x, "gathered": gathered, "scattered": scattered, "b": b, "recv": recv,
            "max": m, "y": y, "stats": groups.stats.snapshot(),
            "tp_calls": groups.stats.total("tp/", "calls")}


class _ManualMark:
    """A reading of :class:`_ManualClock`."""

    def __init__(self, t: float) -> None:
        self.t = t

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def seconds_since(self, earlier: Any) -> float:
        return self.t - earlier.t


class _ManualClock:
    """A host-blocking clock (gloo's kind) whose time moves only when the rank says so: ``now``
    is advanced by the rank (time it spends outside communication), and ``stretch`` makes the
    next operation last that long (its first mark at ``now``, every later one after it)."""

    host_blocking = True

    def __init__(self) -> None:
        self.now, self.stretch = 0.0, 0.0

    def mark(self) -> _ManualMark:
        mark = _ManualMark(self.now)
        self.now, self.stretch = self.now + self.stretch, 0.0
        return mark


def _async_exposed(compute_s: float, late_s: float, key: str) -> dict[str, Any]:
    """Rank 1 joins an async all-reduce after rank 0 posted it; rank 0 overlaps it with
    "compute", then waits; then rank 0 makes a blocking call that waits ``late_s`` for rank 1.

    Real gloo operations, timed by a :class:`_ManualClock` on the dp group, so every time the
    stats report is a sum of the durations given here, whatever the scheduler does: rank 0
    computes ``compute_s`` between posting and waiting (and, ordered by store keys, only after
    rank 1's wait returned: the collective is complete when rank 0 waits, the case the
    exposed time must report as ~0); its blocking call lasts ``late_s``.
    """
    groups = ProcessGroups.build(ParallelDims(dp=2))
    store = dist.distributed_c10d._get_default_store()
    g = groups.dp
    clock = _ManualClock()
    g.clock = clock
    t = torch.full((1000,), float(groups.rank + 1))
    if groups.rank == 1:
        store.wait([f"{key}/posted0"])
    handle = g.all_reduce(t, name="grads", async_op=True)
    assert handle is not None
    if groups.rank == 0:
        store.set(f"{key}/posted0", "1")
        store.wait([f"{key}/done1"])  # "compute" that hides the collective
        clock.now += compute_s
    handle.wait()
    handle.wait()  # idempotent: counted once
    entry = groups.stats.ops["dp/all_reduce/grads"]
    if groups.rank == 1:
        store.set(f"{key}/done1", "1")
    else:
        clock.stretch = late_s  # rank 0 waits this long in the call for the late rank 1
    s = torch.ones(3)
    g.all_reduce(s, name="blocking")  # a blocking call on a late peer: all of it exposed
    blocking = groups.stats.ops["dp/all_reduce/blocking"]
    return {"t0": float(t[0]), "s0": float(s[0]), "calls": entry.calls,
            "waited": entry.waited_s, "in_flight": entry.in_flight_s,
            "b_waited": blocking.waited_s, "b_in_flight": blocking.in_flight_s,
            "exposed_total": groups.stats.total("dp/", "waited_s")}


def _error_names_group() -> str:
    groups = ProcessGroups.build(ParallelDims(tp=2))
    out = torch.empty(3)  # wrong: needs 2 x 2 elements
    try:
        groups.tp.all_gather_into(out, torch.ones(2), name="bad")
    except CommError as err:
        return str(err)
    return "no error"


def _membership(order: str) -> dict[str, Any]:
    dims = ParallelDims(tp=2, pp=2, order=tuple(order.split("-")))
    groups = ProcessGroups.build(dims)
    out: dict[str, Any] = {name: getattr(groups, name).ranks for name in
                           ("tp", "pp", "dp", "cp", "dp_cp", "embedding", "world")}
    out["index"] = {name: getattr(groups, name).rank for name in ("tp", "pp", "world")}
    value = torch.tensor([float(dist.get_rank())])
    groups.tp.all_reduce(value)
    out["tp_sum"] = float(value)
    out["first"], out["last"] = groups.is_first_stage, groups.is_last_stage
    return out


# ----------------------------------------------------------------------------- tests


def test_byte_accounting_two_ranks(run_ranks: Callable[..., list[Any]]) -> None:
    results = run_ranks(2, _accounting)
    for r, res in enumerate(results):
        torch.testing.assert_close(res["x"], torch.full((10,), 3.0))
        torch.testing.assert_close(res["gathered"], torch.tensor([[0.0] * 3, [1.0] * 3],
                                                                 dtype=torch.float64))
        # sum of [0,1,2,3] and [1,2,3,4] = [1,3,5,7]; rank r keeps slice r
        torch.testing.assert_close(res["scattered"], torch.tensor([1.0, 3.0] if r == 0
                                                                  else [5.0, 7.0]))
        torch.testing.assert_close(res["b"], torch.full((5,), 1, dtype=torch.int64))
        torch.testing.assert_close(res["recv"], torch.full((6,), float(1 - r)))
        assert float(res["max"]) == 1.0
        torch.testing.assert_close(res["y"], torch.ones(4))
        assert res["tp_calls"] == 0.0
        stats = res["stats"]
        expected = {  # key: (calls, payload, wire)
            "pp/all_reduce/sum": (1, 40, 2 * 1 / 2 * 40),
            "pp/all_gather/ag": (1, 24, 1 / 2 * 48),
            "pp/reduce_scatter/rs": (1, 16, 1 / 2 * 16),
            "pp/broadcast/bc": (1, 40, 40),
            "pp/p2p/swap": (1, 24, 24),
            "pp/all_reduce/max": (1, 4, 4),
        }
        assert set(stats) == set(expected), sorted(stats)
        for key, (calls, payload, wire) in expected.items():
            assert stats[key]["calls"] == calls, key
            assert stats[key]["payload_bytes"] == payload, key
            assert stats[key]["wire_bytes"] == pytest.approx(wire), key
            assert 0.0 <= stats[key]["waited_s"] <= stats[key]["in_flight_s"] + 1e-9, key


def test_async_handle_exposed_time(run_ranks: Callable[..., list[Any]]) -> None:
    """Exact times on a manual clock (see :func:`_async_exposed`), each failing a wrong
    accounting: rank 0's async op was in flight for its compute and exposed for none of it
    (waited after it was done), counted once though waited twice; its blocking call was
    exposed for all of its time; rank 1 posted and waited at once, its clock never moved."""
    compute, late = 0.375, 0.25  # binary fractions: the sums below are exact
    r0, r1 = run_ranks(2, _async_exposed, compute, late, f"exposed-{time.monotonic_ns()}")
    for res in (r0, r1):
        assert res["t0"] == 3.0 and res["s0"] == 2.0
        assert res["calls"] == 1
        assert res["exposed_total"] == res["waited"] + res["b_waited"]
    # rank 0 posted first and computed until rank 1 was done: hidden behind its "compute"
    assert (r0["in_flight"], r0["waited"]) == (compute, 0.0)
    # rank 0 waits for the late rank 1 in the blocking call: all of it exposed
    assert (r0["b_in_flight"], r0["b_waited"]) == (late, late)
    assert (r1["in_flight"], r1["waited"], r1["b_in_flight"], r1["b_waited"]) == (0.0,) * 4


def test_backend_error_names_group_and_op(run_ranks: Callable[..., list[Any]]) -> None:
    for text in run_ranks(2, _error_names_group):
        assert "all_gather(bad) on group 'tp' (ranks [0, 1]" in text, text


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "pp-tp-dp-cp"])
def test_groups_match_dims(run_ranks: Callable[..., list[Any]], order: str) -> None:
    dims = ParallelDims(tp=2, pp=2, order=tuple(order.split("-")))
    results = run_ranks(4, _membership, order)
    for rank, res in enumerate(results):
        assert res["tp"] == dims.group_of(rank, "tp")
        assert res["pp"] == dims.group_of(rank, "pp")
        assert res["dp"] == [rank] and res["cp"] == [rank] and res["dp_cp"] == [rank]
        assert res["embedding"] == res["pp"]  # first and last stage of a 2-stage pipeline
        assert res["world"] == [0, 1, 2, 3]
        coords = dims.coords(rank)
        assert res["index"] == {"tp": coords["tp"], "pp": coords["pp"], "world": rank}
        assert res["tp_sum"] == float(sum(dims.group_of(rank, "tp")))
        assert (res["first"], res["last"]) == (coords["pp"] == 0, coords["pp"] == 1)


def test_single_groups_count_nothing() -> None:
    groups = ProcessGroups.single()
    t = torch.arange(4.0)
    groups.dp.all_reduce(t)
    out = torch.empty(4)
    groups.tp.reduce_scatter_into(out, t)
    groups.pp.broadcast(t)
    groups.world.barrier()
    torch.testing.assert_close(out, torch.arange(4.0))
    assert groups.stats.snapshot() == {}
    assert isinstance(groups.stats, CommStats)
    with pytest.raises(ValueError, match="world of size 1"):
        ProcessGroups.single(ParallelDims(tp=2))


# ----------------------------------------------------------------------------- NCCL semantics


class _FakeMark:
    """A CUDA event stand-in: reached (with a GPU time) only when the test says so."""

    def __init__(self) -> None:
        self.t: float | None = None

    def done(self) -> bool:
        return self.t is not None

    def wait(self) -> None:  # a real event would block; the test reaches it beforehand
        assert self.t is not None, "waited on an event the fake GPU never reached"

    def seconds_since(self, earlier: Any) -> float:
        assert self.t is not None and earlier.t is not None
        return self.t - earlier.t


class _FakeClock:
    """Marks of a stream-ordered backend (what EventClock gives under NCCL)."""

    host_blocking = False

    def __init__(self) -> None:
        self.marks: list[_FakeMark] = []

    def mark(self) -> _FakeMark:
        self.marks.append(_FakeMark())
        return self.marks[-1]


class _StreamOrderedWork:
    """NCCL's Work as the host sees it: wait() returns at once, completion comes later."""

    def __init__(self) -> None:
        self.completed = False
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1

    def is_completed(self) -> bool:
        return self.completed


def _fake_group(monkeypatch: pytest.MonkeyPatch, clock: Any,
                work: _StreamOrderedWork) -> CommGroup:
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: work if k.get("async_op") else None)
    return CommGroup("dp", [0, 1], object(), CommStats(), 0, clock=clock)


def test_stream_ordered_wait_does_not_finish_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL wait() only orders streams: the op stays pending (what the hang detector
    reports) and untimed until its end event and its work complete; then exposed time is the
    compute stream's stall (end - wait) and in-flight time end - post, from the events."""
    clock, work = _FakeClock(), _StreamOrderedWork()
    group = _fake_group(monkeypatch, clock, work)
    stats = group.stats
    progress0 = stats.last_progress
    handle = group.all_reduce(torch.ones(4), name="grads", async_op=True)
    assert handle is not None
    handle.wait()
    assert work.waits == 1 and handle.done and not handle.is_completed()
    posted, waited, ended = clock.marks
    assert [r.op for r in stats.pending()] == ["all_reduce(grads)"]
    assert stats.pending()[0].waited is not None  # the caller needs it: overdue can fire
    assert stats.progressed_at() == progress0  # no completion seen yet
    entry = stats.ops["dp/all_reduce/grads"]
    assert (entry.calls, entry.waited_s, entry.in_flight_s) == (1, 0.0, 0.0)
    posted.t, waited.t, ended.t = 10.0, 10.5, 12.0  # GPU: the op ended 1.5 s after the wait
    assert [r.op for r in stats.pending()] == ["all_reduce(grads)"]  # the work is not done
    work.completed = True
    assert stats.pending() == [] and stats.progressed_at() > progress0
    assert entry.waited_s == pytest.approx(1.5) and entry.in_flight_s == pytest.approx(2.0)
    snap = stats.snapshot()["dp/all_reduce/grads"]
    assert snap["waited_s"] == pytest.approx(1.5) and snap["calls"] == 1
    # a blocking call is pending until its end event is reached, all of it exposed
    group.all_reduce(torch.ones(2), name="sync")
    start, end = clock.marks[3:]
    assert [r.op for r in stats.pending()] == ["all_reduce(sync)"]
    start.t, end.t = 20.0, 20.25
    stats.settle()
    sync = stats.ops["dp/all_reduce/sync"]
    assert stats.pending() == [] and sync.waited_s == sync.in_flight_s == pytest.approx(0.25)


def test_host_blocking_wait_finishes_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo (wall clock): wait() blocks until the data is there, so the op is done when it
    returns, whatever is_completed says; the times are the host's. The sleep only makes an
    interval that a stall can lengthen, never shorten: the wait begins >= 0.05 s after the
    post, so in flight >= 0.05 s > waited holds for every interleaving."""
    from colonnade.parallel.comm_stats import WallClock

    work = _StreamOrderedWork()
    group = _fake_group(monkeypatch, WallClock(), work)
    handle = group.all_reduce(torch.ones(4), name="grads", async_op=True)
    assert handle is not None
    time.sleep(0.05)
    handle.wait()
    assert group.stats.pending() == []
    entry = group.stats.ops["dp/all_reduce/grads"]
    assert entry.in_flight_s >= 0.05 and entry.waited_s < entry.in_flight_s


def test_clock_for_is_the_one_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from colonnade.parallel.comm_stats import EventClock, WallClock, clock_for

    assert isinstance(clock_for(None), WallClock)
    monkeypatch.setattr(dist, "get_backend", lambda pg: pg)
    assert isinstance(clock_for("gloo"), WallClock) and clock_for("gloo").host_blocking
    assert isinstance(clock_for("nccl"), EventClock) and not clock_for("nccl").host_blocking
    group = CommGroup("tp", [0, 1], "nccl", CommStats(), 0)
    assert isinstance(group.clock, EventClock)


def test_p2p_batches_only_on_a_coalescing_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL: one ``batch_isend_irecv`` (one group, started and completed together); gloo:
    ``isend`` / ``irecv`` posted directly in the same order (what ``batch_isend_irecv`` does
    there, without its per-operation wrapping); the handle waits for every work either way."""
    from colonnade.parallel.comm import coalesces
    from colonnade.parallel.comm_stats import WallClock

    calls: list[tuple[str, ...]] = []

    class Work:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait(self) -> None:
            calls.append(("wait", self.name))

        def is_completed(self) -> bool:
            return True

    def isend(t: torch.Tensor, dst: int, group: Any = None) -> Work:
        calls.append(("isend", str(dst)))
        return Work(f"send{dst}")

    def irecv(t: torch.Tensor, src: int, group: Any = None) -> Work:
        calls.append(("irecv", str(src)))
        return Work(f"recv{src}")

    def batch(ops: list[Any]) -> list[Work]:
        calls.append(("batch", *(f"{op.op.__name__}{op.peer}" for op in ops)))
        return [Work("batched")]

    monkeypatch.setattr(dist, "get_backend", lambda pg: pg)
    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "irecv", irecv)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(dist, "P2POp", lambda op, t, peer, group=None: type(
        "Op", (), {"op": op, "peer": peer})())
    assert not coalesces(None) and not coalesces("gloo")
    assert coalesces("nccl") and coalesces("cpu:gloo,cuda:nccl")
    x, y = torch.ones(2), torch.empty(2)
    for backend, want in [
        ("gloo", [("isend", "1"), ("isend", "2"), ("irecv", "1"), ("wait", "send1"),
                  ("wait", "send2"), ("wait", "recv1")]),
        ("nccl", [("batch", "isend1", "isend2", "irecv1"), ("wait", "batched")]),
    ]:
        calls.clear()
        group = CommGroup("pp", [0, 1, 2], backend, CommStats(), 0, clock=WallClock())
        group.p2p([(x, 1), (x, 2)], [(y, 1)], name="swap").wait()
        assert calls == want, backend


@pytest.mark.gpu
def test_nccl_timing_from_events_on_a_gpu(tmp_path: Any) -> None:
    """On a real NCCL group (one rank: the ranks list is only a label here) an async all-reduce
    queued behind ~0.2 s of GPU work: wait() returns at once, the op stays pending until the
    GPU gets there, and its times are the GPU's (events), not the queued compute nor ~0."""
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
    from colonnade.parallel.comm_stats import EventClock

    group = CommGroup("dp", [0, 1], dist.group.WORLD, CommStats(), 0)
    assert isinstance(group.clock, EventClock)
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(20):
        a = a @ a / 8192**0.5  # queued compute ahead of the collective
    t = torch.ones(1 << 20, device="cuda")
    handle = group.all_reduce(t, name="grads", async_op=True)
    assert handle is not None
    handle.wait()
    host_s = time.perf_counter() - begin
    assert [r.op for r in group.stats.pending()] == ["all_reduce(grads)"]
    torch.cuda.synchronize()
    gpu_s = time.perf_counter() - begin
    assert gpu_s > 5 * host_s  # the host ran ahead: wait() did not block
    entry = group.stats.snapshot()["dp/all_reduce/grads"]
    assert group.stats.pending() == []
    assert 0.0 <= entry["waited_s"] <= entry["in_flight_s"] + 1e-6
    assert 0.0 < entry["in_flight_s"] < 0.5 * gpu_s
    dist.destroy_process_group()
