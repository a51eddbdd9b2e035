"""``background``: loops a block owns. A loop's failure ends the block with that error (not a silent stall);
the block's own error passes through as it is; no loop outlives the block."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.background import background
from orchestrator.errors import TransportError

HANG_GUARD_S = 30.0  # only reached if a failed loop did not end the block


async def test_a_failed_loop_ends_the_block_with_its_error() -> None:
    started = asyncio.Event()

    async def broken() -> None:
        await started.wait()
        raise TransportError("the socket went away")

    async def block() -> None:
        async with asyncio.timeout(HANG_GUARD_S), background(("broken", broken())):
            started.set()
            await asyncio.Event().wait()  # a block that would wait for ever: the loop's failure ends it

    with pytest.raises(TransportError, match="went away"):
        await block()


async def test_the_blocks_own_error_passes_through_and_the_loops_end_with_it() -> None:
    ended = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    async def block() -> None:
        async with background(("forever", forever())):
            await asyncio.sleep(0)  # the loop starts
            raise KeyError("the block's own")

    with pytest.raises(KeyError):
        await block()
    assert ended.is_set()


async def test_leaving_the_block_cancels_and_awaits_every_loop() -> None:
    ended: list[str] = []

    async def loop(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(name)

    async with background(("a", loop("a")), ("b", loop("b"))):
        await asyncio.sleep(0)
    assert sorted(ended) == ["a", "b"]
