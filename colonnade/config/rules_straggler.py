"""The validator's straggler-detection checks (part of the 'files_and_loop' rule of
:mod:`colonnade.config.validate`): logging.straggler_interval, _threshold and _windows."""

from __future__ import annotations

from colonnade.config.sections import LoggingConfig


def straggler_problems(log: LoggingConfig) -> list[str]:
    """straggler_interval >= 0 and a multiple of log_interval (the window ends on a log step,
    where the loop synchronises anyway); threshold > 1; windows >= 1."""
    out: list[str] = []
    every = log.straggler_interval
    if every < 0:
        out.append(f"logging.straggler_interval={every} must be >= 0 (0 turns straggler "
                   "detection off).")
    elif every and log.log_interval >= 1 and every % log.log_interval:
        fix = max(log.log_interval, every // log.log_interval * log.log_interval)
        out.append(f"logging.straggler_interval={every} must be a multiple of "
                   f"logging.log_interval={log.log_interval} (a window ends on a log step, "
                   f"which synchronises anyway); e.g. --logging.straggler_interval={fix}.")
    if log.straggler_threshold <= 1.0:
        out.append(f"logging.straggler_threshold={log.straggler_threshold} must be > 1 (the "
                   "factor by which a rank's own work exceeds its peers' median), e.g. 1.2.")
    if log.straggler_windows < 1:
        out.append(f"logging.straggler_windows={log.straggler_windows} must be >= 1 "
                   "(consecutive slow windows before a rank is named), e.g. 3.")
    return out
