"""Starting the ranks through torch's elastic launcher (the engine behind torchrun).

``colonnade train --nproc N [--nnodes K --node-rank I --rdzv-endpoint HOST:PORT]
[--max-restarts R]`` calls :func:`launch`, which runs :func:`run_rank` in N local worker
processes with the usual RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR environment.
``torchrun ... -m colonnade.train`` reaches the same :func:`run_rank` directly.

* One node: a private c10d rendezvous on a free local port (torchrun's ``--standalone``).
* Several nodes: a static rendezvous at ``--rdzv-endpoint`` (node 0's address); each node runs
  one launcher with its ``--node-rank``; global rank = node_rank * nproc + local rank.
* Ctrl-C / SIGTERM: the agent forwards the signal; the ranks finish the step, save and return
  (:mod:`colonnade.reliability.interrupt`); the launcher prints one line and exits 130 / 143.
* Bad input found inside the ranks (data, checkpoint): one line, exit status 2.
* Failure: when a rank dies or raises, the agent stops the others (SIGTERM, then SIGKILL after
  30 s); each rank records what it was doing (:mod:`colonnade.reliability`), and the launcher
  prints a report naming the rank that failed first, how, and in which collective, and exits 1.
* Hangs: each rank's watchdog reports a rank with no progress for the hang limit (0.8 x
  ``parallel.timeout_s`` by default, :func:`~colonnade.reliability.monitor.watchdog_seconds`),
  before the collective timeout ends it; the launcher's :class:`~colonnade.reliability.watch.
  HeartbeatWatch` records and SIGKILLs a rank frozen as a whole (stale heartbeat), so the job
  is gone within about ``parallel.timeout_s``, and the report tells the hang from a death.
* NCCL: the launcher exports torch's own failure handling to its ranks
  (:func:`~colonnade.reliability.startup.torch_nccl_env`: async error handling, flight recorder
  dumped on timeout under ``logging.dir/failures``).
* ``--max-restarts R``: the agent restarts every rank up to R times; a restarted rank resumes
  from the latest checkpoint under ``checkpoint.save``
  (:func:`colonnade.reliability.startup.resume_config`), or, with
  ``checkpoint.memory_interval`` > 0, by the recovery ladder: its own memory snapshot, its
  partner's copy, then that checkpoint (:func:`colonnade.checkpoint.recovery.recover`).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from colonnade.config.sections import Config


def run_rank(config: Config, launched: bool = False) -> dict[str, Any]:
    """The body of every rank: validate, monitor, join the job, resume on restart, train.

    Bad input (:data:`EXPECTED`) ends the rank with status 2 and no traceback; rank 0 prints
    it unless ``launched`` (then :func:`launch` prints it once)."""
    import os

    from colonnade.config.validate import resolve, validate
    from colonnade.reliability.monitor import RankInfo, RankMonitor, watchdog_seconds
    from colonnade.reliability.report import failure_report
    from colonnade.reliability.startup import init_distributed, resume_config
    from colonnade.training.loop import final_summary, train

    own_progress_lock()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = validate(resolve(config, world), world)  # before any process group exists
    info = RankInfo.from_env()
    monitor = RankMonitor(config.logging.dir, info, watchdog_s=watchdog_seconds(config.parallel),
                          timeout_s=config.parallel.timeout_s).start()
    ok = False
    try:
        if info.attempt > 0 and info.rank == 0:
            print(failure_report(config.logging.dir, attempt=info.attempt - 1,
                                 run_id=info.run_id), flush=True)
        config, note = resume_config(config, info.attempt)
        if note and info.rank == 0 and info.attempt > 0:  # the first note: the CLI's preflight
            print(f"colonnade: {note}", flush=True)
        member = None
        if config.checkpoint.restart == "in-process" and world > 1:
            member = join_rejoinable(config)  # the supervisor's store, this generation
        else:
            init_distributed(config)
        result = train(config, monitor=monitor, membership=member)
        ok = True
    except BaseException as exc:
        monitor.record_failure(exc)
        status = expected_failure(exc)
        if status is None:
            raise
        if info.rank == 0 and not launched:  # bad input, not a bug: one line, no traceback
            print(f"colonnade: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(status) from None
    finally:
        monitor.stop(ok)
    if result["rank"] == 0 and not (result.get("interrupted") or result.get("finished")):
        print(final_summary(result), flush=True)
    if result.get("interrupted") and launched:
        _exit_soon(128 + int(result["interrupted"]))
    return {"valid": result["valid"], "interrupted": result.get("interrupted", 0)}


def join_rejoinable(config: Config) -> Any:
    """Join the job as a rank that can rejoin after a peer's death
    (:func:`colonnade.reliability.rejoin.join_job`); returns its membership."""
    import os

    from colonnade.device import backend_for, pick_device
    from colonnade.reliability.rejoin import join_job

    device = pick_device(config.training.device, int(os.environ.get("LOCAL_RANK", "0")))
    return join_job(backend_for(device, config.parallel.backend), device,
                    config.parallel.timeout_s)


def own_progress_lock() -> None:
    """This rank's progress bars take a thread lock, not tqdm's default multiprocessing one:
    no bar is shared across processes, and that lock is a named semaphore which a rank ending
    by ``os._exit`` (:func:`_exit_soon`, after Ctrl-C) leaves behind, for Python's resource
    tracker to report as "1 leaked semaphore objects" once the job has stopped."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


