"""A pool of CPU ranks (gloo) kept alive between calls: the parity tests and calibration.

Starting a rank is the expensive part (importing torch in 8 processes on 2 cores takes
seconds), so a :class:`RankPool` starts ``world_size`` spawned workers once, joins them into a
gloo default process group, and then runs any number of functions on them:

    pool = RankPool(4)
    sums = pool.run(all_reduce_fn, 3.0)   # one result per rank, in rank order
    pool.close()

Protocol (one duplex pipe per rank, every message a pickled tuple sent as bytes):
    parent -> rank: ("join",) | ("run", fn_ref, args_bytes) | ("end", ok) | ("stop",)
    rank -> parent: ("ready",) | ("joined",) | ("ok", result_bytes) | ("err", summary, traceback)
Before a run every rank joins a fresh gloo default group under a new store prefix ("join");
after it every rank gets ("end", ok): on success it passes a barrier; then each rank destroys
every process group (including groups the function made) and resets default dtype, grad mode
and the RNG seed. So every run starts like a fresh process, whatever the previous one left
behind, and an idle rank holds no group: gloo's transport thread wakes every 10 ms while a
group exists (~0.4% of a core per rank, ~100 wake-ups a second), and an idle rank blocked in
its pipe read uses no CPU at all. The join has the pool's own timeout, so a call's timeout
counts the function alone.

Failures: a rank exception becomes :class:`RankError` naming the rank with its remote
traceback. Ranks that do not answer within ``grace_s`` of the first failure are presumed stuck
in a collective; the pool is then killed and restarts on the next call. A call that exceeds its
timeout kills the pool and raises :class:`RankTimeout` naming the ranks that had not answered.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from colonnade.parallel.pool_rank import Reply, worker_main

_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class RankError(RuntimeError):
    """One or more ranks raised (or died); ``failures`` maps rank -> remote traceback."""

    def __init__(self, message: str, failures: dict[int, str], stuck: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.failures = failures
        self.stuck = list(stuck)


class LeakedGroupWarning(RuntimeWarning):
    """A run left process groups alive on some rank; the pool was restarted to drop them."""


class RankTimeout(RuntimeError):
    """A call ran past its timeout; ``missing`` lists the ranks that had not answered."""

    def __init__(self, message: str, missing: Sequence[int], timeout_s: float) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.timeout_s = timeout_s


# ----------------------------------------------------------------------------- parent side


@contextlib.contextmanager
def _single_thread_env() -> Iterator[None]:
    """Spawned ranks inherit OMP/MKL threads = 1 before anything in them imports torch."""
    saved = {key: os.environ.get(key) for key in _THREAD_ENV}
    os.environ.update({key: "1" for key in _THREAD_ENV})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _function_reference(fn: Callable[..., Any]) -> tuple[Any, ...]:
    """A module-level function travels by name (module, qualname, file); others are pickled."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(fn, types.FunctionType):
        qualname = fn.__qualname__
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(
                f"fn {fn.__module__}.{qualname} is a lambda or nested function, which ranks cannot "
                "import; define it at module level"
            )
        file = getattr(sys.modules.get(fn.__module__), "__file__", None)
        return ("ref", fn.__module__, qualname, file)
    try:
        return ("pickle", pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:
        raise TypeError(f"fn {fn!r} cannot be pickled for the ranks: {exc}") from exc


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class RankPool:
    """``world_size`` gloo CPU ranks kept alive across calls; restarts itself after a failure.

    Args:
        world_size: number of ranks (>= 1).
        timeout_s: default limit for one call, from sending the function to the last answer.
        grace_s: after the first rank failure, how long the other ranks may take to answer
            before they are presumed stuck in a collective and the pool is killed.
        start_timeout_s: limit for starting the ranks (importing torch, joining the group).
    """

    def __init__(
        self,
        world_size: int,
        timeout_s: float = 120.0,
        *,
        grace_s: float = 3.0,
        start_timeout_s: float = 300.0,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"RankPool world_size must be an int >= 1, got {world_size!r}")
        for name, value in (
            ("timeout_s", timeout_s),
            ("grace_s", grace_s),
            ("start_timeout_s", start_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"RankPool {name} must be > 0 seconds, got {value!r}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s)
        self.start_timeout_s = float(start_timeout_s)
        self.starts = 0  # how many times the ranks were (re)started
        self._procs: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._store: Any = None
        self._finalizer: multiprocessing.util.Finalize | None = None

    @property
    def alive(self) -> bool:
        """True while the ranks are started and usable."""
        return bool(self._procs)

    def start(self) -> None:
        """Start the ranks if they are not running (``run`` calls this for you)."""
        if self.alive:
            return
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        ctx = multiprocessing.get_context("spawn")
        with _single_thread_env():
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=worker_main,
                    args=(rank, self.world_size, self._store.port, child_end),
                    name=f"colonnade-rank{rank}-of-{self.world_size}",
                )
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
        # Runs on garbage collection, or at exit before multiprocessing joins its children.
        self._finalizer = multiprocessing.util.Finalize(
            self, _kill, args=(list(self._procs), list(self._conns)), exitpriority=10
        )
        self.starts += 1
        replies = self._collect(time.monotonic() + self.start_timeout_s)
        failed = {r: rep for r, rep in replies.items() if rep[0] != "ready"}
        missing = [r for r in range(self.world_size) if r not in replies]
        if failed or missing:
            self.kill()
            text = _failure_text(failed, f"starting {self.world_size} ranks") if failed else ""
            if missing:
                text += (
                    f"\nrank(s) {_ranks(missing)} did not start within "
                    f"{self.start_timeout_s:g} s (start_timeout_s)"
                )
            raise RankError(text.strip(), {r: rep[-1] for r, rep in failed.items()}, missing)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; returns the results in rank order."""
        return self.call(fn, args, kwargs)

    def call(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Like :meth:`run`, with explicit args/kwargs and an optional per-call timeout."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        fn_ref = _function_reference(fn)
        try:
            args_bytes = pickle.dumps((tuple(args), dict(kwargs or {})), pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(f"arguments for {_describe(fn)} cannot be pickled: {exc}") from exc
        self.start()
        self._join()
        try:
            self._broadcast(("run", fn_ref, args_bytes))
            replies = self._collect(time.monotonic() + timeout, grace_s=self.grace_s)
        except BaseException:  # e.g. Ctrl-C: the ranks' state is unknown, start afresh
            self.kill()
            raise
        failed = {r: rep for r, rep in replies.items() if rep[0] != "ok"}
        missing = [r for r in range(self.world_size) if r not in replies]
        what = f"running {_describe(fn)} on {self.world_size} ranks"
        if missing and not failed:
            self.kill()
            raise RankTimeout(
                f"{what} timed out after {timeout:g} s: rank(s) {_ranks(missing)} had not "
                f"answered (ranks {_ranks(sorted(replies))} had); the pool was killed and "
                "restarts on the next call",
                missing,
                timeout,
            )
        # Every rank answered: end the run. Otherwise some are stuck (or died): kill the pool.
        if missing:
            self.kill()
        else:
            self._finish(ok=not failed, what=what)
        if failed:
            text = _failure_text(failed, what)
            if missing:
                text += (
                    f"\nrank(s) {_ranks(missing)} did not answer within {self.grace_s:g} s of the "
                    "failure (blocked in a collective?); the pool was killed and restarts on "
                    "the next call"
                )
            raise RankError(text, {r: rep[-1] for r, rep in failed.items()}, missing)
        return [pickle.loads(replies[r][1]) for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks politely (kill any that do not exit within 5 s)."""
        if not self.alive:
            return
        with contextlib.suppress(OSError):
            self._broadcast(("stop",))
        for proc in self._procs:
            proc.join(timeout=5.0)
        self.kill()

    def kill(self) -> None:
        """Kill the ranks now; the next call starts fresh ones."""
        if self._finalizer is not None:
            self._finalizer()  # runs _kill once
        self._procs, self._conns, self._store, self._finalizer = [], [], None, None

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _broadcast(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError):  # a dead rank shows up in _collect
                conn.send_bytes(data)

    def _join(self) -> None:
        """Every rank joins a fresh default group (within the pool's timeout); kill on failure."""
        try:
            self._broadcast(("join",))
            replies = self._collect(time.monotonic() + self.timeout_s, grace_s=self.grace_s)
        except BaseException:
            self.kill()
            raise
        failed = {r: rep for r, rep in replies.items() if rep[0] != "joined"}
        missing = [r for r in range(self.world_size) if r not in replies]
        if failed or missing:
            self.kill()
            what = f"joining a gloo group of {self.world_size} ranks"
            text = _failure_text(failed, what) if failed else ""
            if missing:
                text += f"\nrank(s) {_ranks(missing)} did not join within {self.timeout_s:g} s"
            raise RankError(text.strip(), {r: rep[-1] for r, rep in failed.items()}, missing)

    def _finish(self, *, ok: bool, what: str) -> None:
        """End a run on every rank (barrier if ok, groups destroyed); kill the pool if that fails,
        or warn and kill it if a rank still has a live group afterwards."""
        if not all(proc.is_alive() for proc in self._procs):
            self.kill()
            return
        self._broadcast(("end", ok))
        replies = self._collect(time.monotonic() + self.timeout_s)
        bad = {r: rep for r, rep in replies.items() if rep[0] != "ready"}
        missing = [r for r in range(self.world_size) if r not in replies]
        if bad or missing:
            self.kill()
            if ok:
                text = _failure_text(bad, f"the barrier after {what}")
                if missing:
                    text += f"\nrank(s) {_ranks(missing)} never reached the barrier after {what}"
                raise RankError(text, {r: rep[-1] for r, rep in bad.items()}, missing)
            return
        leaked = {r: rep[1] for r, rep in replies.items() if rep[1]}
        if leaked:  # their threads would poll for the rest of the pool's life: start afresh
            self.kill()
            counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(leaked.items()))
            warnings.warn(
                f"{what} left gloo process groups alive after the run ({counts}): something "
                "still holds them (a global, a cache, a thread never stopped, a hook holding "
                "its owner), and each group's transport thread wakes every 10 ms for as long "
                "as it lives; the pool was killed and restarts on the next call",
                LeakedGroupWarning, stacklevel=3)

    def _collect(self, deadline: float, grace_s: float | None = None) -> dict[int, Reply]:
        """One reply per rank until ``deadline``; after a failure, only ``grace_s`` more."""
        waiting: dict[Any, int] = {}
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True)):
            waiting[conn] = rank
            waiting[proc.sentinel] = rank
        replies: dict[int, Reply] = {}
        while len(replies) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for ready in multiprocessing.connection.wait(list(waiting), remaining):
                rank = waiting[ready]
                if rank in replies:
                    continue
                replies[rank] = self._receive(rank)
                if replies[rank][0] == "err" and grace_s is not None:
                    deadline = min(deadline, time.monotonic() + grace_s)
            waiting = {obj: r for obj, r in waiting.items() if r not in replies}
        return replies

    def _receive(self, rank: int) -> Reply:
        """Read rank's reply, or describe its death when the pipe is closed."""
        conn, proc = self._conns[rank], self._procs[rank]
        try:
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        proc.join(timeout=1.0)
        summary = f"rank process died (exit code {proc.exitcode})"
        return ("err", summary, summary + "\n")


