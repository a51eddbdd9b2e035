"""`orchestrator run` as a real process: SIGTERM mid-run ends it promptly, non-zero, with no children left; a
SIGKILLed one leaves none either, not even a stopped env worker.

"Promptly" is the run's own watchdog (``commands.run.SHUTDOWN_S``): a shutdown that outlives it exits 124, so
exit 130 says the cleanup finished within it. Waits here are hang guards only, sized for a busy machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from orchestrator.testing.jobs import ARITHMETIC
from orchestrator.testing.procs import (
    env_workers,
    logged,
    orchestrator_process,
    process_state,
    processes_mentioning,
    wait_until,
    write_job,
)
from orchestrator.testing.sim import sim_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HANG_GUARD_S = 120.0
START_S = 300.0  # hang guard of a run's first step or ready worker: importing verifiers takes minutes when busy


async def test_sigterm_stops_the_run_and_its_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     data_plane: str) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, 1000, "shutdown", data_plane)
        metrics = out / "metrics.jsonl"
        async with (orchestrator_process("run", str(cfg)) as run,
                    orchestrator_process("receive", f"ipc://{out}/trainer.sock", "--checkpoint-dir",
                                         str(tmp_path / "ckpt"))):
            await wait_until(lambda: metrics.exists() and metrics.read_bytes().count(b"\n") >= 1, START_S,
                             "one step", alive=run)
            assert processes_mentioning(f"{out}/workers.sock"), "no env worker was running"
            run.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(run.wait(), HANG_GUARD_S)
            assert code == 130  # cleanup finished within SHUTDOWN_S: past it, the watchdog exits 124
            # its env workers end with it (stopped by its cleanup, or by their parent-death signal)
            await wait_until(lambda: processes_mentioning(f"{out}/workers.sock") == [], HANG_GUARD_S,
                             "the run's env workers to end")


async def test_one_signal_during_start_up_exits_130_within_the_bound(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: SIGINT just after the run started its two env workers. They were stopped one after
    another with 5 s each, and one that had not connected never got the hub's stop: 10 s, past the 8 s bound,
    so a single Ctrl-C exited 124."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    log = tmp_path / "run.log"
    async with sim_process() as server:
        # its workers stay loading (as with a download): forked from a warm process, they would be ready at once
        loading = {**ARITHMETIC, "taskset": "orchestrator-faulty", "args": {"fail_in": "hold_load", "hold_s": 600}}
        cfg, out = write_job(tmp_path, server.url, 1000, "startup-signal", workers=2, env=loading)
        async with orchestrator_process("run", str(cfg), log_level="INFO", log=log) as run:
            await wait_until(lambda: len(env_workers(f"{out}/workers.sock")) == 2, START_S,
                             "both env workers started", alive=run, poll_s=0.02)
            run.send_signal(signal.SIGINT)
            code = await asyncio.wait_for(run.wait(), HANG_GUARD_S)
        # what the test is about: no worker had finished starting
        ready = [line for line in logged(log, " ready (") if "env worker" in line]
        assert not ready, ready
        assert code == 130, "\n".join(logged(log, ""))  # cleanup finished within SHUTDOWN_S (past it: 124)
        await wait_until(lambda: processes_mentioning(f"{out}/workers.sock") == [], HANG_GUARD_S,
                         "the run's env workers to end")


async def test_a_sigkilled_run_leaves_no_worker_behind_even_a_stopped_one(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: a parent-death signal of SIGTERM stays pending on a stopped process, so a worker frozen
    when its orchestrator was SIGKILLed stayed (state T, parent 1) until someone sent it SIGCONT."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    log = tmp_path / "run.log"
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, 1000, "orphans")
        async with orchestrator_process("run", str(cfg), log_level="INFO", log=log) as run:
            # ready: it asked for its parent-death signal long before (the first thing its command line does)
            await wait_until(lambda: bool(logged(log, "env worker local-0 ready")), START_S, "the worker ready",
                             alive=run)
            [worker] = env_workers(f"{out}/workers.sock")
            os.kill(worker, signal.SIGSTOP)
            # stopped, not just signalled: a SIGTERM that came before the stop took effect would still end it
            await wait_until(lambda: process_state(worker) == "T", HANG_GUARD_S, "the worker stopped", poll_s=0.01)
            run.kill()
            await run.wait()
        try:  # the kernel's signal is immediate; the bound is for a busy machine's scheduling only
            await wait_until(lambda: worker not in processes_mentioning(f"{out}/workers.sock"), 30,
                             f"the stopped worker {worker} to end with its parent")
        finally:  # failed: end it here, by its pid
            if process_state(worker) not in (None, "Z"):
                os.kill(worker, signal.SIGKILL)


HUNG_CLEANUP = """
import asyncio, sys
from orchestrator.commands.run import interruptible

async def job():
    print("started", flush=True)  # interruptible() has installed its signal handlers
    try:
        await asyncio.sleep(3600)
    finally:
        print("cleanup started", flush=True)
        await asyncio.shield(asyncio.sleep(3600))  # a cleanup that never ends

sys.exit(asyncio.run(interruptible(job(), shutdown_s=1.0)))
"""


async def test_a_hung_shutdown_is_an_error_exit_within_the_bound() -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", HUNG_CLEANUP, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        assert await asyncio.wait_for(proc.stdout.readline(), HANG_GUARD_S) == b"started\n"
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        # the cleanup never ends: without the bound this would wait out the hang guard, not 3600 s of cleanup
        code = await asyncio.wait_for(proc.wait(), HANG_GUARD_S)
        assert time.monotonic() - start >= 1.0  # the cleanup had its 1 s before the exit
        assert code == 124
        assert b"cleanup started" in await proc.stdout.read()
        assert b"shutdown did not finish within 1 s" in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()