EXIT_AFTER_STOP_S = 2.0
"""A stopped rank exits this long after returning unless the agent collected its result."""


def _exit_soon(status: int, delay: float = EXIT_AFTER_STOP_S) -> None:
    """After a stop the agent that got the signal too no longer collects results (its workers
    would wait for it until it kills them 30 s later): exit with ``status`` after ``delay``
    unless the agent (signal to the ranks only) collects the result first and ends us."""
    import os
    import threading

    def bye() -> None:
        time.sleep(delay)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    threading.Thread(target=bye, name="colonnade-exit", daemon=True).start()


EXPECTED = ("ConfigError", "DataError", "CorpusError", "TokenizerError", "IndexedDatasetError",
            "CheckpointError", "FileNotFoundError")
"""Errors of bad input (data, checkpoints, config): reported in one line, exit status 2."""


def expected_failure(err: BaseException) -> int | None:
    """Exit status of an expected failure printed as one line (bad input 2, NaN/Inf 1), or None
    for anything else (a bug: its traceback shows)."""
    names = {cls.__name__ for cls in type(err).__mro__}
    if names & set(EXPECTED):
        return 2
    if "RejoinError" in names:  # the supervisor restarts the whole job
        from colonnade.reliability.rejoin import REJOIN_FAILED

        return REJOIN_FAILED
    return 1 if "NonFiniteError" in names else None


def _one_line_failure(run_dir: str, run_id: str, since: float) -> str | None:
    """The message when every failed rank raised an expected error (the same bad input)."""
    from colonnade.reliability.report import read_records

    records = read_records(run_dir, run_id, since).values()
    summaries = [str(r.get("summary", "")) for r in records if r.get("kind") == "exception"]
    if not summaries or any(s.split(":", 1)[0] not in EXPECTED for s in summaries):
        return None
    return f"colonnade: {summaries[0]}"


def _stopped_line(config: Config, signum: int) -> str:
    """The launcher's line after Ctrl-C / SIGTERM reached it (it forwards it to the ranks,
    which finish their step and save)."""
    from colonnade.reliability.interrupt import signal_name
    from colonnade.reliability.startup import latest_checkpoint

    save = config.checkpoint.save
    latest = latest_checkpoint(save)
    if latest is not None:
        where = f"latest checkpoint {latest}; re-run the same command to resume"
    elif save is None:
        where = ("nothing was saved: checkpoint.save=none (leave it unset, or give "
                 "--checkpoint.save=DIR, to save on Ctrl-C / SIGTERM)")
    else:
        where = f"no checkpoint of this run was saved under {save}"
    return f"colonnade: the job was stopped by {signal_name(signum)}; {where}"


