"""Start simulated inference servers: in-process (fast, controllable) or as real subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from orchestrator.procs import child_env, terminate
from orchestrator.sim.profiles import DEFAULT_PROFILE, ProfileName
from orchestrator.sim.server import SimServer


@contextlib.asynccontextmanager
async def sim_servers(n: int = 1, *, profile: ProfileName = DEFAULT_PROFILE, seed: int = 0,
                      **kwargs: Any) -> AsyncIterator[list[SimServer]]:
    """Start ``n`` simulated servers playing ``profile`` on 127.0.0.1 (free ports) in this process; all stop
    on exit. Server ``i`` is seeded ``seed + i``. Change ``server.faults`` to inject faults while it runs;
    ``kwargs`` are the other ``SimServer`` arguments (``dev_mode``, ``layers``, ``top_k``, ...).
    """
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(SimServer.open(profile=profile, seed=seed + i, **kwargs))
                   for i in range(n)]
        yield servers


class SimProcess:
    """A ``orchestrator sim-inference`` subprocess; ``url`` is its base URL once started."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def sim_process(args: Sequence[str] = (), *, profile: ProfileName | None = None, dev_mode: bool = True,
                      timeout_s: float = 120.0) -> AsyncIterator[SimProcess]:
    """Run the simulated server as a subprocess on a free port; it is stopped (by its pid) on exit.

    ``timeout_s`` bounds its start (until it prints its address): a hang guard, since an interpreter importing
    aiohttp and numpy starts in a second or two on a quiet host and many times that with every core busy.

    ``args`` are more ``sim-inference`` flags; ``profile`` None leaves the profile to them (default vllm-0.31).
    """
    flags = [*(["--profile", profile] if profile is not None else []), *([] if dev_mode else ["--no-dev-mode"])]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "sim-inference", "--port", "0", *flags,
        *args, stdout=asyncio.subprocess.PIPE, env=child_env(),
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        if not line.startswith(b"http"):
            raise RuntimeError(f"sim-inference did not print its address (got {line!r})")
        yield SimProcess(proc, line.decode().strip())
    finally:
        await terminate(proc)
