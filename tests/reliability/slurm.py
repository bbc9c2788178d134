"""A real Slurm on this machine for the tests: one controller and two node daemons (n1, n2).

The distribution's packages (slurmctld, slurmd, slurm-client; .ci/run installs them) with a
slurm.conf generated in a temporary directory: no munge (auth/none, cred/none: the daemons and
clients all run as this user on this host), both nodes on 127.0.0.1 with their own ports (one
slurmd per node, ``slurmd -N NAME``), state, spool, pid and log files in the directory, nothing
in /etc touched; KillWait (SIGTERM to SIGKILL after scancel) is 60 s, so that ranks on a loaded
2-core machine finish their step, save and exit before it. Clients find the cluster through
``SLURM_CONF`` in the environment the test hands them (:attr:`SlurmCluster.env`).
:meth:`SlurmCluster.close` cancels every job, waits for them to end, and stops the three daemons
it started (by their pids).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.reliability.jobs import wait_until

NODES = ("n1", "n2")
DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "scontrol")
MISSING = ("Slurm is not installed ({names} not on PATH): install the distribution's packages "
           "(`apt-get install -y --no-install-recommends slurmctld slurmd slurm-client`, as "
           ".ci/run does)")


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 just now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def slurm_conf(root: Path, ports: list[int], cpus: int) -> str:
    """The cluster's slurm.conf: controller at ``ports[0]``, node i's slurmd at ``ports[i+1]``."""
    host = socket.gethostname()
    nodes = "\n".join(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                      f"CPUs={cpus} State=UNKNOWN" for name, port in zip(NODES, ports[1:],
                                                                           strict=True))
    return f"""ClusterName=colonnade-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
AuthType=auth/none
CredType=cred/none
SlurmUser={pwd.getpwuid(os.getuid()).pw_name}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=60
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """A started controller and two node daemons; :attr:`env` is for the Slurm clients."""

    def __init__(self, root: Path, cpus: int = 2) -> None:
        missing = [name for name in DAEMONS if shutil.which(name) is None]
        if missing:
            raise AssertionError(MISSING.format(names=", ".join(missing)))
        self.root = root
        for sub in ("state", *(f"spool/{n}" for n in NODES)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "plugstack.conf").write_text("")
        conf = root / "slurm.conf"
        conf.write_text(slurm_conf(root, free_ports(1 + len(NODES)), cpus))
        self.env = dict(os.environ, SLURM_CONF=str(conf))
        self.daemons: list[subprocess.Popen[bytes]] = []
        try:
            self._start(["slurmctld", "-D", "-c", "-i", "-f", str(conf)])
            for name in NODES:
                self._start(["slurmd", "-D", "-N", name, "-f", str(conf)])
            wait_until(lambda: self.idle_nodes() == len(NODES), "both Slurm nodes idle", 30,
                       poll_s=0.2)
        except BaseException:
            self.close()  # the daemons already started
            raise

    def _start(self, argv: list[str]) -> None:
        log = (self.root / f"{argv[0]}-{len(self.daemons)}.out").open("wb")
        self.daemons.append(subprocess.Popen(argv, env=self.env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def run(self, *argv: str) -> str:
        """A Slurm client command's output (raises on failure)."""
        return subprocess.run(list(argv), env=self.env, check=True, capture_output=True,
                              text=True, timeout=30).stdout

    def idle_nodes(self) -> int:
        """Nodes the controller reports idle."""
        with contextlib.suppress(subprocess.SubprocessError):
            return self.run("sinfo", "-h", "-N", "-o", "%t").split().count("idle")
        return 0

    def jobs(self) -> list[str]:
        """Ids of the jobs still queued or running."""
        return self.run("squeue", "-h", "-o", "%i").split()

    def close(self) -> None:
        """Cancel every job, wait until they are gone, stop the daemons started here."""
        try:
            if self.daemons and self.daemons[0].poll() is None:
                for job in self.jobs():
                    self.run("scancel", "--signal=KILL", "--full", job)
                wait_until(lambda: not self.jobs(), "every Slurm job ended", 60, poll_s=0.2)
        finally:
            for proc in reversed(self.daemons):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 15
            for proc in self.daemons:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def job_processes(job_id: str, node: str) -> list[int]:
    """Pids of the processes Slurm runs for job ``job_id`` on ``node`` (the task, its launcher
    and ranks: every process whose environment carries both), not the slurmstepd."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if {f"SLURM_JOB_ID={job_id}".encode(), f"SLURMD_NODENAME={node}".encode()} <= env:
            pids.append(int(entry.name))
    return pids
