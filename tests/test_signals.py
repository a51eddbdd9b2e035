"""Signals as real supervisors send them: GNU ``timeout`` relays a SIGTERM to the process and again to its
process group, so the orchestrator receives it twice; that is one request, and cleanup runs."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from orchestrator.commands.run import DUPLICATE_S, classify_signal
from orchestrator.testing.procs import processes_mentioning, wait_until, write_job
from orchestrator.testing.sim import sim_process

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("timeout") is None, reason="needs GNU timeout")]


async def test_sigterm_through_gnu_timeout_counts_once_and_cleanup_runs(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, 1000, "signals")
        metrics = out / "metrics.jsonl"
        # GNU timeout puts itself and the run in a new process group; on SIGTERM it sends SIGTERM to the run,
        # then to the whole group (coreutils src/timeout.c, cleanup())
        sup = await asyncio.create_subprocess_exec(
            "timeout", "3600", sys.executable, "-m", "orchestrator", "--log-level", "INFO", "run", str(cfg),
            stderr=asyncio.subprocess.PIPE)
        try:
            # no trainer: the run waits at its first send, with its env workers up
            await wait_until(lambda: bool(processes_mentioning(f"{out}/workers.sock")), 180, "env workers",
                             alive=sup)
            sup.send_signal(signal.SIGTERM)
            assert sup.stderr is not None
            stderr = (await asyncio.wait_for(sup.stderr.read(), 120)).decode()
            code = await asyncio.wait_for(sup.wait(), 60)
        finally:
            if sup.returncode is None:
                sup.kill()
                await sup.wait()
    assert code == 130, stderr[-3000:]  # interrupted, cleaned up: not 124 (a second signal's hard exit)
    # whether the two copies arrive apart or merge into one pending signal is the kernel's timing: either way
    # exactly one shutdown, and no hard exit
    assert stderr.count("SIGTERM: stopping") == 1
    assert "exiting now" not in stderr
    await wait_until(lambda: not processes_mentioning(f"{out}/workers.sock"), 30, "env workers gone")
    assert not metrics.exists() or metrics.read_bytes() == b""


async def test_a_sigterm_to_the_process_then_to_its_group_counts_once(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The same two copies, the second sent only after the first was handled (so the kernel cannot merge
    them), inside a window set wide enough that load cannot push the copy out of it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORCHESTRATOR_SIGNAL_REPEAT_S", "120")
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, 1000, "signals")
        run = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--log-level", "INFO", "run", str(cfg),
            stderr=asyncio.subprocess.PIPE, start_new_session=True)  # its own process group, as under timeout
        try:
            await wait_until(lambda: bool(processes_mentioning(f"{out}/workers.sock")), 180, "env workers",
                             alive=run)
            assert run.stderr is not None
            run.send_signal(signal.SIGTERM)
            lines: list[bytes] = []
            while not any(b"SIGTERM: stopping" in line for line in lines):
                lines.append(await asyncio.wait_for(run.stderr.readline(), 120))
                assert lines[-1], b"".join(lines).decode()
            os.killpg(run.pid, signal.SIGTERM)  # the group's copy: the run and its env workers
            stderr = (b"".join(lines) + await asyncio.wait_for(run.stderr.read(), 120)).decode()
            code = await asyncio.wait_for(run.wait(), 60)
        finally:
            if run.returncode is None:
                run.kill()
                await run.wait()
    assert code == 130, stderr[-3000:]
    assert stderr.count("SIGTERM: stopping") == 1
    assert "the same request" in stderr
    assert "exiting now" not in stderr
    await wait_until(lambda: not processes_mentioning(f"{out}/workers.sock"), 30, "env workers gone")


@pytest.mark.parametrize(("first", "sig", "now", "kind"), [
    (None, signal.SIGTERM, 5.0, "stop"),
    ((signal.SIGTERM, 5.0), signal.SIGTERM, 5.0 + DUPLICATE_S / 2, "duplicate"),  # timeout's relay to the group
    ((signal.SIGTERM, 5.0), signal.SIGTERM, 5.0 + DUPLICATE_S, "force"),  # asked again, later: exit now
    ((signal.SIGTERM, 5.0), signal.SIGINT, 5.1, "force"),  # Ctrl-C during a SIGTERM shutdown
    ((signal.SIGINT, 5.0), signal.SIGINT, 9.0, "force"),
])
def test_which_signal_is_a_repeat_of_the_same_request(first: tuple[int, float] | None, sig: int, now: float,
                                                      kind: str) -> None:
    assert classify_signal(first, sig, now) == kind
