"""Fail loudly, never hang: heartbeats and a hang watchdog per rank, failure records and the
launcher's report, NaN/Inf guards, start-up timeouts and resume-on-restart."""

from colonnade.reliability.monitor import (
    HANG_EXIT_CODE,
    TERM_EXIT_CODE,
    RankInfo,
    RankMonitor,
    failure_path,
    heartbeat_path,
)
from colonnade.reliability.nan import NonFiniteError, check_step
from colonnade.reliability.report import failure_report, rank_statuses
from colonnade.reliability.startup import init_distributed, resume_config

__all__ = [
    "HANG_EXIT_CODE", "TERM_EXIT_CODE", "NonFiniteError", "RankInfo", "RankMonitor",
    "check_step", "failure_path", "failure_report", "heartbeat_path", "init_distributed",
    "rank_statuses", "resume_config",
]
