"""The launcher's account of a failed job: which rank failed first, how, and doing what.

Sources, combined per rank:
* the elastic agent's failure (``ChildFailedError.failures``): exit code or signal of the first
  worker it saw die, and its Python error when it raised;
* the ranks' own records (:mod:`colonnade.reliability.monitor`): 'exception', 'hang' and
  'terminated' records with the collective in flight and a full dump;
* the launcher's 'frozen' records (:mod:`colonnade.reliability.watch`): a rank whose heartbeat
  went stale while its process still existed (stopped, or not running at all) was hung, not
  dead; the launcher recorded its last step and collective, then killed it;
* the heartbeats: a rank that started (it has a heartbeat of this attempt) but left no record
  and did not finish died without running any Python: SIGKILL, the OOM killer, a hard crash.

Ranks are listed most-likely-cause first: died without a trace or frozen, stuck outside any
collective, raised a non-comm error, hung inside a collective or failed in one (usually waiting
for one of the former), exited, stopped by the launcher.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ORDER = {"died": 0, "frozen": 0, "stuck": 1, "exception": 2, "hang": 3, "comm": 3,
          "exited": 4, "terminated": 5, "done": 6}
STUCK_IDLE_S = 1.0
"""A rank stopped while outside every collective and idle this long was stuck in its own code."""


@dataclass
class RankStatus:
    """How one rank ended, as far as the files and the agent tell."""

    rank: int
    kind: str
    """'died' | 'frozen' | 'stuck' | 'hang' | 'exception' | 'comm' | 'exited' | 'terminated' |
    'done'."""
    text: str
    dump: str = ""

    def line(self) -> str:
        """One report line."""
        where = f" [dump: {self.dump}]" if self.dump else ""
        return f"rank {self.rank}: {self.text}{where}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _matches(rec: dict[str, Any], run_id: str | None, since: float | None) -> bool:
    if run_id is not None and rec.get("run_id") != run_id:
        return False
    return since is None or float(rec.get("time", 0.0)) >= since - 1.0


def read_records(run_dir: str | Path, run_id: str | None = None,
                 since: float | None = None) -> dict[tuple[int, int], dict[str, Any]]:
    """Failure records under ``run_dir/failures`` keyed by (attempt, rank)."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for path in sorted((Path(run_dir) / "failures").glob("rank*-a*.json")):
        rec = _read_json(path)
        if rec is not None and _matches(rec, run_id, since):
            out[(int(rec["attempt"]), int(rec["rank"]))] = rec
    return out


