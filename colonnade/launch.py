"""Starting the ranks through torch's elastic launcher (the engine behind torchrun).

``colonnade train --nproc N [--nnodes K --node-rank I --rdzv-endpoint HOST:PORT]
[--max-restarts R]`` calls :func:`launch`, which runs :func:`run_rank` in N local worker
processes with the usual RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR environment.
``torchrun ... -m colonnade.train`` reaches the same :func:`run_rank` directly.

* One node: a private c10d rendezvous on a free local port (torchrun's ``--standalone``).
* Several nodes: a static rendezvous at ``--rdzv-endpoint`` (node 0's address); each node runs
  one launcher with its ``--node-rank``; global rank = node_rank * nproc + local rank.
* Failure: when a rank dies or raises, the agent stops the others (SIGTERM, then SIGKILL after
  30 s); each rank records what it was doing (:mod:`colonnade.reliability`), and the launcher
  prints a report naming the rank that failed first, how, and in which collective, and exits 1.
* ``--max-restarts R``: the agent restarts every rank up to R times; a restarted rank resumes
  from the latest checkpoint under ``checkpoint.save``
  (:func:`colonnade.reliability.startup.resume_config`).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from colonnade.config.sections import Config, ParallelConfig


def watchdog_seconds(par: ParallelConfig) -> float:
    """The hang detector's limit: ``parallel.watchdog_s``, or 2 x timeout_s when unset."""
    return 2.0 * par.timeout_s if par.watchdog_s is None else par.watchdog_s


def run_rank(config: Config) -> dict[str, Any]:
    """The body of every rank: validate, monitor, join the job, resume on restart, train."""
    import os

    from colonnade.config.validate import resolve, validate
    from colonnade.reliability.monitor import RankInfo, RankMonitor
    from colonnade.reliability.report import failure_report
    from colonnade.reliability.startup import init_distributed, resume_config
    from colonnade.training.loop import final_summary, train

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = validate(resolve(config, world), world)  # before any process group exists
    info = RankInfo.from_env()
    monitor = RankMonitor(config.logging.dir, info,
                          watchdog_s=watchdog_seconds(config.parallel)).start()
    ok = False
    try:
        if info.attempt > 0 and info.rank == 0:
            print(failure_report(config.logging.dir, attempt=info.attempt - 1,
                                 run_id=info.run_id), flush=True)
        config, note = resume_config(config, info.attempt)
        if note and info.rank == 0:
            print(f"colonnade: {note}", flush=True)
        init_distributed(config)
        result = train(config, monitor=monitor)
        ok = True
    except BaseException as exc:
        monitor.record_failure(exc)
        raise
    finally:
        monitor.stop(ok)
    if result["rank"] == 0:
        print(final_summary(result), flush=True)
    return {"valid": result["valid"]}


def launch_config(args: argparse.Namespace) -> Any:
    """The elastic agent's :class:`LaunchConfig` for the launcher arguments."""
    from torch.distributed.launcher.api import LaunchConfig

    if args.nnodes > 1:
        rdzv = {"rdzv_backend": "static", "rdzv_endpoint": args.rdzv_endpoint,
                "rdzv_configs": {"rank": args.node_rank}, "run_id": "colonnade"}
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
    """Start ``args.nproc`` ranks on this node; returns the job's exit status (0 or 1).

    ``entrypoint(*entry_args)`` (default ``run_rank(config)``) runs in every rank; it must be a
    module-level function (ranks are spawned).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from colonnade.reliability.report import failure_report

    problems = check_launch_args(args)
    if problems:
        print("colonnade: invalid launch arguments:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    lc = launch_config(args)
    since = time.time()
    try:
        elastic_launch(lc, entrypoint)(*(entry_args if entry_args is not None else (config,)))
    except ChildFailedError as err:
        report = failure_report(config.logging.dir, run_id=lc.run_id, since=since,
                                agent_failures=err.failures)
        print(report, file=sys.stderr, flush=True)
        return 1
    except Exception as err:  # rendezvous / store failures: nothing ran
        print(f"colonnade: the launcher failed before training ({type(err).__name__}: {err}). "
              f"Multi-node: check that every node uses the same --nnodes={args.nnodes} and "
              f"--rdzv-endpoint={args.rdzv_endpoint}, distinct --node-rank values, and that node "
              "0 is reachable.", file=sys.stderr, flush=True)
        return 1
    return 0
