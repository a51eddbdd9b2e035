"""``orchestrator run CONFIG``: run a job against the inference servers and trainer it names; on a terminal a
progress bar with each environment's reward, otherwise a plain line per step (orchestrator.progress), on stdout."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Coroutine
from typing import Any

from orchestrator.cli import run_async
from orchestrator.commands.check import add_set_argument
from orchestrator.config import load_config

HELP = "run a job: rollouts from the config's environments and servers, batches to the trainer"
log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130
EXIT_HUNG = 124
SHUTDOWN_S = 8.0  # the bound is 10 s; the rest is interpreter exit
# GNU timeout and `kill -TERM -PGID` deliver one SIGTERM to the process and again through its group: a repeat
# this soon is the same request, not a second one (a second Ctrl-C to force an exit comes later than this)
DUPLICATE_S = float(os.environ.get("ORCHESTRATOR_SIGNAL_REPEAT_S", "1.0"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job config (TOML)")
    add_set_argument(p)
    p.add_argument("--resume", action="store_true", help="continue from the state saved in run.output_dir")
    p.add_argument("--force", action="store_true",
                   help="with --resume: resume even if the config changes what is sampled (seed, step size, envs)")


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # a ConfigError exits 2 before anything starts

    async def job() -> None:
        from orchestrator.app import Orchestrator
        from orchestrator.progress import StepProgress

        async with Orchestrator.open(cfg, resume=args.resume, force=args.force) as orch:
            with StepProgress(cfg.run.max_steps, orch.state.acked_step + 1) as progress:
                orch.on_step = progress.on_step
                await orch.run()

    return run_async(interruptible(job()))


async def interruptible(coro: Coroutine[Any, Any, None], shutdown_s: float = SHUTDOWN_S) -> int:
    """Run ``coro``; SIGINT/SIGTERM cancel it (its cleanup runs) and the exit status is 130, not 0.

    A shutdown is bounded: if cleanup has not finished ``shutdown_s`` after the signal, or a second signal
    comes (not the same one again within DUPLICATE_S), the process exits at once with status 124 (a hung
    shutdown is an error, never a success); child
    processes follow by their parent-death signal (procs.die_with_parent)."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    caught: list[tuple[int, float]] = []  # (signal, when)
    watchdog: list[threading.Timer] = []

    def stop(sig: int) -> None:
        name = signal.Signals(sig).name
        kind = classify_signal(caught[0] if caught else None, sig, time.monotonic())
        if kind == "duplicate":
            log.info("%s again within %.0f s: the same request (e.g. to the process and its group)", name,
                     DUPLICATE_S)
            return
        if kind == "force":
            hard_exit(f"second {name} during shutdown")
        log.warning("%s: stopping (cancelling in-flight work; at most %.0f s)", name, shutdown_s)
        caught.append((sig, time.monotonic()))
        task.cancel()
        timer = threading.Timer(shutdown_s, hard_exit, [f"shutdown did not finish within {shutdown_s:.0f} s"])
        timer.daemon = True  # a thread, so it fires even if the loop itself is stuck
        timer.start()
        watchdog.append(timer)

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
            if caught:  # the process is ending: a late copy of the signal must not turn 130 into a kill
                signal.signal(sig, signal.SIG_IGN)
        for timer in watchdog:
            timer.cancel()
    return 0


def classify_signal(first: tuple[int, float] | None, sig: int, now: float) -> str:
    """``"stop"`` for the first signal; ``"duplicate"`` for the same signal within DUPLICATE_S of it (one
    request delivered twice); ``"force"`` for any other: exit now. ``first`` is (signal, when) of the first."""
    if first is None:
        return "stop"
    return "duplicate" if sig == first[0] and now - first[1] < DUPLICATE_S else "force"


def hard_exit(why: str) -> None:
    """Exit now, with status EXIT_HUNG, skipping cleanup (it is what hangs)."""
    log.error("%s: exiting now with status %d", why, EXIT_HUNG)
    logging.shutdown()
    os._exit(EXIT_HUNG)
