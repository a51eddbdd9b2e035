"""``background``: loops a block owns, as tasks of one TaskGroup, for as long as the block runs.

A component that serves something while its caller holds it open (a sender's trainer channel, a span server,
a shared-memory pool's fd server) starts its loops with it::

    async with background(("trainer-channel", sender.read_trainer())):
        yield sender

The loops start when the block is entered and are cancelled, and awaited, when it ends, so none outlives its
owner (STYLE.md 1: no task whose failure nobody sees). A loop that fails cancels the block, and leaving the
block raises that error as it is (not wrapped in an ExceptionGroup: callers catch what they always caught);
an error of the block itself passes through unchanged. Two errors at once stay an ExceptionGroup.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def background(*loops: tuple[str, Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    """Run ``loops`` (name, coroutine) as tasks owned by this block (see the module docstring)."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(coro, name=name) for name, coro in loops]
            try:
                yield
            finally:
                for task in tasks:  # they run until cancelled; the TaskGroup waits for each to end
                    task.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:  # one loop's error, or the block's own: as it was raised
            raise group.exceptions[0] from None
        raise
