"""SLURM's own commands, as the launcher calls them: ``sbatch``, ``scontrol``, ``squeue``, ``scancel``, ``srun``.

Every call goes through the ``SLURM_CONF`` of the environment (the cluster's, or a test cluster's). A command that
fails raises ``SlurmError`` with its stderr; one that is missing says that SLURM's client commands are needed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import subprocess
from collections.abc import Sequence

from orchestrator.errors import OrchestratorError

CALL_TIMEOUT_S = 60.0


class SlurmError(OrchestratorError):
    """A SLURM command failed (names the command and what it said)."""


def run(argv: Sequence[str], *, timeout_s: float = CALL_TIMEOUT_S) -> str:
    """``argv``'s stdout (blocking; for the CLI, outside any event loop)."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise SlurmError(f"`{argv[0]}` not found: SLURM's client commands must be on PATH (Debian: slurm-client)") \
            from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` did not answer within {timeout_s:.0f} s (is slurmctld up?)") from None
    if done.returncode:
        raise SlurmError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


async def arun(*argv: str, timeout_s: float = CALL_TIMEOUT_S) -> str:
    """``run`` off the event loop."""
    return await asyncio.to_thread(run, argv, timeout_s=timeout_s)


def submit(script: str) -> str:
    """Submit a batch script file; the job id."""
    return run(["sbatch", "--parsable", script]).strip().split(";")[0]


async def hostnames(nodelist: str) -> list[str]:
    """``SLURM_JOB_NODELIST`` (``n[1-3],gpu7``) expanded, in order."""
    return (await arun("scontrol", "show", "hostnames", nodelist)).split()


async def node_addresses(nodes: Sequence[str]) -> dict[str, str]:
    """Each node's address: its NodeAddr (its name unless slurm.conf says otherwise), resolved to an IP address
    (ZMQ binds an address, not a name)."""
    out = {}
    for line in (await arun("scontrol", "show", "node", "-o", ",".join(nodes))).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            out[fields["NodeName"]] = await asyncio.to_thread(ip_address_of, fields.get("NodeAddr", fields["NodeName"]))
    missing = [n for n in nodes if n not in out]
    if missing:
        raise SlurmError(f"scontrol show node does not know {', '.join(missing)}")
    return out


def ip_address_of(host: str) -> str:
    """``host`` if it is an IP address, else the first IPv4 address it resolves to."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except OSError as e:
        raise SlurmError(f"node address {host!r} does not resolve here: {e}") from None


async def steps(job_id: str) -> dict[str, str]:
    """The job's running steps: name -> step id (``12.3``); the newest step of a name wins."""
    out = await arun("squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j")
    found: dict[str, str] = {}
    for line in out.splitlines():
        step, _, name = line.strip().partition("|")
        if name and not step.endswith((".batch", ".extern")):
            old = found.get(name)
            if old is None or int(step.rpartition(".")[2]) > int(old.rpartition(".")[2]):
                found[name] = step
    return found


async def signal_step(step: str, sig: str = "TERM") -> None:
    """Send ``sig`` to every process of a step (``scancel --signal``: srun's own SIGTERM kills at once); a step that
    has ended meanwhile is no error."""
    try:
        await arun("scancel", "--quiet", f"--signal={sig}", step)
    except SlurmError:
        pass


def job_state(job_id: str) -> str | None:
    """The job's state as SLURM says it (PENDING, RUNNING, COMPLETED, CANCELLED...); None once slurmctld has
    forgotten it (MinJobAge after its end)."""
    try:
        out = run(["scontrol", "show", "job", "-o", job_id])
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return None
        raise
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get("JobState")


async def ajob_state(job_id: str) -> str | None:
    """``job_state`` off the event loop."""
    return await asyncio.to_thread(job_state, job_id)