def _kill(procs: list[Any], conns: list[multiprocessing.connection.Connection]) -> None:
    """SIGKILL and reap the ranks (also registered to run at interpreter exit)."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5.0)
    for conn in conns:
        conn.close()


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks) or "none"


def _failure_text(failed: dict[int, Reply], what: str) -> str:
    """'rank 1 raised ValueError: boom' lines followed by each rank's remote traceback."""
    lines = [f"{len(failed)} rank(s) failed {what}:"]
    lines += [f"  rank {r}: {rep[1]}" for r, rep in sorted(failed.items())]
    by_traceback: dict[str, list[int]] = {}  # identical tracebacks are printed once
    for r, rep in sorted(failed.items()):
        by_traceback.setdefault(rep[-1].rstrip(), []).append(r)
    for text, ranks in by_traceback.items():
        lines.append(f"----- traceback of rank {_ranks(ranks)} -----\n{text}")
    return "\n".join(lines)


class RankPools:
    """One lazily started :class:`RankPool` per world size, for a whole pytest session.

    At most ``max_live_ranks`` rank processes stay alive; beyond that the least recently used
    pools are closed (each rank holds a torch import, ~200 MB).
    """

    def __init__(
        self, timeout_s: float = 120.0, *, max_world_size: int = 8, max_live_ranks: int = 24
    ) -> None:
        if max_live_ranks < max_world_size:
            raise ValueError(
                f"RankPools max_live_ranks={max_live_ranks} must be >= max_world_size="
                f"{max_world_size}, or the largest pool could never start"
            )
        self.timeout_s = timeout_s
        self.max_world_size = max_world_size
        self.max_live_ranks = max_live_ranks
        self._pools: dict[int, RankPool] = {}  # insertion order = least recently used first

    def get(self, world_size: int) -> RankPool:
        """The pool for ``world_size`` ranks (created on first use, started on first run)."""
        if not isinstance(world_size, int) or not 1 <= world_size <= self.max_world_size:
            raise ValueError(
                f"world_size must be an int in 1..{self.max_world_size}, got {world_size!r}"
            )
        pool = self._pools.pop(world_size, None) or RankPool(world_size, self.timeout_s)
        live = sum(p.world_size for p in self._pools.values() if p.alive)
        for other in list(self._pools.values()):
            if live + world_size <= self.max_live_ranks:
                break
            if other.alive:
                live -= other.world_size
                other.close()
        self._pools[world_size] = pool
        return pool

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on ``world_size`` ranks; results in rank order."""
        return self.get(world_size).run(fn, *args, **kwargs)

    def close(self) -> None:
        """Stop every pool."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def spawn_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0, **kwargs: Any
) -> list[Any]:
    """One-off: start ``world_size`` ranks, run ``fn(*args, **kwargs)`` on each, stop them.

    For scripts (benchmarks) outside pytest; ``fn`` must be importable by the ranks, and a
    script defining it needs an ``if __name__ == "__main__":`` guard (spawn re-imports it).
    """
    with RankPool(world_size, timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)
