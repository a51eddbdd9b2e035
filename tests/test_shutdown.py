"""`orchestrator run` as a real process: SIGTERM mid-run ends it promptly, non-zero, with no children left."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from orchestrator.testing.sim import sim_process

pytestmark = pytest.mark.slow


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if text.encode() in (d / "cmdline").read_bytes():
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


async def test_sigterm_stops_the_run_and_its_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    async with sim_process() as server:
        cfg = tmp_path / "job.toml"
        cfg.write_text(f"""
[run]
name = "shutdown"
output_dir = "{out}"
max_steps = 1000
[inference]
servers = ["{server.url}"]
[scheduler]
batch_size = 8
max_inflight = 8
[[env]]
taskset = "orchestrator-arithmetic"
group_size = 4
workers = 1
sampling = {{ max_tokens = 4 }}
""")
        run = await asyncio.create_subprocess_exec(sys.executable, "-m", "orchestrator", "run", str(cfg))
        trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "receive", f"ipc://{out}/trainer.sock")
        try:
            deadline = time.monotonic() + 120
            metrics = out / "metrics.jsonl"
            while not (metrics.exists() and metrics.read_bytes().count(b"\n") >= 1):
                assert time.monotonic() < deadline, "no step within 120 s"
                assert run.returncode is None, f"run exited early with {run.returncode}"
                await asyncio.sleep(0.2)
            assert processes_mentioning(f"{out}/workers.sock"), "no env worker was running"
            run.send_signal(signal.SIGTERM)
            start = time.monotonic()
            code = await asyncio.wait_for(run.wait(), 15)
            assert time.monotonic() - start < 10
            assert code == 130
            await asyncio.sleep(0.5)
            assert processes_mentioning(f"{out}/workers.sock") == []
        finally:
            for proc in (run, trainer):
                if proc.returncode is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    await proc.wait()
