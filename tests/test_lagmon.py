"""The loop-lag monitor, on a real event loop: it sees a deliberate stall and splits its time right.

No assertion here depends on how busy the machine is. A stall is made while the monitor sleeps, and the sample
that covers it is the one recorded next (``Recording``), so its lag is at least the stall; what the machine adds
only makes it larger. Nothing asserts that lag is small elsewhere: on a loaded host it is not, and speed belongs
in ``scripts/perf``. How a warning names a stall's cause is checked with given numbers (``record``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import pytest

from orchestrator.lagmon import LagMonitor

HANG_GUARD_S = 60.0  # only reached if the monitor stops sampling
INTERVAL_S = 0.005
STALL_MS = 200.0  # long against a clock tick (schedstat's CPU time can lag by one) and the interval


class Recording(LagMonitor):
    """A LagMonitor that also keeps every sample as (lag, CPU, run-queue wait) ms and wakes ``sampled`` waiters."""

    def __init__(self, interval_s: float = INTERVAL_S, warn_ms: float = 50.0, error_ms: float = 500.0) -> None:
        super().__init__(interval_s=interval_s, warn_ms=warn_ms, error_ms=error_ms)
        self.samples: list[tuple[float, float, float]] = []
        self._new = asyncio.Event()

    def record(self, lag_ms: float, cpu_ms: float = 0.0, wait_ms: float = 0.0) -> None:
        super().record(lag_ms, cpu_ms, wait_ms)
        self.samples.append((lag_ms, cpu_ms, wait_ms))
        self._new.set()

    async def sampled(self, n: int) -> None:
        """Wait until ``n`` samples have been recorded."""
        async with asyncio.timeout(HANG_GUARD_S):
            while len(self.samples) < n:
                self._new.clear()
                await self._new.wait()


async def run_for(mon: LagMonitor, body: Awaitable[object]) -> float:
    """Run the monitor while ``body`` runs; the wall time of the whole, in ms."""
    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(mon.run())
        await body
        task.cancel()
    return (time.perf_counter() - t0) * 1e3


async def stall(mon: Recording, hold: Callable[[], None]) -> tuple[float, float, float]:
    """Run ``hold`` (which holds the loop) while the monitor sleeps; the sample covering it.

    ``sampled`` returns once a sample is recorded, and the monitor starts its next sleep before this task
    resumes, so that next sample began before ``hold`` and ends after it."""
    await mon.sampled(3)
    k = len(mon.samples)
    hold()
    await mon.sampled(k + 1)
    return mon.samples[k]


def block(ms: float) -> Callable[[], None]:
    return lambda: time.sleep(ms / 1e3)  # holds the loop without running: the thread sleeps


def burn(ms: float) -> Callable[[], None]:
    def hold() -> None:
        end = time.thread_time() + ms / 1e3
        while time.thread_time() < end:  # holds the loop and burns CPU
            pass
    return hold


async def test_sees_a_stall(caplog: pytest.LogCaptureFixture) -> None:
    mon = Recording(interval_s=INTERVAL_S, warn_ms=30.0, error_ms=1e6)
    got: list[tuple[float, float, float]] = []

    async def body() -> None:
        got.append(await stall(mon, block(50)))

    with caplog.at_level(logging.WARNING, logger="orchestrator.lagmon"):
        wall_ms = await run_for(mon, body())
    lag, _, _ = got[0]
    assert lag >= 50.0 - INTERVAL_S * 1e3, got  # the sample covering the stall holds all of it
    s = mon.stats()
    assert s.count == len(mon.samples) >= 4
    assert lag <= s.max_ms <= wall_ms, (s, wall_ms)  # in ms, and no more than the time that passed
    assert mon.stalls >= 1
    assert any("stalled" in r.getMessage() for r in caplog.records)


async def test_each_sample_is_the_overshoot_of_its_sleep() -> None:
    """Lag is how late a wake-up came, not the time slept: samples plus their sleeps fit in the time that passed
    (a monitor reporting the whole sleep would exceed it by the sum of the intervals, 100 ms here)."""
    mon = Recording(interval_s=INTERVAL_S)
    wall_ms = await run_for(mon, mon.sampled(20))
    assert len(mon.samples) >= 20
    slept_ms = sum(max(lag, 0.0) + INTERVAL_S * 1e3 for lag, _, _ in mon.samples)
    assert slept_ms <= wall_ms + 1.0, (slept_ms, wall_ms)
    s = mon.stats()
    assert s.count == len(mon.samples)
    assert s.min_ms >= 0.0


async def test_error_level_past_error_threshold(caplog: pytest.LogCaptureFixture) -> None:
    mon = Recording(interval_s=INTERVAL_S, warn_ms=5.0, error_ms=20.0)
    with caplog.at_level(logging.WARNING, logger="orchestrator.lagmon"):
        await run_for(mon, stall(mon, block(40)))  # a lag of at least 35 ms
    assert any(r.levelno == logging.ERROR for r in caplog.records)


def test_window_is_bounded_and_reset_starts_fresh() -> None:
    mon = LagMonitor(window=16, warn_ms=1e6, error_ms=1e6)
    for i in range(100):
        mon.record(float(i))
    s = mon.stats()
    assert s.count == 16
    assert s.min_ms == 84.0
    assert s.max_ms == 99.0
    assert mon.reset() == s
    assert mon.stats().count == 0
    assert mon.stats().max_ms == 0.0


def test_percentiles() -> None:
    mon = LagMonitor(window=1000, warn_ms=1e6, error_ms=1e6)
    for i in range(101):
        mon.record(float(i))
    s = mon.stats()
    assert (s.min_ms, s.median_ms, s.p90_ms, s.p99_ms, s.max_ms) == (0.0, 50.0, 90.0, 99.0, 100.0)
    assert s.as_dict()["count"] == 101


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LagMonitor(interval_s=0)
    with pytest.raises(ValueError, match="warn_ms"):
        LagMonitor(warn_ms=100, error_ms=10)


@pytest.mark.parametrize(("cpu_ms", "wait_ms", "says"), [
    (90.0, 5.0, "mostly running code on the loop"),
    (5.0, 90.0, "mostly waiting for a CPU core (busy host)"),
    (2.0, 3.0, "mostly blocked (a blocking call, or the GIL held by another thread)"),
])
def test_a_stall_names_where_its_time_went(caplog: pytest.LogCaptureFixture, cpu_ms: float, wait_ms: float,
                                           says: str) -> None:
    mon = LagMonitor(warn_ms=30.0, error_ms=1e6)
    with caplog.at_level(logging.WARNING, logger="orchestrator.lagmon"):
        mon.record(10.0, 9.0, 0.5)
        mon.record(100.0, cpu_ms, wait_ms)
        mon.record(20.0, 1.0, 19.0)
    assert [r.getMessage() for r in caplog.records] == [
        f"event loop stalled for 100.0 ms: {says}; the thread ran {cpu_ms:.1f} ms, waited {wait_ms:.1f} ms for a core"]
    s = mon.stats()
    assert (s.max_ms, s.worst_cpu_ms, s.worst_wait_ms) == (100.0, cpu_ms, wait_ms)  # the split of the largest


async def test_a_stall_splits_into_running_and_blocked_time() -> None:
    """The thread's own clock splits a real stall: CPU it ran, and time it was blocked (neither running nor
    waiting for a core). Both are exact lower bounds whatever the load; which part a warning names first depends
    on the load (a burn on a busy host mostly waits for a core) and is checked above."""
    mon = Recording(interval_s=INTERVAL_S, warn_ms=30.0, error_ms=1e6)
    got: list[tuple[float, float, float]] = []

    async def body() -> None:
        got.append(await stall(mon, burn(STALL_MS)))
        got.append(await stall(mon, block(STALL_MS)))

    await run_for(mon, body())
    (burn_lag, burn_cpu, _), (block_lag, block_cpu, block_wait) = got
    assert burn_lag >= STALL_MS - INTERVAL_S * 1e3, got
    assert burn_cpu >= 0.8 * STALL_MS, got  # the burn's CPU time is in its sample
    assert block_lag >= STALL_MS - INTERVAL_S * 1e3, got
    assert block_cpu < 0.2 * STALL_MS, got  # time.sleep holds the loop without running
    assert block_lag - block_cpu - block_wait >= 0.8 * STALL_MS, got  # ... and the thread was blocked meanwhile
