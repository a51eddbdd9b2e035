"""The workers the hub knows, by ZMQ identity: their state, their strikes, and losing them.

A worker whose invalid messages reach MAX_STRIKES is dropped: its rollouts fail with ``worker_died``, a local
one is killed (and restarted under its name by supervision), and its identity is not admitted again. A lost
worker's in-flight rollouts go to the scheduler once (``WorkerLost``); its rollout ids are remembered (LOST_KEPT
workers, LATE_KEPT ids each) so that its stragglers count as late, not as forged.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator.contracts.events import HubEvent, WorkerLost
from orchestrator.contracts.protocol import PoolInfo, Stop

if TYPE_CHECKING:
    from orchestrator.hub.local import LocalWorkers
    from orchestrator.hub.pools import PoolKeeper

log = logging.getLogger(__name__)

MAX_STRIKES = 20  # invalid messages after which a worker is dropped
LATE_KEPT = 4096  # cancelled rollout ids remembered per worker, so their stragglers count as late, not forged
LOST_KEPT = 64  # lost workers whose in-flight rollout ids are remembered, so their stragglers count as late


@dataclass
class WorkerState:
    ident: bytes
    name: str
    pid: int | None = None
    ready: bool = False
    last_seen: float = field(default_factory=lambda: asyncio.get_running_loop().time())
    rids: dict[str, str] = field(default_factory=dict)  # rollouts in flight on it -> their group
    late: deque[str] = field(default_factory=lambda: deque(maxlen=LATE_KEPT))  # cancelled rollout ids
    strikes: int = 0
    completed: int = 0
    rss_mb: float | None = None
    pool: PoolInfo | None = None  # direct data plane: the column pool it announced last


class Roster:
    """``workers`` by identity; ``lost`` (their rollout ids that will come back late) and ``banned`` (dropped)
    ones. Produces ``WorkerLost`` events on ``events``; ``metrics``: rejected:<why>, dropped, lost."""

    def __init__(self, send: Callable[[bytes, Any], bool], events: asyncio.Queue[HubEvent], metrics: Counter[str],
                 pools: PoolKeeper, procs: LocalWorkers) -> None:
        self.send = send
        self.events = events
        self.metrics = metrics
        self.pools = pools
        self.procs = procs
        self.workers: dict[bytes, WorkerState] = {}
        self.lost: dict[bytes, deque[str]] = {}  # lost workers -> their rollout ids that will come back late
        self.banned: set[bytes] = set()

    def ready_count(self) -> int:
        return sum(w.ready for w in self.workers.values())

    def named(self, name: str) -> WorkerState | None:
        return next((w for w in self.workers.values() if w.name == name), None)

    def assignable(self) -> list[WorkerState]:
        """The workers that can take a group now: ready, and (direct) room in their column pool."""
        return [w for w in self.workers.values() if w.ready and self.pools.has_room(w.name)]

    def reject(self, worker: WorkerState | None, ident: bytes, why: str, detail: str) -> None:
        """Count an invalid message (a strike for a known worker, unless its group was not assigned to it)."""
        if worker is not None and why != "unassigned":
            self.strike(worker, why, detail)
            return
        self.metrics[f"rejected:{why}"] += 1
        name = worker.name if worker is not None else repr(ident[:64])
        log.warning("rejected a message from env worker %s: %s", name, detail)

    def strike(self, worker: WorkerState, why: str, detail: str) -> None:
        """Count an invalid message; drop the worker at MAX_STRIKES."""
        self.metrics[f"rejected:{why}"] += 1
        worker.strikes += 1
        log.warning("rejected a message from env worker %s (%d of %d allowed): %s", worker.name, worker.strikes,
                    MAX_STRIKES, detail)
        if worker.strikes >= MAX_STRIKES:
            log.error("env worker %s sent %d invalid messages: dropped", worker.name, worker.strikes)
            self.metrics["dropped"] += 1
            self.banned.add(worker.ident)
            self.send(worker.ident, Stop())
            self.lose(worker, "dropped for invalid messages", pool_gone=True)
            self.procs.kill(worker.name)

    def lose(self, worker: WorkerState, why: str, *, pool_gone: bool = False) -> None:
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
        self.lost[worker.ident] = worker.late
        while len(self.lost) > LOST_KEPT:
            del self.lost[next(iter(self.lost))]
        if worker.rids:
            self.events.put_nowait(WorkerLost(worker.name, sorted(worker.rids), why))
            worker.rids.clear()
