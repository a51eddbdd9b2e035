from __future__ import annotations

import asyncio
import logging
import time

import pytest

from orchestrator.lagmon import LagMonitor


async def run_for(mon: LagMonitor, body: object) -> None:
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(mon.run())
        await body  # type: ignore[misc]
        task.cancel()


async def block_loop(ms: float) -> None:
    await asyncio.sleep(0.02)  # let the monitor take a few samples first
    time.sleep(ms / 1e3)  # noqa: ASYNC251 - holds the loop: exactly the stall the monitor must see
    await asyncio.sleep(0.02)


async def test_sees_a_50ms_block(caplog: pytest.LogCaptureFixture) -> None:
    mon = LagMonitor(interval_s=0.005, warn_ms=30.0, error_ms=1000.0)
    with caplog.at_level(logging.WARNING, logger="orchestrator.lagmon"):
        await run_for(mon, block_loop(50))
    s = mon.stats()
    assert 40.0 <= s.max_ms <= 150.0, s
    assert s.count >= 3
    assert mon.stalls >= 1
    assert any("stalled" in r.getMessage() for r in caplog.records)


async def test_idle_loop_reports_near_zero() -> None:
    mon = LagMonitor(interval_s=0.005)
    await run_for(mon, asyncio.sleep(0.2))
    s = mon.stats()
    assert s.count >= 10
    assert s.median_ms < 5.0, s
    assert s.min_ms >= 0.0


async def test_error_level_past_error_threshold(caplog: pytest.LogCaptureFixture) -> None:
    mon = LagMonitor(interval_s=0.005, warn_ms=5.0, error_ms=20.0)
    with caplog.at_level(logging.WARNING, logger="orchestrator.lagmon"):
        await run_for(mon, block_loop(40))
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


async def burn_loop(ms: float) -> None:
    await asyncio.sleep(0.02)
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:  # holds the loop and burns CPU
        pass
    await asyncio.sleep(0.02)


async def test_a_stall_says_whether_the_loop_ran_code_or_was_blocked(caplog: pytest.LogCaptureFixture) -> None:
    mon = LagMonitor(interval_s=0.005, warn_ms=30.0, error_ms=1000.0)
    with caplog.at_level(logging.WARNING, logger="orchestrator.lagmon"):
        await run_for(mon, burn_loop(60))
    s = mon.reset()
    assert s.max_ms >= 50.0, s
    assert s.worst_cpu_ms >= 0.8 * 60.0, s  # the worst sample's time was spent running
    assert any("mostly running code on the loop" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="orchestrator.lagmon"):
        await run_for(mon, block_loop(60))
    s = mon.reset()
    assert s.max_ms >= 50.0, s
    assert s.worst_cpu_ms < 20.0, s  # time.sleep holds the loop without running
    assert any("mostly blocked" in r.getMessage() for r in caplog.records)
