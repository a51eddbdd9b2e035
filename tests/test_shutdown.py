"""`orchestrator run` as a real process: SIGTERM mid-run ends it promptly, non-zero, with no children left."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from orchestrator.testing.procs import orchestrator_process, processes_mentioning, wait_until, write_job
from orchestrator.testing.sim import sim_process

pytestmark = pytest.mark.slow


async def test_sigterm_stops_the_run_and_its_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, 1000, "shutdown")
        metrics = out / "metrics.jsonl"
        async with (orchestrator_process("run", str(cfg)) as run,
                    orchestrator_process("receive", f"ipc://{out}/trainer.sock", "--checkpoint-dir",
                                         str(tmp_path / "ckpt"))):
            await wait_until(lambda: metrics.exists() and metrics.read_bytes().count(b"\n") >= 1, 120,
                             "one step", alive=run)
            assert processes_mentioning(f"{out}/workers.sock"), "no env worker was running"
            run.send_signal(signal.SIGTERM)
            start = time.monotonic()
            code = await asyncio.wait_for(run.wait(), 15)
            assert time.monotonic() - start < 10
            assert code == 130
            await asyncio.sleep(0.5)
            assert processes_mentioning(f"{out}/workers.sock") == []


HUNG_CLEANUP = """
import asyncio, sys
from orchestrator.commands.run import interruptible

async def job():
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
        await asyncio.sleep(1.0)  # past interpreter start-up and signal handler installation
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        code = await asyncio.wait_for(proc.wait(), 10)
        assert time.monotonic() - start < 5
        assert code == 124
        assert proc.stdout is not None
        assert proc.stderr is not None
        assert b"cleanup started" in await proc.stdout.read()
        assert b"shutdown did not finish within 1 s" in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()
