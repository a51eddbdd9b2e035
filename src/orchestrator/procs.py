"""Child processes the orchestrator starts (env workers, simulated servers): stopping them by their pid."""

from __future__ import annotations

import asyncio
import contextlib
import signal


async def terminate(proc: asyncio.subprocess.Process, timeout_s: float = 10.0, *, signal_first: bool = True) -> None:
    """Stop a child we started: SIGTERM (unless ``signal_first`` is False), then SIGKILL after ``timeout_s``."""
    if proc.returncode is not None:
        return
    if signal_first:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
