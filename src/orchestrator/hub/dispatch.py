"""What the hub does with each message a worker sends, decoded once at the edge (protocol.py).

A worker says ``hello`` and is sent ``setup``; it reports ``ready`` (with the tasks of each environment, and in
direct mode its column pool); then ``records`` and heartbeats. Nothing a worker sends can stop the hub: an
invalid message is a counted rejection naming the worker, a strike for a known one (roster.py). A record counts
only when it comes from the worker its group was assigned to, for a rollout still in flight there (intake.py);
a straggler of a cancelled group, or of a worker that was lost, counts as ``late``. Only the processes this hub
started are admitted, by name and pid, unless remote workers are expected. A worker's ``fatal`` ends that
worker, not the job, unless no worker is ready and every worker that tried has failed to load the environments
(counting only workers this hub started, by pid, unless remote workers are expected): then ``fail`` gets an
EnvironmentLoadError.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from orchestrator.contracts.events import HubEvent, RecordsIn
from orchestrator.contracts.protocol import (
    Fatal,
    Heartbeat,
    Hello,
    Ready,
    Records,
    Setup,
    decode_worker_message,
    split_records,
)
from orchestrator.errors import EnvironmentLoadError, WireError
from orchestrator.hub.intake import sort_records
from orchestrator.hub.roster import Roster, WorkerState

if TYPE_CHECKING:
    from orchestrator.hub.local import LocalWorkers
    from orchestrator.hub.pools import PoolKeeper

log = logging.getLogger(__name__)


class Dispatch:
    """Consumes worker messages (``handle``, the router's reader callback: never waits); produces ``RecordsIn``
    on ``events``, sets ``ready`` when a worker becomes ready, and keeps ``tasks_per_env`` (updated in place)."""

    def __init__(self, roster: Roster, *, setup: Setup, tasks_per_env: dict[str, int], events: asyncio.Queue[HubEvent],
                 metrics: Counter[str], ready: asyncio.Event, fail: Callable[[BaseException], None],
                 expected: int, local: int) -> None:
        """``expected``: the workers (local + remote) the job waits for; ``local`` of them this hub starts."""
        self.roster = roster
        self.pools: PoolKeeper = roster.pools
        self.procs: LocalWorkers = roster.procs
        self.setup = setup
        self.tasks_per_env = tasks_per_env
        self.events = events
        self.metrics = metrics
        self.ready = ready
        self.fail = fail
        self.expected = expected
        self.local = local
        self.load_failures = 0  # fatal reports while no worker was ready

    def handle(self, ident: bytes, frames: list[Any]) -> None:
        roster = self.roster
        if ident in roster.banned:
            self.metrics["rejected:dropped_worker"] += 1
            return
        worker = roster.workers.get(ident)
        try:
            msg = decode_worker_message(frames[0].buffer)
        except WireError as e:
            roster.reject(worker, ident, "undecodable", str(e))
            return
        if isinstance(msg, Hello):
            self._hello(ident, msg)
        elif worker is None:
            self._unknown(ident, msg)
        else:
            worker.last_seen = asyncio.get_running_loop().time()
            if isinstance(msg, Records):
                self._records(worker, msg, [f.buffer for f in frames[1:]])
            elif isinstance(msg, Heartbeat):
                worker.rss_mb = msg.rss_mb
                self.pools.heartbeat(worker.name, worker.ident, msg.pool_free)
            elif isinstance(msg, Ready):
                self._on_ready(worker, msg)
            elif isinstance(msg, Fatal):
                self._fatal(worker, msg)

    def _unknown(self, ident: bytes, msg: Any) -> None:
        """A message, not a hello, from an identity that is not a worker now."""
        roster = self.roster
        if isinstance(msg, Heartbeat):  # a worker we forgot (silent for a while, or our predecessor's)
            log.info("env worker %s is back: sending setup to re-admit it", msg.worker)
            self._hello(ident, Hello(msg.worker))
        elif isinstance(msg, Records) and ident in roster.lost:  # rollouts of a worker that froze
            late = roster.lost[ident]
            n = sum(h.rid in late for h in msg.records)
            self.metrics["late"] += n
            self.pools.unused(ident, [h for h in msg.records if h.rid in late])
            self.pools.left(ident)  # not connected: a release it could not take waits for its resync
            if n < len(msg.records):
                roster.reject(None, ident, "unassigned", f"{len(msg.records) - n} records of a lost worker "
                              "for rollouts that were not in flight on it")
        else:
            roster.reject(None, ident, "no_hello", f"{type(msg).__name__.lower()} before hello")

    def _hello(self, ident: bytes, msg: Hello) -> None:
        roster = self.roster
        if self.expected <= self.local and (not self.procs.is_ours(msg.worker, msg.pid)
                                            or ident != msg.worker.encode()):
            # no remote worker is expected: only the processes this hub started are workers
            roster.reject(None, ident, "unknown_worker", f"hello from {msg.worker!r} (pid {msg.pid}), which this "
                          "orchestrator did not start (scheduler.remote_workers = 0)")
            return
        old = roster.workers.pop(ident, None)
        if old is not None and old.rids:  # restarted under the same name: its rollouts are gone
            roster.lose(old, "restarted")
        state = roster.workers[ident] = WorkerState(ident, msg.worker, msg.pid)
        state.late = roster.lost.pop(ident, state.late)  # a lost worker back: its stragglers are late
        roster.send(ident, self.setup)

    def _on_ready(self, worker: WorkerState, msg: Ready) -> None:
        if self.tasks_per_env and msg.envs != self.tasks_per_env:
            self.roster.strike(worker, "ready_mismatch", f"reports tasks {msg.envs}, others {self.tasks_per_env}")
            return
        worker.ready = True
        worker.pool = msg.pool
        self.pools.ready(worker.name, worker.ident, msg.pool)
        self.procs.became_ready(worker.name)
        self.tasks_per_env.clear()
        self.tasks_per_env.update(msg.envs)
        self.load_failures = 0
        log.info("env worker %s ready (%s)", worker.name, ", ".join(f"{k}: {v} tasks" for k, v in msg.envs.items()))
        self.ready.set()

    def _fatal(self, worker: WorkerState, msg: Fatal) -> None:
        self.metrics["fatal"] += 1
        log.error("env worker %s cannot go on: %s", worker.name, msg.error)
        self.roster.lose(worker, f"fatal: {msg.error}", pool_gone=True)
        ours = worker.pid is not None and worker.pid in self.procs.pids().values()
        if any(w.ready for w in self.roster.workers.values()) or not (ours or self.expected > self.local):
            return  # only a worker we started (or, when remote ones are expected, any) can end the job
        self.load_failures += 1
        if self.load_failures >= self.expected:
            self.fail(EnvironmentLoadError(f"env worker {worker.name}: {msg.error}"))

    def _records(self, worker: WorkerState, msg: Records, frames: list[memoryview]) -> None:
        if not worker.ready:
            self.roster.strike(worker, "records_before_ready", f"records of group {msg.group} before ready")
            return
        try:
            records = split_records(msg, frames)
        except WireError as e:  # the group's rollouts stay in flight; the group timeout fails them
            self.roster.strike(worker, "bad_frames", str(e))
            return
        got = sort_records(worker.rids, worker.late, msg.group, records, worker.pool)
        self.metrics["late"] += got.late
        for why, detail in got.problems:
            self.roster.reject(worker, worker.ident, why, detail)
        self.pools.unused(worker.ident, got.unused)
        for record in got.accepted:
            record.header.worker = worker.name
            self.pools.passed_on(record.header)
        worker.completed += len(got.accepted)
        if got.accepted:
            self.events.put_nowait(RecordsIn(worker.name, got.accepted))