def quiet_agent_warnings() -> None:
    """Silence what the launcher's own report says better: the agent's warnings ("Received 15
    death signal", "Closing process ... via signal") and its traceback of a worker's exit
    ("ProcessExitedException: process 1 terminated with exit code 2", the agent's own stack,
    not the rank's: the rank's error is in the report and its dump)."""
    import logging

    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)


def _signal_in(err: BaseException) -> int:
    """The signal number of a ``SignalException`` anywhere in ``err``'s chain (the agent's
    handler raises it wherever the launcher happens to be, and a library may wrap it), or 0."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__name__ == "SignalException":
            return int(getattr(cur, "sigval", 0))
        cur = cur.__cause__ or cur.__context__
    return 0


def _launcher_failed(config: Config, args: argparse.Namespace, err: Exception, run_id: str,
                     since: float) -> int:
    """Report an error of the launcher itself: a stop signal (wrapped), after ranks started
    (with the ranks' report), or before (rendezvous / store failures: nothing ran)."""
    from colonnade.reliability.report import failure_report, read_heartbeats

    signum = _signal_in(err)
    if signum:
        print(_stopped_line(config, signum), file=sys.stderr, flush=True)
        return 128 + signum
    if read_heartbeats(config.logging.dir, run_id, since):
        print(f"colonnade: the launcher failed while the ranks ran ({type(err).__name__}: "
              f"{err})\n" + failure_report(config.logging.dir, run_id=run_id, since=since),
              file=sys.stderr, flush=True)
        return 1
    print(f"colonnade: the launcher failed before training ({type(err).__name__}: {err}). "
          f"Multi-node: check that every node uses the same --nnodes={args.nnodes} and "
          f"--rdzv-endpoint={args.rdzv_endpoint}, distinct --node-rank values, and that node "
          "0 is reachable.", file=sys.stderr, flush=True)
    return 1


def launch_config(args: argparse.Namespace) -> Any:
    """The elastic agent's :class:`LaunchConfig` for the launcher arguments."""
    from torch.distributed.launcher.api import LaunchConfig

    if args.nnodes > 1:
        rdzv = {"rdzv_backend": "static", "rdzv_endpoint": args.rdzv_endpoint,
                "rdzv_configs": {"rank": args.node_rank},
                "run_id": args.rdzv_id}
    else:  # like torchrun --standalone: a private rendezvous on a free port
        rdzv = {"rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:0",
                "run_id": f"colonnade-{uuid.uuid4().hex[:8]}"}
    return LaunchConfig(min_nodes=args.nnodes, max_nodes=args.nnodes,
                        nproc_per_node=args.nproc, max_restarts=args.max_restarts,
                        monitor_interval=0.5, start_method="spawn", **rdzv)


def check_launch_args(args: argparse.Namespace) -> list[str]:
    """Problems with --nproc / --nnodes / --node-rank / --rdzv-endpoint / --max-restarts."""
    out = []
    if args.nproc < 1:
        out.append(f"--nproc={args.nproc} must be >= 1.")
    if args.nnodes < 1:
        out.append(f"--nnodes={args.nnodes} must be >= 1.")
    if not 0 <= args.node_rank < max(args.nnodes, 1):
        out.append(f"--node-rank={args.node_rank} must be in [0, --nnodes={args.nnodes}).")
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if args.nnodes > 1 and (not host or not port.isdigit()):
        out.append(f"--rdzv-endpoint='{args.rdzv_endpoint}' must be HOST:PORT (node 0's address "
                   "and a free port, the same on every node).")
    if args.max_restarts < 0:
        out.append(f"--max-restarts={args.max_restarts} must be >= 0.")
    return out


def launch(config: Config, args: argparse.Namespace, overrides: list[str] | None = None,
           entrypoint: Callable[..., Any] = run_rank, entry_args: tuple[Any, ...] | None = None
           ) -> int:
    """Start ``args.nproc`` ranks on this node; returns the job's exit status: 0, 1 (a failure,
    reported per rank), 2 (bad input, one line) or 128 + signal (Ctrl-C 130, SIGTERM 143).

    ``entrypoint(*entry_args)`` (default ``run_rank(config, True)``) runs in every rank; it must
    be a module-level function (ranks are spawned).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from colonnade.reliability.monitor import watchdog_seconds
    from colonnade.reliability.report import failure_report
    from colonnade.reliability.startup import set_torch_nccl_env
    from colonnade.reliability.watch import HeartbeatWatch

    problems = check_launch_args(args)
    if config.checkpoint.restart == "in-process" and args.nnodes > 1:
        problems.append(f"--checkpoint.restart=in-process runs on one node (--nnodes="
                        f"{args.nnodes}): use --checkpoint.restart=job for several nodes.")
    if problems:
        print("colonnade: invalid launch arguments:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    if config.checkpoint.restart == "in-process" and args.nproc > 1:
        return launch_in_process(config, args, entrypoint, entry_args)
    lc = launch_config(args)
    since = time.time()
    quiet_agent_warnings()
    set_torch_nccl_env(config.logging.dir)  # torch's NCCL failure handling, for the ranks
    first = args.node_rank * args.nproc
    watch = HeartbeatWatch(config.logging.dir, lc.run_id, since,
                           watchdog_seconds(config.parallel), range(first, first + args.nproc))
    try:
        watch.start()
        results = elastic_launch(lc, entrypoint)(*(entry_args if entry_args is not None
                                                   else (config, True)))
    except SignalException as err:  # Ctrl-C / SIGTERM to the launcher, forwarded to the ranks
        frozen = [f"\n  rank {r} was frozen and could not stop: {text}"
                  for r, text in sorted(watch.killed.items())]
        print(_stopped_line(config, int(err.sigval)) + "".join(frozen), file=sys.stderr,
              flush=True)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        line = _one_line_failure(config.logging.dir, lc.run_id, since)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
            return 2
        report = failure_report(config.logging.dir, run_id=lc.run_id, since=since,
                                agent_failures=err.failures)
        print(report, file=sys.stderr, flush=True)
        return 1
    except Exception as err:
        return _launcher_failed(config, args, err, lc.run_id, since)
    finally:
        watch.stop()
    stopped = max((int((r or {}).get("interrupted", 0)) if isinstance(r, dict) else 0
                   for r in (results or {}).values()), default=0)
    return 128 + stopped if stopped else 0


def launch_in_process(config: Config, args: argparse.Namespace,
                      entrypoint: Callable[..., Any] = run_rank,
                      entry_args: tuple[Any, ...] | None = None) -> int:
    """:func:`launch` under ``checkpoint.restart='in-process'``: the ranks run under the local
    :mod:`~colonnade.reliability.supervisor`, which replaces a dead rank while the others stay
    alive and rejoin; the same exit statuses and failure report as :func:`launch`."""
    from colonnade.reliability.monitor import watchdog_seconds
    from colonnade.reliability.report import failure_report
    from colonnade.reliability.startup import set_torch_nccl_env
    from colonnade.reliability.supervisor import supervise
    from colonnade.reliability.watch import HeartbeatWatch

    since = time.time()
    set_torch_nccl_env(config.logging.dir)
    run_id = f"colonnade-{uuid.uuid4().hex[:8]}"
    watch = HeartbeatWatch(config.logging.dir, run_id, since, watchdog_seconds(config.parallel),
                           range(args.nproc))
    watch.start()
    try:
        status, _ = supervise(args.nproc, args.max_restarts, entrypoint,
                                entry_args if entry_args is not None else (config, True),
                                run_id)
    finally:
        watch.stop()
    if status in (1, 2):
        line = _one_line_failure(config.logging.dir, run_id, since)
        print(line or failure_report(config.logging.dir, run_id=run_id, since=since),
              file=sys.stderr, flush=True)
        return 2 if line else 1
    if status > 128:
        print(_stopped_line(config, status - 128), file=sys.stderr, flush=True)
    return status
