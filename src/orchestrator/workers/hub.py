"""The orchestrator's side of the env workers: one ZMQ ROUTER, local worker processes, supervision.

Workers connect (local ones are started here; remote ones by hand with ``orchestrator env-worker``), say
``hello``, get the environments in a ``setup`` message and report ``ready``. ``assign`` sends a group to the
ready worker with the fewest rollouts in flight. ``run()`` consumes worker messages and produces events on
``events`` for the scheduler: ``RecordsIn`` (finished rollouts) and ``WorkerLost`` (the rollouts of a worker
that died, froze or was dropped). It wakes when the socket is readable and every HEARTBEAT_S to supervise.

Every message is decoded once, at the edge, into a typed struct (protocol.py). Nothing a worker sends can
stop the hub: the reader callback never raises; an invalid message is a counted rejection naming the worker
(``metrics["rejected:<why>"]``; ``metrics["messages"]`` counts every message), and a worker whose invalid
messages reach MAX_STRIKES is dropped (its
rollouts fail with ``worker_died``; a local one is killed and restarted; its name is not admitted again). A
record counts only when it comes from the worker its group was assigned to, for a rollout still in flight
there; a straggler of a cancelled group is counted as ``late``. A worker's ``fatal`` ends that worker (a
local one is restarted, backing off), not the job, unless no worker is ready and every worker that tried
has failed to load the environments (counting only workers this hub started, by pid, unless remote workers
are expected): then ``run()`` raises EnvironmentLoadError.

Only the processes this hub started are admitted, by name and pid, unless ``scheduler.remote_workers`` says
remote workers are expected (then anyone who can connect may register: over tcp:// that is only holders of
an authorized CURVE key, over ipc:// whoever may open the socket file).

Supervision: a ready worker silent for ``scheduler.worker_silence_s`` (one still loading its environments:
LOAD_TIMEOUT_S) is lost: its rollouts fail with ``worker_died`` at once, and the log names it. A local one is
killed (SIGKILL, which also ends a stopped process) and restarted under its name (local.py: at once, or
backing off while restarts fail before ready). A remote one is not ours to kill: when it speaks again (e.g.
after SIGCONT) it is sent ``setup`` and re-admitted when it answers ``ready``; the records it had in flight
when it was lost count as ``late``, not as invalid messages. Records are sorted by intake.py. A local one not
ready yet is watched through its process (local.py): stopped for ``worker_silence_s``, or not connected
within local.STARTUP_S, it is killed and restarted too. ``wait_ready`` names what it waits for every
``monitor.stall_warn_s``.

Data plane (``data_plane = "direct"``, docs/data-plane.md; pools.py's ``PoolKeeper`` does it for the hub): a
worker's ``ready`` names its column pool, and a record's ``span`` must lie in that pool (the one it announced
last), else the record is corrupt (a strike; its rollout fails). The spans of records the hub does not pass on
(corrupt, late) are released at once; those it passes on are released when the scheduler or the step drops
them, or the trainer acknowledges their step (``release``). A worker re-admitted with the same pool is told
what to keep (``Release(keep=...)``); a pool that is replaced, or whose worker process is gone, is reported as
``PoolGone`` (its buffered rollouts cannot train). A worker whose heartbeat says its pool has no room for its
largest rollout gets no new group until it has.

``events`` has no maxsize (the reader callback cannot wait, and dropping an event would lose rollouts); what
bounds it: ``RecordsIn`` and ``WorkerLost`` carry only rollouts in flight (a record is admitted only for a
rollout in flight on its worker and leaves it; a lost worker's rollouts are reported once), and the scheduler
keeps at most ``scheduler.max_inflight`` rollouts in flight, counting those whose events are still queued
here, so at most that many of these events are ever queued, whatever the consumer does. ``PoolGone`` (direct
mode) comes once per pool a worker announced (in its ``ready``) or held when its process went; it is bounded by
its consumer, the scheduler's intake, which waits on nothing but this queue and empties it each time it runs
(meanwhile at most the events of one DRAIN_MAX slice of messages, or of one supervision round, queue up).

Per-rollout cost on the loop is what limits how many workers one orchestrator feeds, so the socket is a
plain (sync) ZMQ socket read from a loop reader callback that drains up to DRAIN_MAX messages per
wake-up (no future per message), sends never wait (NOBLOCK), and only the small msgpack header of a
record is decoded here; column frames stay zero-copy buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import zmq

from orchestrator import ipc
from orchestrator.columns.pools import PoolKeeper
from orchestrator.errors import EnvironmentLoadError, TransportError, WireError, WorkerError
from orchestrator.security import LOCAL_KEYS_ENV, ServerKeys, curve_server
from orchestrator.workers.events import HubEvent, RecordsIn, WorkerLost
from orchestrator.workers.intake import sort_records
from orchestrator.workers.local import LocalWorkers
from orchestrator.workers.protocol import (
    HEARTBEAT_S,
    Assign,
    Cancel,
    Fatal,
    Heartbeat,
    Hello,
    PoolInfo,
    Ready,
    Records,
    RolloutRecord,
    Setup,
    Stop,
    decode_worker_message,
    pack,
    split_records,
)

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 300.0  # a worker that said hello loads its environments (importing verifiers, ...) within this
DRAIN_MAX = 16  # messages handled per reader wake-up before other callbacks get the loop
MAX_STRIKES = 20  # invalid messages after which a worker is dropped
LATE_KEPT = 4096  # cancelled rollout ids remembered per worker, so their stragglers count as late, not forged
LOST_KEPT = 64  # lost workers whose in-flight rollout ids are remembered, so their stragglers count as late
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # plain ints: no enum cost


@dataclass
class WorkerState:
    ident: bytes
    name: str
    pid: int | None = None
    ready: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    rids: dict[str, str] = field(default_factory=dict)  # rollouts in flight on it -> their group
    late: deque[str] = field(default_factory=lambda: deque(maxlen=LATE_KEPT))  # cancelled rollout ids
    strikes: int = 0
    completed: int = 0
    rss_mb: float | None = None
    pool: PoolInfo | None = None  # data_plane = direct: the column pool it announced last


class WorkerHub:
    def __init__(self, sock: zmq.Socket[bytes], address: str, setup: Setup, local: int, remote: int = 0,
                 env_vars: dict[str, str] | None = None, nice: int = 0, silence_s: float = 10 * HEARTBEAT_S,
                 span_address: str | None = None) -> None:
        """Use ``open``; ``env_vars`` go to local workers (with their CURVE keys when the socket has some)."""
        self.sock = sock
        self.silence_s = silence_s
        self.address = address
        self.setup = setup
        self.local = local
        self.remote = remote
        self.expected = max(local + remote, 1)
        self.procs = LocalWorkers(address, dict(env_vars or {}), nice, span_address)
        self.workers: dict[bytes, WorkerState] = {}
        self.tasks_per_env: dict[str, int] = {}
        self.events: asyncio.Queue[HubEvent] = asyncio.Queue()  # no maxsize: what bounds it, module docstring
        # rejected:<why>, late, dropped, lost, fatal, restarts; direct: released, pools_gone, pool_full
        self.metrics: Counter[str] = Counter()
        self._lost: dict[bytes, deque[str]] = {}  # lost workers -> their rollout ids that will come back late
        self._load_failures = 0  # fatal reports while no worker was ready
        self._banned: set[bytes] = set()
        self._ready = asyncio.Event()
        self.pools = PoolKeeper(self._send, self.events, self.metrics)  # direct: spans held, releases, room
        self._failed: asyncio.Future[None] | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, address: str, setup: Setup, local: int, remote: int = 0,
                   env_vars: dict[str, str] | None = None, nice: int = 0,
                   server_keys: ServerKeys | None = None, silence_s: float = 10 * HEARTBEAT_S,
                   span_address: str | None = None) -> AsyncIterator[WorkerHub]:
        """Bind ``address`` (a CURVE server with ``server_keys``: only their authorized clients get in) and
        start ``local`` worker processes (niceness + ``nice``; direct mode: serving their pools' spans at
        ``span_address``, tcp://HOST:0); on exit stop them (by pid) and close. A ready worker silent for
        ``silence_s`` is lost (module docstring).

        Local workers of a CURVE hub get a key pair made for the run (never on disk), through their
        environment."""
        ctx = zmq.Context()
        env = dict(env_vars or {})
        with contextlib.ExitStack() as stack:
            stack.callback(ctx.term)  # last: after the authenticator stopped and the socket closed
            sock = ctx.socket(zmq.ROUTER)
            if server_keys is not None:
                public, secret = zmq.curve_keypair()
                server_keys = dataclasses.replace(server_keys, authorized=server_keys.authorized | {public})
                stack.enter_context(curve_server(ctx, server_keys)).secure(sock)
                env.update(zip(LOCAL_KEYS_ENV, (server_keys.keys.public.decode(), public.decode(), secret.decode()),
                               strict=True))
            stack.callback(sock.close)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            try:
                ipc.prepare(address)
                sock.bind(address)
            except zmq.ZMQError as e:
                raise TransportError(f"cannot bind the env workers' address {address}: {e}") from None
            stack.callback(ipc.remove, address)  # libzmq leaves the file (orchestrator.ipc); after sock.close
            hub = cls(sock, sock.getsockopt_string(zmq.LAST_ENDPOINT), setup, local, remote, env, nice, silence_s,
                      span_address)
            try:
                for _ in range(local):
                    await hub.procs.spawn()
                yield hub
            finally:
                await hub._stop_all()

    async def _stop_all(self) -> None:
        ready = set()
        for ident, w in self.workers.items():
            self._send(ident, Stop())
            if w.ready:
                ready.add(w.name)
            w.ready = False
        # one still loading reads no message until it is ready, seconds later: a local one is signalled now
        await self.procs.stop(ready)  # all at once, bounded in total

    async def wait_ready(self, n: int, timeout_s: float, warn_s: float) -> None:
        """Wait until ``n`` workers are ready, saying what it waits for (``waiting_for``) every ``warn_s``
        (the liveness rule: monitor.stall_warn_s); WorkerError naming what is missing after ``timeout_s``."""
        start = warned = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                while (ready := self.ready_count()) < n:
                    self._ready.clear()
                    try:  # not wait_for: on 3.11 it can swallow a cancel
                        async with asyncio.timeout(max(warned + warn_s - time.monotonic(), 0.0)):
                            await self._ready.wait()
                    except TimeoutError:
                        warned = time.monotonic()
                        log.warning("env workers: %d of %d ready after %.0f s; waiting for %s", ready, n,
                                    warned - start, self.waiting_for())
        except TimeoutError:
            raise WorkerError(f"{self.ready_count()} of {n} env workers ready after {timeout_s:.0f} s at "
                              f"{self.address} ({self.metrics['restarts']} local restarts); waiting for "
                              f"{self.waiting_for()}; see the env workers' logs") from None

    def ready_count(self) -> int:
        return sum(w.ready for w in self.workers.values())

    def waiting_for(self) -> str:
        """The workers that are not ready, in a clause: each local one (local.py: ``not_ready``), then the
        remote ones expected and how many of them are connected."""
        parts = self.procs.not_ready({w.name: w.ready for w in self.workers.values()}, time.monotonic())
        if self.remote:
            remote = [w for w in self.workers.values() if w.name not in self.procs.procs]
            parts.append(f"{self.remote} remote at {self.address} ({len(remote)} connected, "
                         f"{sum(w.ready for w in remote)} ready)")
        return "; ".join(parts) or "nothing (all ready)"

    # --------------------------------------------------------------------------------------- messages

    async def run(self) -> None:
        """Receive worker messages (reader callback) and supervise workers until cancelled; raises
        EnvironmentLoadError when no worker can load the environments."""
        loop = asyncio.get_running_loop()
        self._failed = loop.create_future()
        fd = self.sock.fileno()
        loop.add_reader(fd, self._drain)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._supervise())
                loop.call_soon(self._drain)  # messages queued before the reader was registered
                await self._failed
        finally:
            loop.remove_reader(fd)
            self._failed = None  # the reader's callbacks are this run's: a _drain still scheduled does nothing

    def _drain(self) -> None:
        """Handle queued messages. ZMQ's fd is edge-triggered: read until EVENTS has no POLLIN, in slices of
        DRAIN_MAX so a flood cannot hold the loop. Never raises: a message is handled or rejected."""
        for _ in range(DRAIN_MAX):
            if self._failed is None or self._failed.done() or not cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN:
                return
            try:
                ident, *frames = self.sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.metrics["messages"] += 1
            try:
                self._handle(ident.bytes, frames)
            except Exception:  # a bug here must not stop the hub, nor skip the rest of the drain
                self.metrics["rejected:internal_error"] += 1
                log.exception("internal error handling a message from worker %r", ident.bytes[:64])
        asyncio.get_running_loop().call_soon(self._drain)

    def _handle(self, ident: bytes, frames: list[Any]) -> None:
        if ident in self._banned:
            self.metrics["rejected:dropped_worker"] += 1
            return
        worker = self.workers.get(ident)
        try:
            msg = decode_worker_message(frames[0].buffer)
        except WireError as e:
            self._reject(worker, ident, "undecodable", str(e))
            return
        if isinstance(msg, Hello):
            self._hello(ident, msg)
            return
        if worker is None:
            if isinstance(msg, Heartbeat):  # a worker we forgot (silent for a while, or our predecessor's)
                log.info("env worker %s is back: sending setup to re-admit it", msg.worker)
                self._hello(ident, Hello(msg.worker))
            elif isinstance(msg, Records) and ident in self._lost:  # rollouts of a worker that froze
                late = self._lost[ident]
                n = sum(h.rid in late for h in msg.records)
                self.metrics["late"] += n
                self.pools.unused(ident, [h for h in msg.records if h.rid in late])
                self.pools.left(ident)  # not connected: a release it could not take waits for its resync
                if n < len(msg.records):
                    self._reject(None, ident, "unassigned", f"{len(msg.records) - n} records of a lost worker "
                                 "for rollouts that were not in flight on it")
            else:
                self._reject(None, ident, "no_hello", f"{type(msg).__name__.lower()} before hello")
            return
        worker.last_seen = time.monotonic()
        if isinstance(msg, Records):
            self._records(worker, msg, [f.buffer for f in frames[1:]])
        elif isinstance(msg, Heartbeat):
            worker.rss_mb = msg.rss_mb
            self.pools.heartbeat(worker.name, worker.ident, msg.pool_free)
        elif isinstance(msg, Ready):
            self._on_ready(worker, msg)
        elif isinstance(msg, Fatal):
            self._fatal(worker, msg)

    def _hello(self, ident: bytes, msg: Hello) -> None:
        if self.expected <= self.local and (not self.procs.is_ours(msg.worker, msg.pid)
                                            or ident != msg.worker.encode()):
            # no remote worker is expected: only the processes this hub started are workers
            self._reject(None, ident, "unknown_worker", f"hello from {msg.worker!r} (pid {msg.pid}), which this "
                         "orchestrator did not start (scheduler.remote_workers = 0)")
            return
        old = self.workers.pop(ident, None)
        if old is not None and old.rids:  # restarted under the same name: its rollouts are gone
            self._lose(old, "restarted")
        state = self.workers[ident] = WorkerState(ident, msg.worker, msg.pid)
        state.late = self._lost.pop(ident, state.late)  # a lost worker back: its stragglers are late
        self._send(ident, self.setup)

    def _on_ready(self, worker: WorkerState, msg: Ready) -> None:
        if self.tasks_per_env and msg.envs != self.tasks_per_env:
            self._strike(worker, "ready_mismatch", f"reports tasks {msg.envs}, others {self.tasks_per_env}")
            return
        worker.ready = True
        worker.pool = msg.pool
        self.pools.ready(worker.name, worker.ident, msg.pool)
        self.procs.became_ready(worker.name)
        self.tasks_per_env = dict(msg.envs)
        self._load_failures = 0
        log.info("env worker %s ready (%s)", worker.name, ", ".join(f"{k}: {v} tasks" for k, v in msg.envs.items()))
        self._ready.set()

    def _fatal(self, worker: WorkerState, msg: Fatal) -> None:
        self.metrics["fatal"] += 1
        log.error("env worker %s cannot go on: %s", worker.name, msg.error)
        self._lose(worker, f"fatal: {msg.error}", pool_gone=True)
        ours = worker.pid is not None and worker.pid in self.procs.pids().values()
        if any(w.ready for w in self.workers.values()) or not (ours or self.expected > self.local):
            return  # only a worker we started (or, when remote ones are expected, any) can end the job
        self._load_failures += 1
        if self._load_failures >= self.expected and self._failed is not None and not self._failed.done():
            self._failed.set_exception(EnvironmentLoadError(f"env worker {worker.name}: {msg.error}"))

    def _records(self, worker: WorkerState, msg: Records, frames: list[memoryview]) -> None:
        if not worker.ready:
            self._strike(worker, "records_before_ready", f"records of group {msg.group} before ready")
            return
        try:
            records = split_records(msg, frames)
        except WireError as e:  # the group's rollouts stay in flight; the group timeout fails them
            self._strike(worker, "bad_frames", str(e))
            return
        got = sort_records(worker.rids, worker.late, msg.group, records, worker.pool)
        self.metrics["late"] += got.late
        for why, detail in got.problems:
            self._reject(worker, worker.ident, why, detail)
        self.pools.unused(worker.ident, got.unused)
        for record in got.accepted:
            record.header.worker = worker.name
            self.pools.passed_on(record.header)
        worker.completed += len(got.accepted)
        if got.accepted:
            self.events.put_nowait(RecordsIn(worker.name, got.accepted))

    def release(self, records: Sequence[RolloutRecord]) -> None:
        """The spans of these records (passed on earlier) will never be read: dropped by the scheduler or the
        step, or their step was acknowledged. One ``Release`` per worker; each span is released once; a span
        of a pool that is gone, or a record without one, is skipped."""
        self.pools.release(records, {w.name: w.ident for w in self.workers.values()})

    def _reject(self, worker: WorkerState | None, ident: bytes, why: str, detail: str) -> None:
        if worker is not None and why != "unassigned":
            self._strike(worker, why, detail)
            return
        self.metrics[f"rejected:{why}"] += 1
        name = worker.name if worker is not None else repr(ident[:64])
        log.warning("rejected a message from env worker %s: %s", name, detail)

    def _strike(self, worker: WorkerState, why: str, detail: str) -> None:
        """Count an invalid message; drop the worker at MAX_STRIKES."""
        self.metrics[f"rejected:{why}"] += 1
        worker.strikes += 1
        log.warning("rejected a message from env worker %s (%d of %d allowed): %s", worker.name, worker.strikes,
                    MAX_STRIKES, detail)
        if worker.strikes >= MAX_STRIKES:
            log.error("env worker %s sent %d invalid messages: dropped", worker.name, worker.strikes)
            self.metrics["dropped"] += 1
            self._banned.add(worker.ident)
            self._send(worker.ident, Stop())
            self._lose(worker, "dropped for invalid messages", pool_gone=True)
            self.procs.kill(worker.name)

    def _send(self, ident: bytes, msg: Any) -> bool:
        """Send without waiting; False (and a warning) when the worker is gone or not keeping up."""
        try:
            self.sock.send_multipart([ident, pack(msg)], _NOBLOCK)
        except zmq.ZMQError as e:  # gone or its queue is full: supervision deals with its rollouts
            log.warning("could not reach env worker %r: %s", ident[:64], e)
            return False
        finally:  # a send can swallow the fd's edge for messages that arrived meanwhile
            if self._failed is not None:
                asyncio.get_running_loop().call_soon(self._drain)
        return True

    # ----------------------------------------------------------------------------------- supervision

    async def _supervise(self) -> None:
        """Every HEARTBEAT_S: lose silent workers (killing local ones), kill local ones stuck starting (local.py:
        ``starting``), restart local workers that exited."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            now = time.monotonic()
            for w in list(self.workers.values()):
                # a worker heartbeats once it is ready; before, it is importing and loading (blocking calls)
                silent, limit = now - w.last_seen, self.silence_s if w.ready else LOAD_TIMEOUT_S
                if silent > limit:
                    pid = self.procs.alive(w.name)
                    then = (f"killed (pid {pid}) to be restarted" if pid is not None
                            else "re-admitted if it speaks again")
                    log.error("env worker %s silent for %.0f s%s: lost, %d rollouts in flight fail; %s", w.name,
                              silent, "" if w.ready else " while loading its environments", len(w.rids), then)
                    self._lose(w, f"silent for {silent:.0f} s", pool_gone=pid is not None)
                    self.procs.kill(w.name)
            self._kill_stuck(now)
            for name, status in self.procs.exited(now):
                worker = next((w for w in self.workers.values() if w.name == name), None)
                if worker is not None:
                    self._lose(worker, f"exited with status {status}", pool_gone=True)
                else:  # lost before (silent), now dead too
                    self.pools.gone(name, f"its process exited with status {status}")
            restarted = await self.procs.restart_due(now)
            self.metrics["restarts"] += len(restarted)
            for name in restarted:
                self._banned.discard(name.encode())  # a fresh process under the name of one that was dropped

    def _kill_stuck(self, now: float) -> None:
        """Local workers not ready yet whose process is stopped, or that never connected: lost and killed (the
        supervision loop restarts them as they exit)."""
        by_name = {w.name: w for w in self.workers.values()}
        for name, why in self.procs.starting(now, by_name.keys(), self.silence_s).items():
            log.error("env worker %s (pid %s) %s: lost; killed to be restarted", name, self.procs.alive(name), why)
            worker = by_name.get(name)
            if worker is not None:
                self._lose(worker, why, pool_gone=True)
            self.procs.kill(name)

    def _lose(self, worker: WorkerState, why: str, *, pool_gone: bool = False) -> None:
        """Forget ``worker``; its in-flight rollouts go to the scheduler as lost. ``pool_gone``: its process is
        gone too (killed, exited, dropped), and so is its column pool (a silent remote worker may come back
        with it)."""
        if pool_gone:
            self.pools.gone(worker.name, why)
        if self.workers.get(worker.ident) is worker:
            del self.workers[worker.ident]
            self.pools.left(worker.ident)
        self.metrics["lost"] += 1
        worker.late.extend(worker.rids)
        self._lost[worker.ident] = worker.late
        while len(self._lost) > LOST_KEPT:
            del self._lost[next(iter(self._lost))]
        if worker.rids:
            self.events.put_nowait(WorkerLost(worker.name, sorted(worker.rids), why))
            worker.rids.clear()

    # ------------------------------------------------------------------------------------- assignment

    def _assignable(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.ready and self.pools.has_room(w.name)]

    def has_ready(self) -> bool:
        """Whether a worker can take a group now: ready, and (direct) room in its column pool."""
        return any(w.ready and self.pools.has_room(w.name) for w in self.workers.values())

    def assign(self, msg: Assign) -> str:
        """Send a group to the ready worker (with room in its pool) with the fewest rollouts in flight; returns
        its name."""
        ready = self._assignable()
        if not ready:
            raise RuntimeError("assign() with no ready worker: check has_ready() first")
        worker = min(ready, key=lambda w: len(w.rids))
        worker.rids.update(dict.fromkeys(msg.rids, msg.group))
        self._send(worker.ident, msg)
        return worker.name

    def cancel(self, group: str, rids: list[str]) -> None:
        for w in self.workers.values():
            held = [rid for rid in rids if w.rids.get(rid) == group]
            if held:
                for rid in held:
                    del w.rids[rid]
                w.late.extend(held)
                self._send(w.ident, Cancel(group))

    def worker_stats(self) -> dict[str, tuple[int, float | None]]:
        """Per worker: rollouts completed so far and its last reported RSS in MB."""
        return {w.name: (w.completed, w.rss_mb) for w in self.workers.values()}

    def local_pids(self) -> dict[str, int]:
        """The pid of each local worker process by name (the current one, after restarts)."""
        return self.procs.pids()

