"""``torchrun --nproc-per-node N -m colonnade.train [--config F] [--section.field=value ...]``."""

from __future__ import annotations

import sys

from colonnade.config.load import load_config


def main(argv: list[str] | None = None) -> None:
    """Parse --config and overrides, then run this rank."""
    from colonnade.launch import run_rank

    argv = list(sys.argv[1:] if argv is None else argv)
    path = None
    if "--config" in argv:
        i = argv.index("--config")
        path = argv[i + 1]
        del argv[i:i + 2]
    run_rank(load_config(path, argv))


if __name__ == "__main__":
    main()