def read_heartbeats(run_dir: str | Path, run_id: str | None = None,
                    since: float | None = None) -> dict[tuple[int, int], dict[str, Any]]:
    """Latest heartbeat of each rank and attempt under ``run_dir/heartbeat``, by (attempt, rank)."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for path in sorted((Path(run_dir) / "heartbeat").glob("rank*-a*.json")):
        beat = _read_json(path)
        if beat is not None and _matches(beat, run_id, since):
            out[(int(beat["attempt"]), int(beat["rank"]))] = beat
    return out


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _from_agent(rank: int, failure: Any) -> RankStatus:
    """Status from a torch elastic ``ProcessFailure``."""
    code = int(getattr(failure, "exitcode", 1))
    pid = getattr(failure, "pid", "?")
    if code == -int(signal.SIGABRT):
        return RankStatus(rank, "died", f"aborted (SIGABRT, pid {pid}) without a Python error: "
                          "on NCCL, torch's watchdog aborts a rank whose collective failed or "
                          "exceeded parallel.timeout_s (its flight recorder dump: logging.dir/"
                          f"failures/nccl_trace_rank_{rank}); else a crash in C++ (see stderr)")
    if code < 0:
        return RankStatus(rank, "died", f"killed by {_signal_name(code)} (pid {pid}) without a "
                          "Python error: killed from outside (kill -9, the OOM killer, the "
                          "scheduler) or crashed")
    message = str(getattr(failure, "message", "") or "").strip().splitlines()
    detail = f": {message[0]}" if message and "<N/A>" not in message[0] else ""
    return RankStatus(rank, "exited", f"exited with status {code} (pid {pid}){detail}")


def _from_record(rec: dict[str, Any]) -> RankStatus:
    kind, rank, step = rec["kind"], int(rec["rank"]), rec.get("step", "?")
    doing = ""
    if rec.get("in_flight"):
        doing = f" while in {rec['in_flight'][0]}"
    elif rec.get("last_op") and rec["last_op"] != "none":
        doing = f"; last collective {rec['last_op']}"
    if kind == "exception":
        summary = rec.get("summary", "")
        kind = "comm" if summary.startswith("CommError") else "exception"
        text = f"raised at step {step}: {summary}"
    elif kind == "frozen":
        text = f"FROZEN at step {step}: {rec.get('summary', '')}{doing}"
    elif kind == "hang" and not rec.get("in_flight"):
        kind = "stuck"
        text = (f"STUCK outside any collective at step {step}{doing} (see its Python stack): "
                f"{rec.get('summary', '')}")
    elif kind == "hang":
        text = f"HUNG at step {step}{doing}: {rec.get('summary', '')}"
    elif not rec.get("in_flight") and float(rec.get("idle_s", 0.0)) >= STUCK_IDLE_S:
        kind = "stuck"
        text = (f"STUCK outside any collective for {rec['idle_s']:.1f} s at step {step} (its "
                "peers waited for it in a collective; see its Python stack), stopped by the "
                "launcher")
    else:
        text = f"stopped by the launcher (SIGTERM) at step {step}{doing}"
    return RankStatus(rank, kind, f"{text} (pid {rec.get('pid')} on {rec.get('host')})",
                      rec.get("dump", ""))


def rank_statuses(run_dir: str | Path, *, attempt: int | None = None, run_id: str | None = None,
                  since: float | None = None,
                  agent_failures: dict[int, Any] | None = None) -> tuple[int, list[RankStatus]]:
    """(attempt, statuses most-likely-cause first) for the latest (or the given) attempt."""
    records = read_records(run_dir, run_id, since)
    beats = read_heartbeats(run_dir, run_id, since)
    if attempt is None:
        attempt = max([a for a, _ in records] + [a for a, _ in beats], default=0)
    agent_failures = agent_failures or {}
    ranks = sorted({r for a, r in records if a == attempt} | {r for a, r in beats if a == attempt}
                   | set(agent_failures))
    out = []
    for rank in ranks:
        rec = records.get((attempt, rank))
        beat = beats.get((attempt, rank))
        if rec is not None:
            status = _from_record(rec)
        elif rank in agent_failures:
            status = _from_agent(rank, agent_failures[rank])
        elif beat is not None and beat.get("phase") == "done":
            status = RankStatus(rank, "done", "finished")
        else:
            pid = beat.get("pid", "?") if beat else "?"
            step = beat.get("step", "?") if beat else "?"
            status = RankStatus(rank, "died", f"died without a Python error or dump (pid {pid}, "
                                f"last heartbeat at step {step}): killed by a signal (kill -9, "
                                "the OOM killer, the scheduler) or crashed")
        if beat is not None and status.kind == "died" and beat.get("last_op", "none") != "none":
            status.text += f"; its last collective: {beat['last_op']}"
        out.append(status)
    out.sort(key=lambda s: (_ORDER.get(s.kind, 9), s.rank))
    return attempt, out


def failure_report(run_dir: str | Path, *, attempt: int | None = None,
                   run_id: str | None = None, since: float | None = None,
                   agent_failures: dict[int, Any] | None = None) -> str:
    """Readable multi-line report of a failed attempt (first line: the likely cause)."""
    attempt, statuses = rank_statuses(run_dir, attempt=attempt, run_id=run_id, since=since,
                                      agent_failures=agent_failures)
    failed = [s for s in statuses if s.kind != "done"]
    if not failed:
        return (f"colonnade: attempt {attempt} failed; no rank left a record under "
                f"{Path(run_dir) / 'failures'}")
    lines = [f"colonnade: the job failed (attempt {attempt}); likely cause: {failed[0].line()}"]
    lines += [f"  {s.line()}" for s in statuses]
    return "\n".join(lines)
