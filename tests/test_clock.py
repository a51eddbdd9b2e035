"""The virtual clock of orchestrator.testing: time jumps to the next timer when nothing else can happen, follows
real time while the executor works, and never overtakes data that is there to read."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from orchestrator.testing.clock import VirtualClockLoop, run, virtual_time


@virtual_time
async def test_sleeps_and_timeouts_take_virtual_time_in_order() -> None:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualClockLoop)
    t0, real = loop.time(), time.monotonic()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        woke.append((name, loop.time() - t0))

    async with asyncio.TaskGroup() as tg:
        tg.create_task(sleeper("hour", 3600))
        tg.create_task(sleeper("minute", 60))
        tg.create_task(sleeper("day", 86400 * 2))  # past the loop's longest select: jumps twice
    assert woke == [("minute", 60), ("hour", 3600), ("day", 172800)]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(30):
            await asyncio.Event().wait()
    assert loop.time() - t0 == 172830
    assert loop.jumps >= 4
    assert time.monotonic() - real < 5  # virtual: two days in (far) less than a few seconds


@virtual_time
async def test_work_in_the_executor_holds_the_clock_to_real_time() -> None:
    """A timer due before a thread's work ends must not jump past it: the work runs in real time."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with asyncio.timeout(3600):  # due only if the clock jumped while the thread worked
        await asyncio.to_thread(time.sleep, 0.2)
    assert 0 < loop.time() - t0 < 3600  # the real time the loop waited for the thread (a loaded machine's loop may
    # have run other callbacks for part of the thread's 0.2 s: that part is not waited, so not counted)
    async with asyncio.timeout(3600):
        await loop.run_in_executor(None, time.sleep, 0.05)
    assert isinstance(loop, VirtualClockLoop)
    assert loop._in_executor == 0


@virtual_time
async def test_data_there_to_read_comes_before_any_jump() -> None:
    """A socket pair within the process: the reply sent after a virtual second arrives at that second, though a
    timeout of a minute is pending; with nothing to read, that timeout fires at its virtual minute."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=a)
    peer_reader, peer_writer = await asyncio.open_connection(sock=b)
    t0 = loop.time()

    async def answer() -> None:
        await peer_reader.readexactly(4)
        await asyncio.sleep(1)
        peer_writer.write(b"pong")
        await peer_writer.drain()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(answer())
        writer.write(b"ping")
        async with asyncio.timeout(60):
            assert await reader.readexactly(4) == b"pong"
    assert loop.time() - t0 == 1
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(60):
            await reader.read(1)
    assert loop.time() - t0 == 61
    for w in (writer, peer_writer):
        w.close()
        await w.wait_closed()


def test_run_starts_where_asked_and_returns_the_result(tmp_path: Path) -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(5)
        return start, loop.time()

    assert run(main(), start=1000.0) == (1000.0, 1005.0)
    with pytest.raises(ValueError, match="autojump_threshold"):
        VirtualClockLoop(autojump_threshold=-1)


@virtual_time
async def test_fixtures_pass_through(tmp_path: Path) -> None:
    await asyncio.sleep(10)
    assert "test_fixtures_pass_through" in tmp_path.name
