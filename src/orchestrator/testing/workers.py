"""A fake worker hub: the interface of ``orchestrator.worker.hub.WorkerHub`` without processes.

Each assigned rollout finishes after ``delay_s`` with the outcome ``outcome(env, rid)`` returns: a reward
(float, success), a string (failure with that error), or None (never returns: a hang). Records carry one
sample of ``tokens`` tokens so the step pipeline can build batches from them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchestrator.worker.protocol import RolloutRecord

Outcome = float | str | None


@dataclass
class FakeWorker:
    name: str
    completed: int = 0


@dataclass
class FakeWorkerHub:
    tasks_per_env: dict[str, int]
    outcome: Callable[[str, str], Outcome] = lambda _env, _rid: 1.0
    delay_s: float = 0.0
    tokens: int = 4
    on_record: Callable[[RolloutRecord], None] = lambda _r: None
    on_lost: Callable[[str, list[str]], None] = lambda _w, _rids: None
    workers: dict[str, FakeWorker] = field(default_factory=lambda: {"fake": FakeWorker("fake")})
    assigned: list[dict[str, Any]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    stop: str | None = None  # stop condition stamped on failed rollouts (e.g. "provider_error")
    _timers: list[asyncio.TimerHandle] = field(default_factory=list)

    def has_ready(self) -> bool:
        return True

    async def assign(self, msg: dict[str, Any]) -> str:
        self.assigned.append(msg)
        loop = asyncio.get_running_loop()
        for rid in msg["rids"]:
            result = self.outcome(msg["env"], rid)
            if result is not None:
                self._timers.append(loop.call_later(self.delay_s, self._finish, msg, rid, result))
        return "fake"

    async def cancel(self, group: str, rids: list[str]) -> None:
        self.cancelled.append(group)

    def _finish(self, msg: dict[str, Any], rid: str, result: float | str) -> None:
        header: dict[str, Any] = {"rid": rid, "group": msg["group"], "env": msg["env"],
                                  "task": msg["task"], "policy_step": msg["policy_step"], "worker": "fake"}
        frames: list[memoryview] = []
        if isinstance(result, str):
            header.update(ok=False, reward=0.0, error=result, samples=[], tokens=0, stop=self.stop)
        else:
            n = self.tokens
            header.update(ok=True, reward=float(result), error=None, samples=[[n, 0, 0]], tokens=n)
            frames = [memoryview(np.arange(n, dtype=np.int32).tobytes()), memoryview(np.ones(n, np.uint8).tobytes()),
                      memoryview(np.full(n, -1.0, np.float32).tobytes()), memoryview(b"")]
        self.workers["fake"].completed += 1
        self.on_record(RolloutRecord(header, frames))

    def close(self) -> None:
        for t in self._timers:
            t.cancel()
