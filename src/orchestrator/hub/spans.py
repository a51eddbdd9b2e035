"""``SpanLedger``: which rollouts' spans the orchestrator holds in each env worker's column pool. No I/O.

Data plane, direct mode (docs/data-plane.md). The hub's ``PoolKeeper`` (pools.py) keeps one ledger; per
worker (by name) it knows the pool the worker announced last (``Ready.pool``), the rollouts passed on to the
scheduler whose columns are in that pool and not yet released (``hold``), the largest span the worker has
stored, and the largest free range its last heartbeat reported. From that it answers:

- ``release(headers)``: which rollout ids to send each worker in a ``Release`` (a span of an older pool is not
  sent: that pool is gone, or renewed, with everything in it). Each held span is released once.
- ``announce(worker, pool)``: a pool that replaces another one is a *gone* pool: every rollout held in the old
  one can no longer train (the caller fails those still buffered). The same pool again (a worker re-admitted
  after it was lost) keeps what is held: ``keep(worker)`` is what it must keep, everything else it may free
  (this also covers a ``Release`` lost while it was away).
- ``forget(worker)``: the worker's process is gone (killed, exited, dropped): its pool is gone.
- ``has_room(worker)``: whether its pool's largest free range, as of its last heartbeat, holds the largest
  rollout it has stored so far (no report yet, or nothing stored yet: room). The scheduler assigns nothing to a
  worker without room, so a slow trainer stops new work instead of filling memory (the bound is
  ``transport.worker_pool_mb`` per worker).

Bounded: at most one entry per worker ever admitted under a name (local slots, or remote workers), each
holding at most the rollouts passed on and not yet released (``scheduler.max_buffered_rollouts`` plus the
``send_hwm`` steps not yet acknowledged).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from orchestrator.contracts.protocol import PoolInfo, RolloutHeader


@dataclass
class _Pool:
    info: PoolInfo
    held: set[str] = field(default_factory=set)
    largest_span: int = 0
    free: int | None = None  # its largest free range (bytes) as of the last heartbeat; None: not reported


class SpanLedger:
    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}  # worker name -> its current pool
        self.released = 0  # spans released so far

    def pool(self, worker: str) -> PoolInfo | None:
        p = self._pools.get(worker)
        return None if p is None else p.info

    def pools(self) -> dict[str, PoolInfo]:
        """Every worker's current pool, by worker name (what a step manifest may name)."""
        return {w: p.info for w, p in self._pools.items()}

    def announce(self, worker: str, info: PoolInfo | None) -> PoolInfo | None:
        """``worker`` announced ``info`` (its ``ready``): the pool this replaces (gone), if any."""
        old = self._pools.get(worker)
        if old is not None and info is not None and old.info.id == info.id:
            return None
        if info is None:
            self._pools.pop(worker, None)
        else:
            self._pools[worker] = _Pool(info)
        return None if old is None else old.info

    def forget(self, worker: str) -> PoolInfo | None:
        """``worker``'s process is gone: its pool (gone with it), if it had one."""
        old = self._pools.pop(worker, None)
        return None if old is None else old.info

    def hold(self, header: RolloutHeader) -> None:
        """A record passed on: its span (if in its worker's current pool) is held until released."""
        p = self._pools.get(header.worker)
        if header.span is not None and p is not None and header.span.pool == p.info.id:
            p.held.add(header.rid)
            p.largest_span = max(p.largest_span, header.span.nbytes)

    def release(self, headers: Iterable[RolloutHeader]) -> dict[str, list[str]]:
        """The rollout ids to release, by worker: those of ``headers`` still held in their worker's current pool."""
        out: dict[str, list[str]] = {}
        for h in headers:
            p = self._pools.get(h.worker)
            if h.span is None or p is None or h.span.pool != p.info.id or h.rid not in p.held:
                continue
            p.held.discard(h.rid)
            out.setdefault(h.worker, []).append(h.rid)
            self.released += 1
        return out

    def keep(self, worker: str) -> list[str]:
        """What ``worker`` must keep of its pool: the rollouts held there, sorted."""
        p = self._pools.get(worker)
        return [] if p is None else sorted(p.held)

    def held(self, worker: str) -> int:
        p = self._pools.get(worker)
        return 0 if p is None else len(p.held)

    def report(self, worker: str, free: int | None) -> None:
        """``worker``'s heartbeat: the largest free range of its pool."""
        p = self._pools.get(worker)
        if p is not None:
            p.free = free

    def has_room(self, worker: str) -> bool:
        p = self._pools.get(worker)
        return p is None or p.free is None or p.free >= max(p.largest_span, 1)
