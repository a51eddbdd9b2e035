"""Event-loop-lag monitor: how late the loop wakes a sleeping task, sampled continuously.

The monitor's ``run()`` loop sleeps ``interval_s`` and records by how much the wake-up overshot. A
coroutine that holds the loop for 50 ms shows up as a sample of about 50 ms. Samples go into a bounded
window (``window`` samples; the oldest are dropped first) that ``reset()`` clears at each step boundary,
so a step's statistics describe that step only. Every sample past ``warn_ms`` is logged as it happens
(past ``error_ms`` at ERROR level), so no stall goes unreported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LagStats:
    """Loop-lag statistics over one window, in milliseconds."""

    count: int
    min_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "min": self.min_ms, "median": self.median_ms, "p90": self.p90_ms,
                "p99": self.p99_ms, "max": self.max_ms}


class LagMonitor:
    """Samples event-loop lag; consumes nothing, produces ``stats()``; wakes every ``interval_s``."""

    def __init__(self, interval_s: float = 0.1, window: int = 4096, warn_ms: float = 50.0,
                 error_ms: float = 500.0) -> None:
        if interval_s <= 0 or window < 1 or warn_ms <= 0 or error_ms < warn_ms:
            raise ValueError("LagMonitor needs interval_s > 0, window >= 1, 0 < warn_ms <= error_ms")
        self.interval_s = interval_s
        self.warn_ms = warn_ms
        self.error_ms = error_ms
        self._samples: deque[float] = deque(maxlen=window)
        self.stalls = 0  # samples past warn_ms since the last reset

    async def run(self) -> None:
        """Sample until cancelled. Owned by the caller's TaskGroup."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.record((time.perf_counter() - start - self.interval_s) * 1e3)

    def record(self, lag_ms: float) -> None:
        lag_ms = max(lag_ms, 0.0)
        self._samples.append(lag_ms)
        if lag_ms >= self.warn_ms:
            self.stalls += 1
            level = logging.ERROR if lag_ms >= self.error_ms else logging.WARNING
            log.log(level, "event loop stalled for %.1f ms", lag_ms)

    def stats(self) -> LagStats:
        """Statistics of the samples since the last reset (all zero with no sample)."""
        if not self._samples:
            return LagStats(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        a = np.fromiter(self._samples, dtype=np.float64, count=len(self._samples))
        q = np.percentile(a, [0, 50, 90, 99, 100])
        return LagStats(len(a), *(float(x) for x in q))

    def reset(self) -> LagStats:
        """Return the current window's statistics and start a new window."""
        s = self.stats()
        self._samples.clear()
        self.stalls = 0
        return s
