"""The rank side of :mod:`colonnade.parallel.pool`: what each spawned rank process runs.

A rank imports torch (and dynamo, see :func:`worker_main`), connects to the parent's store, and
serves the parent's messages over its pipe (the protocol is in the pool's module docstring):
"join" makes a fresh gloo default group, "run" calls the function, "end" destroys every group
and resets process-wide torch state, "stop" exits. Between runs a rank holds no group, and it
reports how many gloo transports are still alive after "end" (:func:`live_transports`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import threading
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

FRESH_SEED = 0  # torch.manual_seed applied on every rank before each run
# Backstop for gloo collectives and the store; the parent enforces the real per-call timeouts
# (and kills stuck ranks) long before this, so a rank never answers with a gloo timeout first.
_GLOO_TIMEOUT_S = 3600.0
Reply = tuple[Any, ...]
"""One message between the parent and a rank (a tuple whose first item names it)."""
_GLOO_THREAD = "gloo_tcp_loop"  # the name of gloo's transport thread, one per live group


def _watch_parent() -> None:
    """Exit this rank as soon as the parent process dies (no orphans left blocked in gloo)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(3)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _import_by_name_or_file(module: str, file: str | None) -> types.ModuleType:
    """Import ``module`` as the parent did; fall back to its file (pytest importlib mode)."""
    if module in sys.modules:
        return sys.modules[module]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        if file is None:
            raise
    spec = importlib.util.spec_from_file_location(module, file)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"cannot import {module!r} from {file!r} on this rank")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def _resolve(fn_ref: tuple[Any, ...]) -> Callable[..., Any]:
    """Turn the parent's function reference back into the callable."""
    if fn_ref[0] == "pickle":
        return pickle.loads(fn_ref[1])
    _, module, qualname, file = fn_ref
    obj: Any = _import_by_name_or_file(module, file)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _init_group(store: Any, generation: int, rank: int, world_size: int) -> None:
    """Join a fresh gloo default group; ``generation`` keeps its store keys apart from old ones."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"colonnade-pool/{generation}", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=_GLOO_TIMEOUT_S),
    )


def _fresh_state() -> None:
    """Undo process-wide torch settings a run may have changed."""
    import torch

    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    torch.manual_seed(FRESH_SEED)


def thread_names(pid: int | str = "self") -> list[str]:
    """Names of a process's threads, sorted (Linux ``/proc``; empty elsewhere). A thread that
    ends while they are read is left out."""
    tasks = f"/proc/{pid}/task"
    names = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(tasks):
            with contextlib.suppress(OSError), open(f"{tasks}/{tid}/comm") as comm:
                names.append(comm.read().strip())
    return sorted(names)


def live_transports() -> int:
    """gloo transport threads still alive in this rank (Linux; 0 elsewhere). Each belongs to a
    process group some object still holds after ``destroy_process_group`` (a global, a cache,
    a thread that was never stopped); a cycle's is freed by a collection first."""
    if _GLOO_THREAD not in thread_names():
        return 0
    gc.collect()
    return thread_names().count(_GLOO_THREAD)


def _run_once(fn_ref: tuple[Any, ...], args_bytes: bytes) -> Reply:
    """Call the function; any exception (even a failure to pickle the result) becomes 'err'."""
    try:
        fn = _resolve(fn_ref)
        args, kwargs = pickle.loads(args_bytes)
        result = fn(*args, **kwargs)
        return ("ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as exc:  # report everything, the rank itself must survive
        return ("err", f"{type(exc).__name__}: {exc}", traceback.format_exc())


def worker_main(
    rank: int, world_size: int, port: int, conn: multiprocessing.connection.Connection
) -> None:
    """Body of one rank: join the group, then serve run/end/stop messages until told to stop.

    The rank's ``sys.path`` is the parent's (multiprocessing's spawn start method copies it), so
    a function the parent can import by name the rank can too; the library edits no path (the
    tests' conftest and the benchmark scripts put the repo root there themselves).
    """
    _watch_parent()

    def send(reply: Reply) -> None:
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))

    generation = 0
    try:
        import torch
        import torch._dynamo  # (see below)
        import torch.distributed as dist

        # dynamo, imported while a process group exists, keeps that group alive for good (its
        # gloo transport thread then wakes every 10 ms for the rest of the rank's life); the
        # functions run here import it at their first ``eager`` call, inside a run, so it is
        # imported now, before any group
        torch.set_num_threads(1)
        with contextlib.suppress(RuntimeError):  # only allowed before any inter-op work
            torch.set_num_interop_threads(1)
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=_GLOO_TIMEOUT_S)
        )
        _fresh_state()
    except BaseException as exc:
        send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    send(("ready",))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent closed the pipe
            return
        if message[0] == "stop":
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # skips the ~1 s interpreter teardown of torch
        if message[0] == "run":
            send(_run_once(message[1], message[2]))
            continue
        try:
            if message[0] == "join":
                generation += 1
                _init_group(store, generation, rank, world_size)
                send(("joined",))
                continue
            # ("end", ok); the function may have destroyed the group itself
            if dist.is_initialized():
                if message[1]:
                    dist.barrier()
                dist.destroy_process_group()
            _fresh_state()
            send(("ready", live_transports()))
        except BaseException as exc:
            send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
