"""Starting the ranks through torch's elastic launcher (the engine behind torchrun).

``colonnade train --nproc N [--nnodes K --node-rank I --rdzv-endpoint HOST:PORT]`` calls
:func:`launch`, which runs :func:`run_rank` in N local worker processes with the usual
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR environment. ``torchrun ... -m colonnade.train``
reaches the same :func:`run_rank` directly.
"""

from __future__ import annotations

import argparse
import uuid

from colonnade.config.sections import Config


def run_rank(config: Config) -> dict:
    """The body of every rank: train, print the summary on rank 0."""
    from colonnade.training.loop import final_summary, train

    result = train(config)
    if result["rank"] == 0:
        print(final_summary(result), flush=True)
    return {"valid": result["valid"]}


def launch(config: Config, args: argparse.Namespace, overrides: list[str]) -> int:
    """Start ``args.nproc`` ranks on this node; returns the job's exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    host, _, port = args.rdzv_endpoint.partition(":")
    multi_node = args.nnodes > 1
    lc = LaunchConfig(
        min_nodes=args.nnodes, max_nodes=args.nnodes, nproc_per_node=args.nproc,
        run_id=f"colonnade-{uuid.uuid4().hex[:8]}" if not multi_node else "colonnade",
        rdzv_backend="static" if multi_node else "c10d",
        rdzv_endpoint=args.rdzv_endpoint if multi_node else f"{host}:{port or 29511}",
        rdzv_configs={"rank": args.node_rank} if multi_node else {},
        max_restarts=args.max_restarts, monitor_interval=0.5, start_method="spawn",
    )
    if not multi_node:
        lc.rdzv_endpoint = "127.0.0.1:0"
    try:
        elastic_launch(lc, run_rank)(config)
    except ChildFailedError as err:
        print(f"colonnade: job failed: {err.format_msg()}", flush=True)
        return 1
    return 0
