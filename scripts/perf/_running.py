"""A job's orchestrator running in this process, for the benchmarks that time it (bench_distill, bench_scheduler):
the reference trainer as a subprocess (``orchestrator receive --no-announce``: no weight syncs, so every pass
samples the same policy), and the run started; entered once its env workers are ready, so start-up is not timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from orchestrator.procs import terminate

if TYPE_CHECKING:
    from orchestrator.app import Orchestrator
    from orchestrator.config import JobConfig


@contextlib.asynccontextmanager
async def running(cfg: JobConfig, workers: int = 2) -> AsyncIterator[tuple[Orchestrator, asyncio.Future[Any]]]:
    """The orchestrator of ``cfg`` and its run's future, once ``workers`` env workers are ready; on the way out a
    run not yet done is cancelled and the trainer ended."""
    from orchestrator.app import Orchestrator

    async with Orchestrator.open(cfg) as orch:
        trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "receive", orch.sender.address,
            "--no-announce")
        run = None
        try:
            orch.on_step = lambda m: None
            run = asyncio.ensure_future(orch.run())
            await orch.hub.wait_ready(workers, 300, cfg.monitor.stall_warn_s)
            yield orch, run
        finally:
            if run is not None and not run.done():
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
            await terminate(trainer, 5)
