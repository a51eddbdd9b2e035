"""A real SLURM cluster on this machine, for tests (yours too): ``async with SlurmCluster.open(tmp) as cluster``.

What runs (Debian's ``slurm-wlm`` 22.05 and ``munge``, installed by ``scripts/slurm-setup.sh``):

- ``munged`` on this host, its key, socket, log and seed under ``root/munge`` (a Unix socket is a file, so every
  namespace reaches it); slurm.conf points at it (``AuthInfo=socket=...``);
- a network namespace per host on one bridge (``orchestrator.testing.netns``): ``login``, where ``slurmctld`` runs
  and from where jobs are submitted (``cluster.run("sbatch", ...)``), and one per node (``n1``, ``n2``...), each
  with its own address (slurm.conf's NodeAddr) and host name, running ``slurmd -N NAME``. A job's steps run inside
  their node's namespace, so a job really spans hosts: its roles talk over the bridge, never over loopback;
- slurm.conf, state and spool directories, pid and log files under ``root``; no cgroups (``proctrack/linuxproc``,
  ``task/none``: ``slurmd`` still needs the machine's cgroup mounts to start, so it enters only the network
  namespace, keeping this machine's /sys), no accounting, ``SlurmdParameters=config_overrides`` (each node says
  ``cpus`` CPUs whatever the machine has).

On exit, however the block ends: every job is cancelled, then every process inside the cluster's namespaces is
ended by its pid (the daemons by SIGTERM first, then anything left, the jobs' processes included, by SIGKILL),
``munged`` by its pid, and the namespaces deleted. ``missing()`` says what is not installed (naming the script
that installs it); ``unavailable()`` why namespaces cannot be made here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from orchestrator.procs import terminate
from orchestrator.testing.netns import Network, unavailable

__all__ = ["SETUP_SCRIPT", "SlurmCluster", "missing", "unavailable"]

SETUP_SCRIPT = "scripts/slurm-setup.sh"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")
CTL_PORT, SLURMD_PORT = 6817, 6818  # inside the namespaces: no clash with anything on this machine
START_S = 60.0
Process = asyncio.subprocess.Process


def missing() -> str | None:
    """None if SLURM and munge are installed here; else what is missing and the script that installs it."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if not absent:
        return None
    return (f"SLURM is not installed here ({', '.join(absent)} not found): run `bash {SETUP_SCRIPT}` (as root; "
            "Debian's slurm-wlm and munge)")


