"""``torchrun --nproc-per-node N -m colonnade.train [--config F] [--section.field=value ...]``.

Every rank parses the same arguments, validates the config against WORLD_SIZE before any
process group exists (an invalid config exits with status 2 and the list of problems, printed
by local rank 0), then runs :func:`colonnade.launch.run_rank`.
"""

from __future__ import annotations

import os
import sys

from colonnade.config.load import ConfigError, load_config


def main(argv: list[str] | None = None) -> None:
    """Parse --config and overrides, then run this rank."""
    from colonnade.analysis.memory_limit import check_memory_limit
    from colonnade.checkpoint.finetune import explicit_model_fields, with_init_from
    from colonnade.launch import expected_failure, run_rank
    from colonnade.training.preflight import preflight

    argv = list(sys.argv[1:] if argv is None else argv)
    path = None
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise SystemExit("colonnade.train: --config needs a file")
        path = argv[i + 1]
        del argv[i:i + 2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = with_init_from(load_config(path, argv), explicit_model_fields(path, argv))
        config, notes = preflight(config, world)  # validates; data, checkpoints, resume
        check_memory_limit(config, world)  # training.memory_limit_gb: the memory model
    except Exception as err:
        status = 2 if isinstance(err, ConfigError) else expected_failure(err)
        if status is None:
            raise
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"colonnade: {err}", file=sys.stderr, flush=True)
        raise SystemExit(status) from None
    if notes and os.environ.get("RANK", "0") == "0":
        print(f"colonnade: {'; '.join(notes)}", flush=True)
    result = run_rank(config)
    if result.get("interrupted"):  # Ctrl-C / SIGTERM: saved and stopped, 130 / 143
        raise SystemExit(128 + int(result["interrupted"]))


if __name__ == "__main__":
    main()
