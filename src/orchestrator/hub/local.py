"""The env worker processes a hub starts on this host: spawn, restart with back-off, kill, stop, by pid.

``LocalWorkers`` owns the process of every local worker slot (named ``local-<n>``): forked from the run's warm
process (hub/forks.py), or an ``asyncio.subprocess.Process`` when that cannot fork it; and
nothing else: which worker is ready, lost or holding rollouts is the hub's (hub.py). The hub calls
``exited()`` and ``restart_due()`` from its supervision loop every HEARTBEAT_S: a slot whose process exited
is restarted under the same name, at once when that process had become ready (it was serving, then died or
froze), else after RESTART_BACKOFF_S[failures in a row] (a worker that keeps failing to start does not spin).
``kill`` is SIGKILL by pid (it also ends a stopped process); ``stop`` ends every process at once, within
STOP_GRACE_S in all, the warm process a second later (the run's shutdown has 8 s: commands/run.py).

Before a worker is ready it sends nothing the hub could miss: it loads its environments in blocking calls
(seconds, a download far longer; started on its own, it imports verifiers first: ~6 s). So while it starts its process
is watched instead (``starting``, every HEARTBEAT_S): stopped (SIGSTOP, a debugger: /proc says so) for the
hub's silence bound, or not connected within STARTUP_S of its start, it is to be killed and restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Collection

from orchestrator.hub.forks import Forked, Forks, env_worker_command
from orchestrator.procs import STOPPED, child_env, process_activity, process_state, terminate

log = logging.getLogger(__name__)
Child = asyncio.subprocess.Process | Forked  # a worker started on its own, or forked from the warm process

RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)  # local restarts after consecutive failures
STOP_GRACE_S = 5.0  # every local worker stopping exits within this (all at once), or is killed
# a local worker says hello within this of its start: an interpreter importing numpy and zmq, seconds even on
# a machine loaded many times over; past it, it is wedged (a stopped one is caught sooner: ``starting``)
STARTUP_S = 120.0


class LocalWorkers:
    def __init__(self, address: str, env_vars: dict[str, str], nice: int, span_address: str | None = None) -> None:
        self.address = address
        self.env_vars = env_vars
        self.nice = nice
        self.span_address = span_address  # direct mode: each worker's span server binds here (tcp://HOST:0)
        self._span = [] if span_address is None else ["--span-address", span_address]
        # imports verifiers once and forks the workers (hub/forks.py); its command line names the address
        self.forks = Forks(["--connect", address, "--nice", str(nice), *self._span], env_vars, STARTUP_S)
        self.procs: dict[str, Child] = {}  # by name: the current process of each slot
        self.restarts = 0
        self._restart_at: dict[str, float] = {}  # slots waiting to be restarted -> when (loop time)
        self._became_ready: set[str] = set()  # slots whose current process reached ready
        self._failures_in_a_row = 0  # processes that exited before becoming ready
        self._spawned = 0
        self._started: dict[str, float] = {}  # slot -> when its current process started (loop time)
        self._stopped_since: dict[str, float] = {}  # slots whose process was seen stopped -> since when
        self._activity: dict[str, int] = {}  # slot -> its process's activity count at the last ``at_work``

    async def spawn(self, name: str | None = None) -> str:
        """Start a worker process (a new slot, or ``name``'s again), forked from the warm process when it can
        (hub/forks.py), else on its own; its name."""
        if name is None:
            name = f"local-{self._spawned}"
            self._spawned += 1
        args = ["--connect", self.address, "--id", name, *self._span]
        proc: Child | None = await self.forks.spawn(args)  # its niceness is the warm process's
        if proc is None:
            proc = await asyncio.create_subprocess_exec(*env_worker_command(*args, "--nice", str(self.nice)),
                                                        env=child_env(self.env_vars))
        self.procs[name] = proc
        self._became_ready.discard(name)
        self._activity.pop(name, None)
        self._started[name] = asyncio.get_running_loop().time()
        self._stopped_since.pop(name, None)
        log.info("started env worker %s (pid %d)", name, proc.pid)
        return name

    def is_ours(self, name: str, pid: int | None) -> bool:
        """Whether ``name`` / ``pid`` is the current process of one of our slots."""
        proc = self.procs.get(name)
        return proc is not None and pid is not None and proc.pid == pid

    def alive(self, name: str) -> int | None:
        """The pid of ``name``'s process if it is ours and still running."""
        proc = self.procs.get(name)
        return proc.pid if proc is not None and proc.returncode is None else None

    def became_ready(self, name: str) -> None:
        if name in self.procs:
            self._became_ready.add(name)
            self._failures_in_a_row = 0

    def starting(self, now: float, connected: Collection[str], silence_s: float) -> dict[str, str]:
        """The slots whose process is not ready yet and must go, each with why: stopped for ``silence_s``, or
        (not in ``connected``) no hello within STARTUP_S of its start. Call every HEARTBEAT_S: a process is seen
        stopped from the first call that finds it so."""
        due: dict[str, str] = {}
        for name in self.procs:
            pid = self.alive(name)
            if pid is None or name in self._became_ready:
                self._stopped_since.pop(name, None)
                continue
            stopped = self.stopped_for(name, now)
            if stopped > silence_s:
                due[name] = f"stopped (SIGSTOP or a debugger) for {stopped:.0f} s before it was ready"
            elif name not in connected and now - self._started[name] > STARTUP_S:
                due[name] = f"not connected {now - self._started[name]:.0f} s after its start"
        return due

    def stopped_for(self, name: str, now: float) -> float:
        """How long ``name``'s process has been seen stopped, 0 if it is not (or /proc cannot say)."""
        proc = self.procs[name]
        if process_state(proc.pid) not in STOPPED:
            self._stopped_since.pop(name, None)
            return 0.0
        return now - self._stopped_since.setdefault(name, now)

    def at_work(self, name: str) -> str | None:
        """Why ``name``'s process looks at work though it is silent: "running" (on a core or waiting for one),
        "waiting on the disk", or "working" (CPU time or disk reads since the previous call); None when it is
        stopped, asleep with nothing done since the previous call, gone, or not one of ours. The hub asks from
        half its silence bound on, so two calls bracket the last part of the silence."""
        pid = self.alive(name)
        seen = None if pid is None else process_activity(pid)
        if seen is None:
            self._activity.pop(name, None)
            return None
        state, activity = seen
        before = self._activity.get(name)
        self._activity[name] = activity
        if state in STOPPED or state in ("Z", "X"):  # stopped, or dead and not yet reaped
            return None
        if state in ("R", "D"):
            return "running" if state == "R" else "waiting on the disk"
        return "working" if before is not None and activity > before else None

    def not_ready(self, connected: dict[str, bool], now: float) -> list[str]:
        """Each slot not ready (``connected``: the hub's workers, name -> ready) as a start-up line shows it:
        its pid, whether it is connected, and stopped or restarting if it is."""
        out = []
        for name, proc in self.procs.items():
            if connected.get(name):
                continue
            state = ("not connected" if name not in connected else "connected, loading its environments")
            if name in self._restart_at:
                state = f"exited with status {proc.returncode}, restarting"
            elif (since := self._stopped_since.get(name)) is not None:
                state += f", stopped for {now - since:.0f} s"
            out.append(f"{name} (local, pid {proc.pid}, {state})")
        return out

    def exited(self, now: float) -> list[tuple[str, int | None]]:
        """Slots whose process exited since the last call, with its status; each is scheduled for a restart."""
        out: list[tuple[str, int | None]] = []
        for name, proc in self.procs.items():
            if proc.returncode is None or name in self._restart_at:
                continue
            if name not in self._became_ready:  # a process that was serving (then froze or died) restarts at once
                self._failures_in_a_row += 1
            delay = RESTART_BACKOFF_S[min(self._failures_in_a_row, len(RESTART_BACKOFF_S) - 1)]
            log.error("local env worker %s (pid %d) exited with status %s; restarting it in %.0f s", name, proc.pid,
                      proc.returncode, delay)
            self._restart_at[name] = now + delay
            out.append((name, proc.returncode))
        return out

    async def restart_due(self, now: float) -> list[str]:
        """Restart the slots whose back-off has passed; their names."""
        due = [name for name, when in self._restart_at.items() if now >= when]
        for name in due:
            del self._restart_at[name]
            self.restarts += 1
            await self.spawn(name)
        return due

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)

    async def stop(self, asked: Collection[str]) -> None:
        """End every process, all at once: those in ``asked`` were sent ``stop`` by the hub (ready: they read it
        at once and close their pools); the others get SIGTERM now (still starting or loading their
        environments, they read no message until ready, which may take many seconds). Any still there after
        STOP_GRACE_S is killed. One after another, two workers that had not connected took 10 s, past the
        run's shutdown bound."""
        # a forked worker's end is heard from the warm process: if that is stopped (SIGSTOP), killing it ends them
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_GRACE_S + 1), asyncio.TaskGroup() as tg:
                for name, proc in self.procs.items():
                    tg.create_task(terminate(proc, STOP_GRACE_S, signal_first=name not in asked))
        await self.forks.close(grace_s=1.0)

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}
