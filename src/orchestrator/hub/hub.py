"""The orchestrator's side of the env workers: one ZMQ ROUTER, local worker processes, supervision.

Workers connect (local ones are started here; remote ones by hand with ``orchestrator env-worker``), say
``hello``, get the environments in a ``setup`` message and report ``ready``. ``assign`` sends a group to the
ready worker with the fewest rollouts in flight. ``run()`` consumes worker messages and produces events on
``events`` for the scheduler: ``RecordsIn`` (finished rollouts) and ``WorkerLost`` (the rollouts of a worker
that died, froze or was dropped). It wakes when the socket is readable and every HEARTBEAT_S to supervise.
``WorkerHub`` is the face; its parts are the socket (router.py: binding, CURVE, the reader callback), the
workers it knows and their strikes (roster.py), what each message does (dispatch.py) and supervision
(supervision.py).

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

Supervision (supervision.py): a ready worker silent for ``scheduler.worker_silence_s`` (one still loading its
environments: LOAD_TIMEOUT_S) is lost: its rollouts fail with ``worker_died`` at once; a local one is killed
and restarted under its name, a remote one re-admitted when it speaks again. Records are sorted by intake.py.
``wait_ready`` names what it waits for every ``monitor.stall_warn_s``.

The direct data plane (docs/data-plane.md; pools.py's ``PoolKeeper`` does it for the hub): a
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

Per-rollout cost on the loop is what limits how many workers one orchestrator feeds (router.py): the socket is
read from a loop reader callback, sends never wait, and only the small msgpack header of a record is decoded
here; column frames stay zero-copy buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import zmq

from orchestrator.contracts.events import HubEvent
from orchestrator.contracts.protocol import HEARTBEAT_S, Assign, Cancel, RolloutRecord, Setup, Stop
from orchestrator.hub import router
from orchestrator.hub.dispatch import Dispatch
from orchestrator.hub.local import LocalWorkers
from orchestrator.hub.pools import PoolKeeper
from orchestrator.hub.roster import MAX_STRIKES, Roster, WorkerState
from orchestrator.hub.supervision import LOAD_TIMEOUT_S, Supervisor
from orchestrator.security import ServerKeys

__all__ = ["LOAD_TIMEOUT_S", "MAX_STRIKES", "WorkerHub", "WorkerState"]


class WorkerHub:
    def __init__(self, sock: zmq.Socket[bytes], address: str, setup: Setup, local: int, remote: int = 0,
                 env_vars: dict[str, str] | None = None, nice: int = 0, silence_s: float = 10 * HEARTBEAT_S,
                 span_address: str | None = None) -> None:
        """Use ``open``; ``env_vars`` go to local workers (with their CURVE keys when the socket has some)."""
        self.address = address
        self.setup = setup
        self.local = local
        self.remote = remote
        self.expected = max(local + remote, 1)
        self.procs = LocalWorkers(address, dict(env_vars or {}), nice, span_address)
        self.tasks_per_env: dict[str, int] = {}
        self.events: asyncio.Queue[HubEvent] = asyncio.Queue()  # no maxsize: what bounds it, module docstring
        # messages, rejected:<why>, late, dropped, lost, fatal, restarts; direct: released, pools_gone, pool_full
        self.metrics: Counter[str] = Counter()
        self._ready = asyncio.Event()
        self._failed: asyncio.Future[None] | None = None
        self.router = router.Router(sock, self._handle, self.metrics)
        self.pools = PoolKeeper(self.router.send, self.events, self.metrics)  # direct: spans held, releases, room
        self.roster = Roster(self.router.send, self.events, self.metrics, self.pools, self.procs)
        self.workers = self.roster.workers
        self.dispatch = Dispatch(self.roster, setup=setup, tasks_per_env=self.tasks_per_env, events=self.events,
                                 metrics=self.metrics, ready=self._ready, fail=self._fail, expected=self.expected,
                                 local=local)
        self.supervisor = Supervisor(self.roster, silence_s=silence_s, ready=self._ready, address=address,
                                     remote=remote)

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
        with router.bind(address, server_keys) as (sock, keys_env):
            hub = cls(sock, sock.getsockopt_string(zmq.LAST_ENDPOINT), setup, local, remote,
                      {**(env_vars or {}), **keys_env}, nice, silence_s, span_address)
            try:
                for _ in range(local):
                    await hub.procs.spawn()
                yield hub
            finally:
                await hub._stop_all()

    async def _stop_all(self) -> None:
        ready = set()
        for ident, w in self.workers.items():
            self.router.send(ident, Stop())
            if w.ready:
                ready.add(w.name)
            w.ready = False
        # one still loading reads no message until it is ready, seconds later: a local one is signalled now
        await self.procs.stop(ready)  # all at once, bounded in total

    async def run(self) -> None:
        """Receive worker messages (reader callback) and supervise workers until cancelled; raises
        EnvironmentLoadError when no worker can load the environments."""
        self._failed = asyncio.get_running_loop().create_future()
        try:
            with self.router.reading(self._failed):
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self.supervisor.run())
                    await self._failed
        finally:
            self._failed = None

    def _handle(self, ident: bytes, frames: list[object]) -> None:
        self.dispatch.handle(ident, frames)

    def _fail(self, error: BaseException) -> None:
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(error)

    async def wait_ready(self, n: int, timeout_s: float, warn_s: float) -> None:
        """Wait until ``n`` workers are ready (supervision.py: ``wait_ready``)."""
        await self.supervisor.wait_ready(n, timeout_s, warn_s)

    def ready_count(self) -> int:
        return self.roster.ready_count()

    def waiting_for(self) -> str:
        """The workers that are not ready, in a clause (supervision.py: ``waiting_for``)."""
        return self.supervisor.waiting_for()

    # ------------------------------------------------------------------------------------- assignment

    def has_ready(self) -> bool:
        """Whether a worker can take a group now: ready, and (direct) room in its column pool."""
        return any(w.ready and self.pools.has_room(w.name) for w in self.workers.values())

    def assign(self, msg: Assign) -> str:
        """Send a group to the ready worker (with room in its pool) with the fewest rollouts in flight; returns
        its name."""
        ready = self.roster.assignable()
        if not ready:
            raise RuntimeError("assign() with no ready worker: check has_ready() first")
        worker = min(ready, key=lambda w: len(w.rids))
        worker.rids.update(dict.fromkeys(msg.rids, msg.group))
        self.router.send(worker.ident, msg)
        return worker.name

    def cancel(self, group: str, rids: list[str]) -> None:
        for w in self.workers.values():
            held = [rid for rid in rids if w.rids.get(rid) == group]
            if held:
                for rid in held:
                    del w.rids[rid]
                w.late.extend(held)
                self.router.send(w.ident, Cancel(group))

    def release(self, records: Sequence[RolloutRecord]) -> None:
        """The spans of these records (passed on earlier) will never be read: dropped by the scheduler or the
        step, or their step was acknowledged. One ``Release`` per worker; each span is released once; a span
        of a pool that is gone, or a record without one, is skipped."""
        self.pools.release(records, {w.name: w.ident for w in self.workers.values()})

    def worker_stats(self) -> dict[str, tuple[int, float | None]]:
        """Per worker: rollouts completed so far and its last reported RSS in MB."""
        return {w.name: (w.completed, w.rss_mb) for w in self.workers.values()}

    def local_pids(self) -> dict[str, int]:
        """The pid of each local worker process by name (the current one, after restarts)."""
        return self.procs.pids()
