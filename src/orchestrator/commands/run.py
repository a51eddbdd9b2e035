"""``orchestrator run CONFIG``: run a job against the inference servers and trainer it names."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Coroutine
from typing import Any

from orchestrator.cli import run_async
from orchestrator.commands.check import add_set_argument
from orchestrator.config import load_config

HELP = "run a job: rollouts from the config's environments and servers, batches to the trainer"
log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job config (TOML)")
    add_set_argument(p)
    p.add_argument("--resume", action="store_true", help="continue from the state saved in run.output_dir")


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # a ConfigError exits 2 before anything starts

    async def job() -> None:
        from orchestrator.app import Orchestrator

        async with Orchestrator.open(cfg, resume=args.resume) as orch:
            await orch.run()

    return run_async(interruptible(job()))


async def interruptible(coro: Coroutine[Any, Any, None]) -> int:
    """Run ``coro``; SIGINT/SIGTERM cancel it (its cleanup runs) and the exit status is 130, not 0."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    caught: list[int] = []

    def stop(sig: int) -> None:
        log.warning("%s: stopping (cancelling in-flight work)", signal.Signals(sig).name)
        caught.append(sig)
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig)
    try:
        await coro
    except asyncio.CancelledError:
        if not caught:
            raise
        return EXIT_INTERRUPTED
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0
