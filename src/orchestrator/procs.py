"""Child processes the orchestrator starts (env workers, simulated servers): stopping them by their pid, and
making them end with their parent even when it is SIGKILLed (so a crashed run leaves no orphans)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

PARENT_ENV = "ORCHESTRATOR_PARENT_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_NAME = 15


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child we start: ours, ``extra``, and our pid for ``die_with_parent``."""
    return {**os.environ, **(extra or {}), PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child started with ``child_env``: ask the kernel for SIGKILL when the parent dies (Linux), and
    exit now if it already has. The variable is removed so our own children do not inherit it.

    SIGKILL, not SIGTERM: a stopped process (SIGSTOP, a debugger) leaves SIGTERM pending, so a worker frozen
    when its orchestrator was SIGKILLed stayed behind, stopped, until someone sent it SIGCONT. Nothing is lost
    by it: none of our children handles SIGTERM by saving anything (an env worker's default action ends it
    just as abruptly; a simulated server only closes its port), and their own children follow the same way."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError):  # not Linux: the parent stops us by pid, as usual
        log.debug("no prctl here; this process will not follow its parent's death")
    if os.getppid() != int(parent):
        raise SystemExit(f"parent process {parent} is gone; exiting")


def name_process(name: str) -> None:
    """This process's name as ps, top and /proc/PID/comm show it (Linux; at most 15 bytes): an env worker and the
    hub's warm one share a command line (workers/zygote.py)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15])


STOPPED = ("T", "t")  # process_state of a process stopped by a signal (SIGSTOP) or by a debugger


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in /proc (``R``, ``S``, ``D``, ``T`` stopped, ``t`` stopped by a
    debugger, ``Z``...), or None when it is gone or there is no /proc (not Linux)."""
    seen = process_activity(pid)
    return None if seen is None else seen[0]


def process_activity(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter (``process_state``) and a count that grows while it does anything: its
    CPU time in clock ticks plus its page faults that read the disk (all threads). None as ``process_state``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the name, in parentheses, may hold anything; fields from the 3rd
    majflt, utime, stime = int(fields[9]), int(fields[11]), int(fields[12])  # proc(5): fields 12, 14 and 15
    return fields[0], majflt + utime + stime


class Stoppable(Protocol):
    """What ``terminate`` needs of a process: an ``asyncio.subprocess.Process``, or a worker the hub's warm process
    forked (hub/forks.py)."""

    @property
    def returncode(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int: ...


async def terminate(proc: Stoppable, timeout_s: float = 10.0, *, signal_first: bool = True) -> None:
    """Stop a child we started: SIGTERM (unless ``signal_first`` is False), then SIGKILL after ``timeout_s``."""
    if proc.returncode is not None:
        return
    if signal_first:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
