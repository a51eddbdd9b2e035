"""The hub's end of the warm env worker (workers/zygote.py): start it, fork local workers from it, learn their exits.

``Forks.spawn(argv)`` returns a ``Forked`` (what ``LocalWorkers`` needs of an ``asyncio.subprocess.Process``:
``pid``, ``returncode``, ``wait``, ``send_signal``, ``kill``), or None when the warm process cannot fork one: it
exited or did not answer within ``STARTUP_S`` (a broken install, a process stopped or killed from outside).
The caller then starts that worker on its own, as a plain process, so every failure keeps the path (and the
error messages) of a worker that cannot start. A warm process that fails before it ever forked is not started
again (each worker starts on its own from then on); one that dies later (its workers die with it, and are
restarted like any other) is started again at the next spawn, up to ``MAX_STARTS`` times in a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

import orjson

from orchestrator.procs import child_env, terminate

log = logging.getLogger(__name__)

MAX_STARTS = 3  # warm processes a run starts at most; then workers start on their own
KILLED_WITH_IT = -signal.SIGKILL  # the status of a worker whose warm process died (its parent-death signal)


class Forked:
    """A worker forked by the warm process. Its exit is learnt from the warm process (which reaps it), or, if that
    died first, is the SIGKILL it died of."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.Event()

    def ended(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
            self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forks:
    """The warm process of one hub (see the module docstring). ``argv``: the ``env-worker`` arguments it is started
    with (``--connect``...: its command line names the run's worker address, as a worker's does); ``env``: the
    workers' environment variables; ``startup_s``: how long a fork may take, warm-up included."""

    def __init__(self, argv: list[str], env: dict[str, str], startup_s: float) -> None:
        self.argv, self.env, self.startup_s = argv, env, startup_s
        self.starts = 0
        self.usable = True
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._forked: dict[int, Forked] = {}
        self._pids: asyncio.Queue[int] = asyncio.Queue()  # the warm process's fork replies, in request order
        self._listening: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one request at a time: replies come in order

    @property
    def pid(self) -> int | None:
        return None if self._proc is None or self._proc.returncode is not None else self._proc.pid

    async def spawn(self, argv: list[str]) -> Forked | None:
        """A worker forked with ``argv``, or None (see the module docstring)."""
        async with self._lock:
            if not self.usable:
                return None
            if self.pid is None and not await self._start():
                return None
            assert self._writer is not None
            self._writer.write(orjson.dumps({"argv": argv}) + b"\n")
            try:
                async with asyncio.timeout(self.startup_s):
                    pid = await self._pids.get()
            except TimeoutError:
                log.warning("env workers: the warm process (pid %s) forked none within %.0f s; killed, each worker "
                            "starts on its own", self.pid, self.startup_s)
                self.usable = False
                await self.close()
                return None
            if pid < 0:  # the warm process ended before it forked this one
                self._gave_up(-pid)
                return None
            self._forked[pid] = forked = Forked(pid)
            return forked

    async def _start(self) -> bool:
        if self.starts >= MAX_STARTS:
            log.warning("env workers: the warm process ended %d times; each worker starts on its own", self.starts)
            self.usable = False
            return False
        self.starts += 1
        if self._writer is not None:  # the last one's socket
            self._writer.close()
        ours, theirs = socket.socketpair()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "env-worker", *self.argv,
                "--forks", str(theirs.fileno()), env=child_env(self.env), pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self._reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self._pids = asyncio.Queue()  # not a reply of the last one
        self._listening = asyncio.create_task(self._listen(self._proc, self._reader, self._pids))
        log.info("env workers: forked from a warm process (pid %d) that imports verifiers once", self._proc.pid)
        return True

    async def _listen(self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader,
                      pids: asyncio.Queue[int]) -> None:
        """Read the warm process's replies until it ends; then every worker it forked is ended (they died with it)
        and a request waiting for a fork gets the process's status (as a negative pid)."""
        forked_any = False
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                msg = orjson.loads(line)
                if "pid" in msg:
                    forked_any = True
                    pids.put_nowait(int(msg["pid"]))
                elif (child := self._forked.pop(int(msg["exit"]), None)) is not None:
                    child.ended(int(msg["status"]))
        status = await proc.wait()
        for child in self._forked.values():
            child.ended(KILLED_WITH_IT)
        self._forked.clear()
        if not forked_any:
            self.usable = False
        pids.put_nowait(-(abs(status) or 1))

    def _gave_up(self, status: int) -> None:
        if not self.usable:
            log.warning("env workers: the warm process exited (status %d) before it forked one; each worker starts "
                        "on its own (its errors follow)", status)
        else:
            log.warning("env workers: the warm process exited (status %d); starting another", status)

    async def close(self, grace_s: float = 5.0) -> None:
        """End the warm process (its workers were stopped first): SIGTERM (it saves nothing; one still importing
        reads no socket), then SIGKILL after ``grace_s``."""
        if self._writer is not None:
            self._writer.close()
        if self._proc is not None:
            await terminate(self._proc, grace_s)
        if self._listening is not None:
            await self._listening
        self._proc = self._reader = self._writer = self._listening = None