class SlurmCluster:
    """See the module docstring."""

    def __init__(self, root: Path, net: Network, nodes: Sequence[str], kill_wait_s: int) -> None:
        self.root, self.net, self.nodes, self.kill_wait_s = root, net, tuple(nodes), kill_wait_s
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.sock"

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, root: Path, nodes: Sequence[str] = ("n1", "n2", "n3"), *, cpus: int = 2,
                   kill_wait_s: int = 30) -> AsyncIterator[SlurmCluster]:
        """Start munged, slurmctld and a slurmd per node; yield once every node is idle. ``kill_wait_s``:
        slurm.conf's KillWait (SIGTERM to SIGKILL when a job is cancelled)."""
        why = missing() or unavailable()
        if why is not None:
            raise RuntimeError(why)
        await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
        munged: Process | None = None
        async with Network.open(("login", *nodes)) as net:
            cluster = cls(root, net, nodes, kill_wait_s)
            try:
                munged = await cluster._start_munge()
                cluster._write_conf(cpus)
                await cluster._start_daemons()
                yield cluster
            finally:
                await cluster._teardown()
                if munged is not None:
                    await terminate(munged, 5.0)

    # --------------------------------------------------------------------------------------- commands

    @property
    def env(self) -> dict[str, str]:
        """Our environment with ``SLURM_CONF`` naming this cluster (jobs inherit it: sbatch exports it)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    async def run(self, *argv: str, **popen: Any) -> Process:
        """``argv`` on the login host (a SLURM client command, or ``orchestrator launch slurm``)."""
        return await self.net.run("login", *argv, env=self.env, **popen)

    async def call(self, *argv: str, timeout_s: float = 60.0, cwd: Path | None = None) -> str:
        """Run ``argv`` on the login host to the end; its stdout (RuntimeError with its stderr if it fails)."""
        proc = await self.run(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {err.decode().strip()}")
        return out.decode()

    async def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of a job (JobState, ExitCode, Restarts...)."""
        out = await self.call("scontrol", "show", "job", "-o", job_id)
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    async def wait_job(self, job_id: str, states: Sequence[str], timeout_s: float) -> dict[str, str]:
        """Poll the job (every 0.5 s; SLURM has no event to wait on) until its state is one of ``states``."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = await self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not {'/'.join(states)} within {timeout_s:.0f} s: {fields}")
            await asyncio.sleep(0.5)

    # ---------------------------------------------------------------------------------------- setup

    async def _start_munge(self) -> Process:
        d = self.root / "munge"
        d.mkdir(mode=0o755, exist_ok=True)  # munged wants its socket's directory searchable by all
        key = d / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        proc = await asyncio.create_subprocess_exec(
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--log-file={d / 'munged.log'}", f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await self._until(lambda: self.munge_socket.exists(), "munged's socket", proc)
        return proc

    def _write_conf(self, cpus: int) -> None:
        r = self.root
        for sub in ("state", "log", *(f"spool/{n}" for n in self.nodes)):
            (r / sub).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=test", f"SlurmctldHost=login({self.net.address_of('login')})", "SlurmUser=root",
            "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"SlurmctldPort={CTL_PORT}", f"SlurmdPort={SLURMD_PORT}", f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n", f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}", f"SlurmctldLogFile={r / 'log/slurmctld.log'}",
            f"SlurmdLogFile={r / 'log/slurmd-%n.log'}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill", "MpiDefault=none", "ReturnToService=2", "MailProg=/bin/true",
            "SlurmdParameters=config_overrides", f"KillWait={self.kill_wait_s}", "MinJobAge=600",
            "InactiveLimit=0", "SlurmctldTimeout=30", "SlurmdTimeout=60",
            *(f"NodeName={n} NodeAddr={self.net.address_of(n)} CPUs={cpus} State=UNKNOWN" for n in self.nodes),
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]
        self.conf.write_text("\n".join(lines))

    async def _start_daemons(self) -> None:
        log = self.root / "log"
        with (log / "slurmctld.out").open("ab") as out:
            ctl = await self.net.run("login", "slurmctld", "-D", "-i", "-f", str(self.conf), hostname="login",
                                     stdout=out, stderr=out, env=self.env)
        for n in self.nodes:
            with (log / f"slurmd-{n}.out").open("ab") as out:
                await self.net.run(n, "slurmd", "-D", "-N", n, "-f", str(self.conf), hostname=n, own_sysfs=False,
                                   stdout=out, stderr=out, env=self.env)
        deadline = time.monotonic() + START_S
        while True:  # SLURM has no event to wait on: poll sinfo until every node is idle
            with contextlib.suppress(RuntimeError, TimeoutError):
                states = (await self.call("sinfo", "-h", "-N", "-o", "%N %t", timeout_s=10)).split()
                if states.count("idle") == len(self.nodes):
                    return
            if ctl.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the SLURM cluster did not come up within {START_S:.0f} s (slurmctld exit "
                                   f"{ctl.returncode}); see {log}")
            await asyncio.sleep(0.5)

    async def _until(self, ready: Callable[[], bool], what: str, proc: Process) -> None:
        deadline = time.monotonic() + START_S
        while not ready():
            if proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not appear (exit {proc.returncode}); see {self.root}")
            await asyncio.sleep(0.1)

    async def _teardown(self) -> None:
        """Cancel every job and wait (bounded) for the queue to empty; then every process in the cluster's
        namespaces by its pid: SIGTERM, then SIGKILL for anything left."""
        with contextlib.suppress(RuntimeError, TimeoutError):
            await self.call("scancel", "--partition=debug", timeout_s=10)
            for _ in range(2 * (self.kill_wait_s + 15)):  # SIGKILL comes at KillWait: a bound, not a guess
                if not (await self.call("squeue", "-h", timeout_s=10)).strip():
                    break
                await asyncio.sleep(0.5)
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            pids = [p for h in ("login", *self.nodes) for p in self.net.pids(h)]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            for _ in range(int(grace / 0.1)):
                if not any(_alive(p) for p in pids):
                    break
                await asyncio.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
