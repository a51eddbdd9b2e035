"""The hub's warm env worker (hub/forks.py, workers/zygote.py), with real processes: workers forked from one warm
process, their exits learnt from it, and what happens when it dies or cannot start."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest

from orchestrator.hub.forks import KILLED_WITH_IT, Forked, Forks
from orchestrator.procs import process_state, terminate
from orchestrator.testing.procs import wait_until
from orchestrator.workers.zygote import NAME, WORKER_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STARTUP_S = 300.0  # a hang guard: a warm-up imports verifiers (seconds; minutes on a loaded machine)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def name_of(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def gone(pid: int) -> bool:
    return process_state(pid) in (None, "Z")


async def forked(forks: Forks, address: str, name: str) -> Forked:
    child = await forks.spawn(["--connect", address, "--id", name])
    assert child is not None, f"the warm process forked no {name}"
    return child


async def test_workers_fork_from_one_warm_process_which_reports_their_exits_and_is_replaced_when_it_dies(
        tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/workers.sock"  # nobody binds it: the workers wait for their hub, alive
    forks = Forks(["--connect", address], {}, STARTUP_S)
    try:
        a, b = await forked(forks, address, "a"), await forked(forks, address, "b")
        warm = forks.pid
        assert warm is not None
        assert parent_of(a.pid) == parent_of(b.pid) == warm
        assert name_of(warm) == NAME
        # each names itself first thing after the fork (ps and top tell them apart)
        await wait_until(lambda: name_of(a.pid) == name_of(b.pid) == WORKER_NAME, 30, "the workers named")

        a.kill()
        assert await a.wait() == -signal.SIGKILL  # the status asyncio would report for a child of ours
        await terminate(b, STARTUP_S)
        assert b.returncode == -signal.SIGTERM
        assert gone(a.pid)
        assert gone(b.pid)

        c = await forked(forks, address, "c")
        assert (forks.pid, forks.starts) == (warm, 1)  # the same warm process forks again
        os.kill(warm, signal.SIGKILL)
        assert await c.wait() == KILLED_WITH_IT
        await wait_until(lambda: gone(c.pid), 30, "the worker to die with its warm process")

        d = await forked(forks, address, "d")  # from a new warm process
        assert forks.starts == 2
        assert forks.pid not in (None, warm)
        assert parent_of(d.pid) == forks.pid
    finally:
        await forks.close()
    assert not forks.usable
    assert await d.wait() == KILLED_WITH_IT
    await wait_until(lambda: gone(d.pid) and gone(warm), 30, "the warm process and its worker to end")
    assert await forks.spawn(["--connect", address, "--id", "e"]) is None  # closed: nothing more is forked


async def test_a_warm_process_that_cannot_start_leaves_each_worker_to_start_on_its_own(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    forks = Forks(["--connect", "not-an-address"], {}, STARTUP_S)  # a usage error: it exits 2 before it forks
    with caplog.at_level(logging.WARNING, logger="orchestrator.hub.forks"):
        try:
            assert await forks.spawn(["--connect", f"ipc://{tmp_path}/w.sock", "--id", "a"]) is None
            assert not forks.usable
            assert await forks.spawn(["--connect", f"ipc://{tmp_path}/w.sock", "--id", "b"]) is None
            assert forks.starts == 1  # not started again
        finally:
            await forks.close()
    assert ("env workers: the warm process exited (status 2) before it forked one; each worker starts on its own "
            "from now on") in caplog.text
