"""``PoolKeeper``: the worker hub's side of the direct data plane (docs/data-plane.md).

The hub (hub.py) calls it at each event of a worker's life; it keeps the ``SpanLedger`` (spans.py: which spans
the orchestrator holds in each worker's pool) and acts on it through the hub's socket (``send``) and the hub's
``events`` queue:

- ``ready``: a worker announced its pool. A different pool than before is a replaced pool: ``PoolGone`` (its
  buffered rollouts cannot train). The same pool again (the worker was lost and is re-admitted) gets
  ``Release(keep=...)``: everything but what the orchestrator holds is free. Every announcement goes on
  ``news`` for the trainer link (one per ``ready``; consumed by the orchestrator in direct mode).
- ``passed_on`` / ``unused`` / ``release``: a record passed on is held until released; one not passed on
  (late, corrupt) is released at once; ``release`` is the scheduler's, the step's and the acknowledgements'.
  A ``Release`` the worker's full queue refuses is kept and sent again with its next heartbeat (a worker that
  is gone gets the same result from the resync when it is re-admitted).
- ``heartbeat``: the room its pool reports; ``has_room`` is what assignment asks (logged when a pool fills
  and when it has room again).
- ``gone``: the worker's process is gone (killed, exited, dropped), and its pool with it: ``PoolGone``.

Counts go to the hub's metrics: ``released``, ``pools_gone``, ``pool_full``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from orchestrator.contracts.events import HubEvent, PoolGone
from orchestrator.contracts.protocol import PoolInfo, Release, RolloutHeader, RolloutRecord
from orchestrator.hub.spans import SpanLedger

log = logging.getLogger(__name__)


class PoolKeeper:
    def __init__(self, send: Callable[[bytes, Release], bool], events: asyncio.Queue[HubEvent],
                 metrics: Counter[str]) -> None:
        """``send``: a message to a worker by its ident, without waiting (False: not sent)."""
        self.ledger = SpanLedger()
        # (worker, pool) from each ready: no maxsize; one small entry per ready, taken at once by the orchestrator's
        # pool announcer in direct mode (a command without one, e.g. ``orchestrator eval``, keeps them all)
        self.news: asyncio.Queue[tuple[str, PoolInfo]] = asyncio.Queue()
        self._send = send
        self._events = events
        self.metrics = metrics
        self._full: set[str] = set()  # workers whose pool has no room (logged once per episode)
        self._unsent: dict[bytes, list[str]] = {}  # releases a worker's full queue refused

    def pool(self, worker: str) -> PoolInfo | None:
        return self.ledger.pool(worker)

    def pools(self) -> dict[str, PoolInfo]:
        """Every worker's current pool, by name: what a step manifest may name."""
        return self.ledger.pools()

    def has_room(self, worker: str) -> bool:
        return self.ledger.has_room(worker)

    def ready(self, worker: str, ident: bytes, pool: PoolInfo | None) -> None:
        known = self.ledger.pool(worker)
        replaced = self.ledger.announce(worker, pool)
        if replaced is not None:
            self._gone(worker, replaced.id, f"replaced by pool {pool.id if pool else 'none'}")
        elif known is not None:  # re-admitted with the same pool: it frees all but what we hold
            self._send(ident, Release([], keep=self.ledger.keep(worker)))
        if pool is not None:
            self.news.put_nowait((worker, pool))

    def passed_on(self, header: RolloutHeader) -> None:
        self.ledger.hold(header)

    def unused(self, ident: bytes, headers: Iterable[RolloutHeader]) -> None:
        """Records not passed on (late, corrupt): their spans will never be read."""
        rids = [h.rid for h in headers if h.span is not None]
        if rids:
            self.metrics["released"] += len(rids)
            self._release(ident, rids)

    def release(self, records: Sequence[RolloutRecord], idents: Mapping[str, bytes]) -> None:
        """Records passed on that will never be read again (``idents``: the connected workers by name)."""
        for name, rids in self.ledger.release(r.header for r in records).items():
            self.metrics["released"] += len(rids)
            ident = idents.get(name)
            if ident is not None:
                self._release(ident, rids)

    def heartbeat(self, worker: str, ident: bytes, free: int | None) -> None:
        if ident in self._unsent:
            self._release(ident, self._unsent.pop(ident))
        self.ledger.report(worker, free)
        if not self.ledger.has_room(worker):
            if worker not in self._full:
                self._full.add(worker)
                self.metrics["pool_full"] += 1
                log.warning("env worker %s: its column pool has no room for another rollout (%d held); no new "
                            "groups go to it until releases (acknowledged steps) make room", worker,
                            self.ledger.held(worker))
        elif worker in self._full:
            self._full.discard(worker)
            log.info("env worker %s: room in its column pool again", worker)

    def left(self, ident: bytes) -> None:
        """The worker behind ``ident`` is no longer connected: its resync on re-admission covers what was unsent."""
        self._unsent.pop(ident, None)

    def gone(self, worker: str, why: str) -> None:
        """``worker``'s process is gone, and its pool (if any) with it."""
        old = self.ledger.forget(worker)
        if old is not None:
            self._gone(worker, old.id, why)

    def _release(self, ident: bytes, rids: list[str]) -> None:
        if not self._send(ident, Release(rids)):
            self._unsent.setdefault(ident, []).extend(rids)

    def _gone(self, worker: str, pool: str, why: str) -> None:
        self.metrics["pools_gone"] += 1
        self._full.discard(worker)
        log.warning("column pool %s of env worker %s is gone (%s): its rollouts not yet trained cannot train",
                    pool, worker, why)
        self._events.put_nowait(PoolGone(worker, pool, why))
