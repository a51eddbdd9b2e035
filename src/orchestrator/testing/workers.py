"""A fake worker hub: the scheduler's ``WorkerLink`` interface without processes.

Each assigned rollout finishes after ``delay_s`` with the outcome ``outcome(env, rid)`` returns: a reward
(float, success), a ``Failure`` kind or a ``"kind: message"`` string (failure), or None (never returns: a
hang). Records carry one sample of ``tokens`` tokens so the step pipeline can build batches from them, and
arrive on ``events`` as the real hub's do. With ``pool`` (data_plane = direct) a successful record carries a
span of that pool instead of column frames; ``released`` lists the rollout ids the scheduler released, and
``pool_gone`` reports the pool gone as the real hub does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from orchestrator.columns.layout import SpanLoc, span_layout
from orchestrator.contracts.events import HubEvent, PoolGone, RecordsIn, WorkerLost
from orchestrator.contracts.protocol import Assign, AssignedRollout, RolloutHeader, RolloutRecord
from orchestrator.errors import Failure

Outcome = float | str | Failure | None


@dataclass
class FakeWorkerHub:
    tasks_per_env: dict[str, int]
    outcome: Callable[[str, str], Outcome] = lambda _env, _rid: 1.0
    delay_s: float = 0.0
    tokens: int = 4
    stop: str | None = None  # stop condition stamped on failed rollouts (e.g. "provider_error")
    pool: str | None = None  # direct mode: successful records carry a span of this pool, no frames
    events: asyncio.Queue[HubEvent] = field(default_factory=asyncio.Queue)
    completed: int = 0
    assigned: list[Assign] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # rollout ids, in release order
    _timers: list[asyncio.TimerHandle] = field(default_factory=list)
    _offset: int = 0

    def has_ready(self) -> bool:
        return True

    def assign(self, msg: Assign) -> str:
        self.assigned.append(msg)
        loop = asyncio.get_running_loop()
        for rid in msg.rids:
            result = self.outcome(msg.env, rid)
            if result is not None:
                self._timers.append(loop.call_later(self.delay_s, self._finish, msg, rid, result))
        return "fake"

    def cancel(self, group: str, rids: list[str]) -> None:
        self.cancelled.append(group)

    def release(self, records: Sequence[RolloutRecord]) -> None:
        self.released.extend(r.rid for r in records)

    def worker_stats(self) -> dict[str, tuple[int, float | None]]:
        return {"fake": (self.completed, None)}

    def pool_gone(self, why: str = "killed") -> None:
        """Report the fake worker's pool gone (what the hub does when a worker's process dies)."""
        assert self.pool is not None
        self.events.put_nowait(PoolGone("fake", self.pool, why))

    def lose(self, rids: list[str], why: str = "killed") -> None:
        """Report the fake worker lost while running ``rids`` (what the hub does for a dead worker)."""
        self.events.put_nowait(WorkerLost("fake", rids, why))

    def _finish(self, msg: Assign, rid: str, result: float | str | Failure) -> None:
        base = AssignedRollout(rid, msg.group, msg.env, msg.task, msg.policy_step, "fake", msg.server)
        frames: list[memoryview] = []
        if isinstance(result, str):  # a Failure, or "kind: message"
            kind, _, message = str(result).partition(":")
            header = RolloutHeader.failed(base, Failure(kind), message.strip() or kind, stop=self.stop)
        else:
            n = self.tokens
            header = RolloutHeader(rid=rid, group=msg.group, env=msg.env, task=msg.task,
                                   policy_step=msg.policy_step, worker="fake", server=msg.server, ok=True,
                                   reward=float(result), samples=[(n, 0, 0)], tokens=n)
            if self.pool is not None:
                nbytes = span_layout(n, 0, 0, "uint8").nbytes
                header.span = SpanLoc(self.pool, self._offset, nbytes)
                self._offset += nbytes
            else:
                frames = [memoryview(np.arange(n, dtype=np.int32).tobytes()),
                          memoryview(np.ones(n, np.uint8).tobytes()),
                          memoryview(np.full(n, -1.0, np.float32).tobytes()), memoryview(b"")]
        self.completed += 1
        self.events.put_nowait(RecordsIn("fake", [RolloutRecord(header, frames)]))

    def close(self) -> None:
        for t in self._timers:
            t.cancel()
