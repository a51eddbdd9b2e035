"""Crashes of either side, as real processes: the trainer gets every step exactly once, in order.

`orchestrator run` and the reference trainer (`orchestrator receive --journal`) run as subprocesses against a
sim server; the journal is the trainer's record of what it received.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import orjson
import pytest

from orchestrator.contracts.link import ckpt_address
from orchestrator.state import load_state
from orchestrator.testing.procs import (
    logged,
    orchestrator_process,
    processes_mentioning,
    unix_connections,
    wait_until,
    write_job,
)
from orchestrator.testing.sim import sim_process
from orchestrator.trainer.reference import read_journal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.usefixtures("verifiers_home")]
HANG_GUARD_S = 240.0  # every wait ends on an event; this only stops one that never comes (a test took 146 s under load)


def journal_steps(path: Path) -> list[int]:
    return [int(r["step"]) for r in read_journal(path)]


def file_steps(path: Path) -> list[int]:
    return [orjson.loads(line)["step"] for line in path.read_bytes().splitlines()]


async def test_sigkilled_orchestrator_resumes_and_the_trainer_gets_every_step_once(tmp_path: Path,
                                                                                 data_plane: str) -> None:
    steps = 8
    journal = tmp_path / "trainer.jsonl"
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, steps, "resume", data_plane)
        async with orchestrator_process("receive", f"ipc://{out}/trainer.sock", "--journal", str(journal),
                                        "--train-s", "0.3", "--checkpoint-dir", str(tmp_path / "ckpt")) as trainer:
            async with orchestrator_process("run", str(cfg)) as run:
                await wait_until(lambda: len(journal_steps(journal)) >= 3, HANG_GUARD_S, "3 steps at the trainer",
                                 alive=run)
                os.kill(run.pid, signal.SIGKILL)  # mid-run: no cleanup of any kind
                await run.wait()
            # its env workers follow it (parent-death signal): nothing is left to talk to the next run
            await wait_until(lambda: not processes_mentioning(f"{out}/workers.sock"), HANG_GUARD_S,
                             "orphaned env workers to end")
            killed_at = load_state(out, "resume").acked_step
            async with orchestrator_process("run", str(cfg), "--resume") as resumed:
                code = await asyncio.wait_for(resumed.wait(), HANG_GUARD_S)
            assert code == 0
            assert trainer.returncode is None, "the trainer must outlive both orchestrator runs"
    assert journal_steps(journal) == list(range(steps))  # no gap, no duplicate, in order
    state = load_state(out, "resume")
    assert (state.next_step, state.acked_step) == (steps, steps - 1)
    # rows of the steps after the last acknowledged one were dropped and written again: each step once
    metrics = file_steps(out / "metrics.jsonl")
    assert metrics == list(range(steps)), f"killed with step {killed_at} acknowledged"
    assert sorted(set(file_steps(out / "rollouts.jsonl"))) == list(range(steps))
    assert file_steps(out / "rollouts.jsonl") == sorted(file_steps(out / "rollouts.jsonl"))


async def test_trainer_absent_at_start_then_killed_and_restarted(tmp_path: Path, data_plane: str) -> None:
    steps = 8
    journal = tmp_path / "trainer.jsonl"
    address = f"ipc://{tmp_path / 'out'}/trainer.sock"
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, steps, "resume", data_plane)
        run_log = tmp_path / "run.log"
        async with orchestrator_process("run", str(cfg), "--set", "monitor.stall_warn_s=2", log=run_log) as run:
            # no trainer: the first step waits in the send (with a warning every stall_warn_s), the run does not
            # fail and writes nothing
            await wait_until(lambda: bool(logged(run_log, "step 0 waits: the trainer at ")), HANG_GUARD_S,
                             "step 0 waiting in the send", alive=run)
            assert processes_mentioning(f"{out}/workers.sock")
            assert run.returncode is None
            assert not (out / "metrics.jsonl").exists() or file_steps(out / "metrics.jsonl") == []
            async with orchestrator_process("receive", address, "--journal", str(journal), "--checkpoint-dir",
                                            str(tmp_path / "ckpt")) as trainer:
                await wait_until(lambda: len(journal_steps(journal)) >= 4, HANG_GUARD_S, "4 steps at the trainer",
                                 alive=run)
                os.kill(trainer.pid, signal.SIGKILL)
                await trainer.wait()
            # a trainer comes back after the run has dropped the dead one's connections (as a real one, which
            # takes seconds to start, does); else ZMQ could deal resent steps to the dead connection
            socks = [address.removeprefix("ipc://"), ckpt_address(address).removeprefix("ipc://")]
            await wait_until(lambda: not any(map(unix_connections, socks)), HANG_GUARD_S,
                             "the run to close the killed trainer's connections", alive=run)
            async with orchestrator_process("receive", address, "--journal", str(journal), "--checkpoint-dir",
                                            str(tmp_path / "ckpt")):
                code = await asyncio.wait_for(run.wait(), HANG_GUARD_S)
    assert code == 0
    assert journal_steps(journal) == list(range(steps))
