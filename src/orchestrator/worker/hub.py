"""The orchestrator's side of the env workers: one ZMQ ROUTER, local worker processes, liveness.

Workers connect (local ones are started here; remote ones by hand with ``orchestrator env-worker``), get
the environments in a ``setup`` message and report ``ready``. ``assign`` sends a group to the ready
worker with the fewest rollouts in flight. ``run()`` consumes worker messages and produces calls to
``on_record`` (one per finished rollout) and ``on_lost`` (the rollouts of a worker that died); it wakes
when the socket is readable and every HEARTBEAT_S to check liveness. A worker silent for ``DEAD_AFTER_S``
is dead: its in-flight rollouts fail with reason ``worker_died`` and a local one is restarted.

Per-rollout cost on the loop is what limits how many workers one orchestrator feeds, so the socket is a
plain (sync) ZMQ socket read from a loop reader callback that drains up to DRAIN_MAX messages per
wake-up (no future per message), sends never wait (NOBLOCK), and only the small msgpack header of a
record is decoded here; column frames stay zero-copy buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import zmq

from orchestrator.errors import EnvironmentLoadError, TransportError, WireError
from orchestrator.procs import child_env, terminate
from orchestrator.worker.protocol import HEARTBEAT_S, RolloutRecord, pack, split_records, unpack

log = logging.getLogger(__name__)

DEAD_AFTER_S = 10 * HEARTBEAT_S
DRAIN_MAX = 16  # messages handled per reader wake-up before other callbacks get the loop
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # plain ints: no enum cost


@dataclass
class WorkerState:
    name: str
    ready: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    rids: set[str] = field(default_factory=set)  # rollouts in flight on it
    pid: int | None = None
    completed: int = 0
    proc: asyncio.subprocess.Process | None = None  # set for local workers


class WorkerHub:
    def __init__(self, sock: zmq.Socket[bytes], address: str, setup: dict[str, Any], local: int,
                 env_vars: dict[str, str], nice: int = 0) -> None:
        self.sock = sock
        self.address = address
        self.setup = setup
        self.local = local
        self.env_vars = env_vars
        self.nice = nice
        self.workers: dict[bytes, WorkerState] = {}
        self.tasks_per_env: dict[str, int] = {}
        self.on_record: Callable[[RolloutRecord], None] = lambda _r: None
        self.on_lost: Callable[[str, list[str]], None] = lambda _w, _rids: None
        self._ready = asyncio.Event()
        self._procs: list[asyncio.subprocess.Process] = []
        self._spawned = 0
        self.rejected = 0
        self._fatal: asyncio.Future[None] | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, address: str, setup: dict[str, Any], local: int,
                   env_vars: dict[str, str] | None = None, nice: int = 0) -> AsyncIterator[WorkerHub]:
        """Bind ``address`` and start ``local`` worker processes (niceness + ``nice``); on exit stop them
        (by pid) and close."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if address.startswith("ipc://"):
                Path(address.removeprefix("ipc://")).parent.mkdir(parents=True, exist_ok=True)
            sock.bind(address)
        except zmq.ZMQError as e:  # close both, or the context's finalizer hangs a later gc.collect()
            sock.close()
            ctx.term()
            raise TransportError(f"cannot bind the env workers' address {address}: {e}") from None
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        hub = cls(sock, address, setup, local, dict(env_vars or {}), nice)
        try:
            for _ in range(local):
                await hub._spawn()
            yield hub
        finally:
            await hub._stop_all()
            sock.close()
            ctx.term()

    async def _spawn(self) -> asyncio.subprocess.Process:
        name = f"local-{self._spawned}"
        self._spawned += 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "env-worker", "--connect", self.address,
            "--id", name, "--nice", str(self.nice), env=child_env(self.env_vars),
        )
        self._procs.append(proc)
        log.info("started env worker pid %d", proc.pid)
        return proc

    async def _stop_all(self) -> None:
        for ident, w in self.workers.items():
            self._send(ident, {"type": "stop"})
            w.ready = False
        for proc in self._procs:  # asked to stop above; killed if still there after 5 s
            await terminate(proc, 5.0, signal_first=False)

    async def wait_ready(self, n: int, timeout_s: float) -> None:
        """Wait until ``n`` workers are ready (raises EnvironmentLoadError from a worker's ``fatal``)."""
        async with asyncio.timeout(timeout_s):
            while sum(w.ready for w in self.workers.values()) < n:
                self._ready.clear()
                await self._ready.wait()

    # --------------------------------------------------------------------------------------- messages

    async def run(self) -> None:
        """Receive worker messages (reader callback) and check liveness until cancelled; raises
        EnvironmentLoadError when a worker reports ``fatal``."""
        loop = asyncio.get_running_loop()
        self._fatal = loop.create_future()
        fd = self.sock.fileno()
        loop.add_reader(fd, self._drain)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._liveness())
                loop.call_soon(self._drain)  # messages queued before the reader was registered
                await self._fatal
        finally:
            loop.remove_reader(fd)

    def _drain(self) -> None:
        """Handle queued messages. ZMQ's fd is edge-triggered: read until EVENTS has no POLLIN, in slices of
        DRAIN_MAX so a flood cannot hold the loop."""
        for _ in range(DRAIN_MAX):
            if self._fatal is None or self._fatal.done() or not cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN:
                return
            ident, *frames = self.sock.recv_multipart(_NOBLOCK, copy=False)
            try:
                self._handle(ident.bytes, frames)
            except EnvironmentLoadError as e:
                self._fatal.set_exception(e)
                return
        asyncio.get_running_loop().call_soon(self._drain)

    def _handle(self, ident: bytes, frames: list[Any]) -> None:
        try:
            msg = unpack(frames[0].buffer)
        except WireError as e:
            self.rejected += 1
            log.warning("rejected a message from worker %r: %s", ident, e)
            return
        worker = self.workers.get(ident)
        if worker is None:
            worker = self.workers[ident] = WorkerState(str(msg.get("worker", ident)), pid=msg.get("pid"))
        worker.last_seen = time.monotonic()
        kind = msg["type"]
        if kind == "records":
            self._records(worker, msg, [f.buffer for f in frames[1:]])
        elif kind == "hello":
            self._send(ident, {"type": "setup", **self.setup})
        elif kind == "ready":
            worker.ready = True
            self.tasks_per_env = dict(msg["envs"])
            log.info("env worker %s ready (%s)", worker.name, ", ".join(f"{k}: {v} tasks"
                                                                    for k, v in msg["envs"].items()))
            self._ready.set()
        elif kind == "fatal":
            raise EnvironmentLoadError(f"env worker {worker.name}: {msg.get('error')}")

    def _records(self, worker: WorkerState, msg: dict[str, Any], frames: list[memoryview]) -> None:
        try:
            records = split_records(msg, frames)
        except WireError as e:  # the group's rollouts stay in flight; the group timeout fails them
            self.rejected += 1
            log.warning("worker %s: %s", worker.name, e)
            return
        for record in records:
            try:
                record.check()
            except WireError as e:
                self.rejected += 1
                log.warning("worker %s: %s", worker.name, e)
                record.header.update(ok=False, error=f"corrupt_record: {e}", samples=[], tokens=0)
                record.frames = []
            worker.rids.discard(str(record.header.get("rid")))
            worker.completed += 1
            self.on_record(record)

    def _send(self, ident: bytes, msg: dict[str, Any]) -> bool:
        """Send without waiting; False (and a warning) when the worker is gone or not keeping up."""
        try:
            self.sock.send_multipart([ident, pack(msg)], _NOBLOCK)
        except zmq.ZMQError as e:  # gone or its queue is full: the liveness check deals with its rollouts
            log.warning("could not reach env worker %r: %s", ident, e)
            return False
        finally:  # a send can swallow the fd's edge for messages that arrived meanwhile
            if self._fatal is not None:
                asyncio.get_running_loop().call_soon(self._drain)
        return True

    async def _liveness(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if now - w.last_seen > DEAD_AFTER_S:
                    log.error("env worker %s silent for %.0f s: dead; %d rollouts in flight fail", w.name,
                              now - w.last_seen, len(w.rids))
                    self._lose(w.name)
            for i, proc in enumerate(self._procs):
                if proc.returncode is not None:
                    log.error("local env worker pid %d exited with %s; restarting it", proc.pid, proc.returncode)
                    self._procs.pop(i)
                    self._lose(f"local-pid-{proc.pid}")
                    await self._spawn()
                    break

    def _lose(self, name_or_pid: str) -> None:
        """Forget a worker that died; its in-flight rollouts fail with reason worker_died."""
        for ident, w in list(self.workers.items()):
            if name_or_pid in (w.name, f"local-pid-{w.pid}"):
                del self.workers[ident]
                self.on_lost(w.name, sorted(w.rids))

    # ------------------------------------------------------------------------------------- assignment

    def has_ready(self) -> bool:
        return any(w.ready for w in self.workers.values())

    async def assign(self, msg: dict[str, Any]) -> str:
        """Send a group to the ready worker with the fewest rollouts in flight; returns its name."""
        ready = [(ident, w) for ident, w in self.workers.items() if w.ready]
        if not ready:
            raise RuntimeError("assign() with no ready worker: check has_ready() first")
        ident, worker = min(ready, key=lambda iw: len(iw[1].rids))
        worker.rids.update(msg["rids"])
        self._send(ident, {"type": "assign", **msg})
        return worker.name

    async def cancel(self, group: str, rids: list[str]) -> None:
        for ident, w in self.workers.items():
            if w.rids & set(rids):
                w.rids.difference_update(rids)
                self._send(ident, {"type": "cancel", "group": group})

    def kill_local(self, index: int) -> int:
        """SIGKILL local worker ``index`` (fault tests); returns its pid."""
        proc = self._procs[index]
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        return proc.pid
