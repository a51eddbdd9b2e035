"""The hub's end of the warm env worker (workers/zygote.py): start it, fork local workers from it, learn their exits.

``Forks.spawn(argv)`` returns a ``Forked`` (what ``LocalWorkers`` needs of an ``asyncio.subprocess.Process``:
``pid``, ``returncode``, ``wait``, ``send_signal``, ``kill``), or None when the warm process cannot fork one: it
exited, or did not answer in time (``startup_s`` while it warms up, FORK_S after: a broken install, a process
stopped or killed from outside). The caller then starts that worker on its own, as a plain process, so every
failure keeps the path (and the error messages) of a worker that cannot start. A warm process that fails before
it ever forked is not started again (each worker starts on its own from then on); one that dies later (its
workers die with it, and are restarted like any other) is started again at the next spawn, up to MAX_STARTS
times in a run. While the first fork waits for the warm-up, a WARNING every WARN_S names the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

import msgspec

from orchestrator.contracts.forks import Born, Fork, encode, replies
from orchestrator.procs import child_env, terminate

log = logging.getLogger(__name__)

MAX_STARTS = 3  # warm processes a run starts at most; then workers start on their own
FORK_S = 10.0  # a fork of a warm process that is ready takes milliseconds; past this it is stuck
WARN_S = 30.0  # the warm-up's wait is named this often
EXIT_S = 5.0  # a warm process whose socket ended has exited within this, or is killed
KILLED_WITH_IT = -signal.SIGKILL  # the status of a worker whose warm process died (its parent-death signal)


def env_worker_command(*args: str) -> list[str]:
    """The command line of a local env worker (or of the warm process) with ``args``."""
    return [sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "env-worker", *args]


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


class _Warm:
    """One warm process: its process, its socket, the workers it forked, and its replies in order."""

    def __init__(self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proc, self.reader, self.writer = proc, reader, writer
        self.forked: dict[int, Forked] = {}
        self.born: asyncio.Queue[Forked | None] = asyncio.Queue()  # None: it ended
        self.ever_forked = False
        self.listening = asyncio.create_task(self._listen())  # owned: awaited by Forks.close

    async def _listen(self) -> None:
        """Read the replies until the process ends; then every worker it forked is ended (they died with it)."""
        try:
            with contextlib.suppress(ConnectionError):  # reset: it exited with our requests unread
                while line := await self.reader.readline():
                    reply = replies.decode(line)
                    if isinstance(reply, Born):  # registered here: its Ended may be in the same read
                        self.ever_forked = True
                        self.forked[reply.pid] = child = Forked(reply.pid)
                        self.born.put_nowait(child)
                    elif (gone := self.forked.pop(reply.pid, None)) is not None:
                        gone.ended(reply.status)
        except msgspec.DecodeError as e:
            log.warning("env workers: the warm process (pid %d) said something unreadable (%s); killed", self.proc.pid,
                        e)
        finally:
            try:  # its socket ended: it is exiting (its status is kept), or it is killed now
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), EXIT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
            for child in self.forked.values():
                child.ended(KILLED_WITH_IT)
            self.born.put_nowait(None)


class Forks:
    """The warm process of one hub (see the module docstring). ``argv``: the ``env-worker`` arguments it is started
    with (``--connect``...: its command line names the run's worker address, as a worker's does); ``env``: the
    workers' environment variables; ``startup_s``: how long the first fork may take, warm-up included."""

    def __init__(self, argv: list[str], env: dict[str, str], startup_s: float) -> None:
        self.argv, self.env, self.startup_s = argv, env, startup_s
        self.starts = 0
        self.usable = True  # False once it failed for good, or was closed
        self._warm: _Warm | None = None
        self._lock = asyncio.Lock()  # one request at a time: replies come in order

    @property
    def pid(self) -> int | None:
        w = self._warm
        return None if w is None or w.proc.returncode is not None else w.proc.pid

    async def spawn(self, argv: list[str]) -> Forked | None:
        """A worker forked with ``argv``, or None (see the module docstring)."""
        async with self._lock:
            if not self.usable:
                return None
            if self.pid is None and not await self._start():
                return None
            w = self._warm
            assert w is not None
            w.writer.write(encode(Fork(argv)) + b"\n")
            child = await self._born(w)
            if child is None and w.ever_forked and self.usable:
                log.warning("env workers: the warm process (pid %d) ended (status %s); the next worker starts "
                            "another", w.proc.pid, w.proc.returncode)
            return child

    async def _born(self, w: _Warm) -> Forked | None:
        """The reply to the request just sent; None (and, past its time, the warm process killed) if none."""
        limit = FORK_S if w.ever_forked else self.startup_s
        waited = 0.0
        while waited < limit:
            step = min(WARN_S, limit - waited)
            try:
                async with asyncio.timeout(step):
                    child = await w.born.get()
            except TimeoutError:
                waited += step
                if waited < limit:
                    log.warning("env workers: the warm process (pid %d) has forked none after %.0f s (it imports "
                                "verifiers first: slower on a busy machine)", w.proc.pid, waited)
                continue
            if child is None and not w.ever_forked:
                self._give_up(f"exited (status {w.proc.returncode}) before it forked one")
            return child
        self._give_up(f"forked none within {limit:.0f} s; killed")
        await self.close()
        return None

    async def _start(self) -> bool:
        if self.starts >= MAX_STARTS:
            self._give_up(f"ended {self.starts} times")
            return False
        self.starts += 1
        if self._warm is not None:  # the last one's socket
            self._warm.writer.close()
        ours, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                *env_worker_command(*self.argv, "--forks", str(theirs.fileno())), env=child_env(self.env),
                pass_fds=(theirs.fileno(),))
            reader, writer = await asyncio.open_unix_connection(sock=ours)
        except OSError as e:
            ours.close()
            self._give_up(f"could not be started ({e})")
            return False
        finally:
            theirs.close()
        self._warm = _Warm(proc, reader, writer)
        log.info("env workers: a warm process (pid %d) imports verifiers once, then forks them", proc.pid)
        return True

    def _give_up(self, why: str) -> None:
        self.usable = False
        log.warning("env workers: the warm process %s; each worker starts on its own from now on", why)

    async def close(self, grace_s: float = 5.0) -> None:
        """End the warm process (its workers were stopped first; any left die with it): SIGTERM (it saves
        nothing; one still importing reads no socket), then SIGKILL after ``grace_s``. No fork after this."""
        self.usable = False
        w, self._warm = self._warm, None
        if w is None:
            return
        w.writer.close()
        await terminate(w.proc, grace_s)
        await w.listening
