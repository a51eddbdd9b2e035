"""Event-loop-lag monitor: how late the loop wakes a sleeping task, sampled continuously.

The monitor's ``run()`` loop sleeps ``interval_s`` and records by how much the wake-up overshot. A
coroutine that holds the loop for 50 ms shows up as a sample of about 50 ms. Samples go into a bounded
window (``window`` samples; the oldest are dropped first) that ``reset()`` clears at each step boundary,
so a step's statistics describe that step only. Every sample past ``warn_ms`` is logged as it happens
(past ``error_ms`` at ERROR level), so no stall goes unreported.

Each sample also splits the loop thread's time (Linux ``/proc/thread-self/schedstat``): CPU it ran, and
time it was runnable but waiting for a core. A stall the thread spent running is code holding the loop;
one spent waiting for a core is an oversubscribed host; the rest is the thread blocked (a blocking call
on the loop, or waiting for the GIL held by another thread). Each warning says which, and the stats
carry the split of the window's largest sample (``worst_cpu_ms``, ``worst_wait_ms``).
"""

from __future__ import annotations

import asyncio
import logging
import os
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
    worst_cpu_ms: float = 0.0  # CPU the loop's thread used during the largest sample
    worst_wait_ms: float = 0.0  # time it was runnable but had no core, during the largest sample

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "min": self.min_ms, "median": self.median_ms, "p90": self.p90_ms,
                "p99": self.p99_ms, "max": self.max_ms, "worst_cpu": self.worst_cpu_ms,
                "worst_wait": self.worst_wait_ms}


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
        self._worst = (0.0, 0.0, 0.0)  # (lag, CPU, run-queue wait) of the largest sample since the last reset
        self.stalls = 0  # samples past warn_ms since the last reset

    async def run(self) -> None:
        """Sample until cancelled. Owned by the caller's TaskGroup."""
        clock = _ThreadClock()
        try:
            while True:
                start, (cpu, wait) = time.perf_counter(), clock.read()
                await asyncio.sleep(self.interval_s)
                cpu2, wait2 = clock.read()
                self.record((time.perf_counter() - start - self.interval_s) * 1e3, cpu2 - cpu, wait2 - wait)
        finally:
            clock.close()

    def record(self, lag_ms: float, cpu_ms: float = 0.0, wait_ms: float = 0.0) -> None:
        lag_ms = max(lag_ms, 0.0)
        self._samples.append(lag_ms)
        if lag_ms > self._worst[0]:
            self._worst = (lag_ms, cpu_ms, wait_ms)
        if lag_ms >= self.warn_ms:
            self.stalls += 1
            level = logging.ERROR if lag_ms >= self.error_ms else logging.WARNING
            log.log(level, "event loop stalled for %.1f ms: %s", lag_ms, _explain(lag_ms, cpu_ms, wait_ms))

    def stats(self) -> LagStats:
        """Statistics of the samples since the last reset (all zero with no sample)."""
        if not self._samples:
            return LagStats(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        a = np.fromiter(self._samples, dtype=np.float64, count=len(self._samples))
        lo, median, p90, p99, hi = (float(x) for x in np.percentile(a, [0, 50, 90, 99, 100]))
        return LagStats(len(a), lo, median, p90, p99, hi, worst_cpu_ms=self._worst[1], worst_wait_ms=self._worst[2])

    def reset(self) -> LagStats:
        """Return the current window's statistics and start a new window."""
        s = self.stats()
        self._samples.clear()
        self._worst = (0.0, 0.0, 0.0)
        self.stalls = 0
        return s


def _explain(lag_ms: float, cpu_ms: float, wait_ms: float) -> str:
    blocked = max(lag_ms - cpu_ms - wait_ms, 0.0)
    parts = sorted([(cpu_ms, "running code on the loop"), (wait_ms, "waiting for a CPU core (busy host)"),
                    (blocked, "blocked (a blocking call, or the GIL held by another thread)")], reverse=True)
    return f"mostly {parts[0][1]}; the thread ran {cpu_ms:.1f} ms, waited {wait_ms:.1f} ms for a core"


class _ThreadClock:
    """The calling thread's (CPU ms, run-queue wait ms) so far; the wait is 0 where schedstat is missing."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> tuple[float, float]:
        if self._fd is not None:
            try:
                cpu_ns, wait_ns = os.pread(self._fd, 128, 0).split()[:2]
                return int(cpu_ns) / 1e6, int(wait_ns) / 1e6
            except (OSError, ValueError):
                pass
        return time.thread_time() * 1e3, 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
