"""The liveness rule, with real processes (issue #21, items 1, 4 and 5): a step that cannot progress either
resolves or is named in the log within the bound, ``monitor.stall_warn_s``.

`orchestrator run` and the reference trainer (`orchestrator receive --journal`) run as subprocesses against a
sim server, their logs in files. Every wait is for an event (a journal line, a log line, an exit); the bounds
are hang guards sized for process start-ups on a busy machine. Where a test waits for a stall line it sets
``monitor.stall_warn_s`` to 2 s, so the line comes in seconds; the default is 30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest

from orchestrator.state import load_state, save_state
from orchestrator.testing.procs import (
    Process,
    logged,
    orchestrator_process,
    processes_mentioning,
    wait_until,
    write_job,
)
from orchestrator.testing.sim import sim_process
from orchestrator.trainer.reference import read_journal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("verifiers_home")]

HANG_GUARD_S = 240.0  # process start-ups, env workers and a run of a few steps, on a loaded 2-core machine


def journal_steps(path: Path) -> list[int]:
    return [int(r["step"]) for r in read_journal(path)]


def cut_journal(path: Path, keep: int) -> None:
    """Keep the first ``keep`` lines: a trainer whose checkpoint is older than what it acknowledged."""
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:keep]))


def trainer(out: Path, journal: Path, ckpt: Path, log: Path, *extra: str
            ) -> contextlib.AbstractAsyncContextManager[Process]:
    """The reference trainer on the run's address, journalling, announcing checkpoint directories."""
    return orchestrator_process("receive", f"ipc://{out}/trainer.sock", "--journal", str(journal),
                                "--checkpoint-dir", str(ckpt), *extra, log=log, log_level="INFO")


async def test_both_sides_killed_and_restarted_continue_without_waiting_for_old_weights(tmp_path: Path) -> None:
    """Item 1: both SIGKILLed; the trainer had a step the orchestrator's state had not seen acknowledged, so
    the resumed run skips it, and its next step needs weights the trainer announced before the crash. The
    restarted trainer says which weights it resumed from when it connects: no livelock, every step once."""
    steps = 8
    journal, ckpt = tmp_path / "trainer.jsonl", tmp_path / "ckpt"
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, steps, "both")
        async with trainer(out, journal, ckpt, tmp_path / "trainer.log", "--train-s", "0.2") as first, \
                orchestrator_process("run", str(cfg), log=tmp_path / "run.log") as run:
            await wait_until(lambda: len(journal_steps(journal)) >= 4, HANG_GUARD_S, "4 steps at the trainer",
                             alive=run)
            for proc in (run, first):
                os.kill(proc.pid, signal.SIGKILL)  # no cleanup of any kind, on either side
            await run.wait()
            await first.wait()
        await wait_until(lambda: not processes_mentioning(f"{out}/workers.sock"), 60, "orphaned env workers")
        # The crash window of the issue, made certain: the state saw step `last` neither acknowledged nor its
        # weights (last + 1) announced, and holds the policy before them. The resumed run skips step `last`;
        # step last + 1 needs policy >= last (max_async_level 1), newer than the state's.
        last = journal_steps(journal)[-1]
        state = load_state(out, "both")
        state.acked_step = min(state.acked_step, last - 1)
        state.policy_step = min(state.policy_step, last - 1)
        state.policy_path = str((ckpt / f"step_{state.policy_step}").resolve()) if state.policy_step else None
        save_state(out, state)
        async with trainer(out, journal, ckpt, tmp_path / "trainer2.log") as second, \
                orchestrator_process("run", str(cfg), "--resume", log=tmp_path / "resumed.log",
                                     log_level="INFO") as resumed:
            code = await asyncio.wait_for(resumed.wait(), HANG_GUARD_S)
            assert second.returncode is None
    assert code == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    assert journal_steps(journal) == list(range(steps))  # every step once, in order
    assert logged(tmp_path / "resumed.log", f"step {last} not sent: the trainer at ")  # the skip the issue saw
    assert logged(tmp_path / "resumed.log", f"weights of step {last + 1} on 1/1 servers")  # announced on connect


async def test_a_step_waiting_for_weights_is_named_then_resolved_by_a_trainer_that_has_them(tmp_path: Path) -> None:
    """Item 1: a trainer that announces nothing stalls step 2 (it takes policy >= 1). Within the bound the
    orchestrator names the wait and asks the trainer, which says it has announced nothing. A trainer
    restarted from that journal connects with the weights after its last step, and the run finishes."""
    steps = 4
    journal, ckpt = tmp_path / "trainer.jsonl", tmp_path / "ckpt"
    run_log = tmp_path / "run.log"
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, steps, "named")
        async with orchestrator_process("run", str(cfg), "--set", "monitor.stall_warn_s=2", log=run_log) as run:
            async with trainer(out, journal, ckpt, tmp_path / "silent.log", "--no-announce") as silent:
                said = "step 2 has 0 of 8 after "
                await wait_until(lambda: bool(logged(run_log, said)), HANG_GUARD_S, "the stall line", alive=run)
                line = logged(run_log, said)[0]
                assert "s without progress: waits for a checkpoint of policy >= 1 (the servers have policy 0; " \
                       "no training group opens until then): trainer " in line, line
                assert "has announced no checkpoint; asked it for its newest" in line, line
                await wait_until(lambda: bool(logged(tmp_path / "silent.log", "waits for weights of step >= 1")),
                                 HANG_GUARD_S, "the trainer told", alive=silent)
                await wait_until(lambda: journal_steps(journal) == [0, 1], HANG_GUARD_S, "steps 0 and 1 journalled")
                os.kill(silent.pid, signal.SIGKILL)
                await silent.wait()
            async with trainer(out, journal, ckpt, tmp_path / "trainer.log"):
                code = await asyncio.wait_for(run.wait(), HANG_GUARD_S)
    assert code == 0, run_log.read_text()[-3000:]
    assert journal_steps(journal) == list(range(steps))


async def test_a_paused_trainer_is_named_within_the_bound_and_the_run_goes_on_when_it_resumes(tmp_path: Path) -> None:
    """Item 1: a trainer paused (SIGSTOP) stalled a step without a word. Within the bound a line names what the
    step waits for: the trainer's acknowledgements (the window is full) or its checkpoint (the policy is too
    old for the step), whichever comes first; once it resumes the run finishes."""
    steps = 6
    journal, ckpt = tmp_path / "trainer.jsonl", tmp_path / "ckpt"
    run_log = tmp_path / "run.log"

    def named() -> list[str]:
        return [line for line in logged(run_log, " waits") if "waits for a checkpoint of policy >= " in line
                or "has not acknowledged steps" in line]

    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, steps, "paused")
        async with orchestrator_process("run", str(cfg), "--set", "monitor.stall_warn_s=2", log=run_log) as run, \
                trainer(out, journal, ckpt, tmp_path / "trainer.log") as paused:
            await wait_until(lambda: len(journal_steps(journal)) >= 1, HANG_GUARD_S, "a step at the trainer",
                             alive=run)
            os.kill(paused.pid, signal.SIGSTOP)
            try:
                await wait_until(lambda: bool(named()), HANG_GUARD_S, "a line naming the wait", alive=run)
            finally:
                os.kill(paused.pid, signal.SIGCONT)
            code = await asyncio.wait_for(run.wait(), HANG_GUARD_S)
    assert code == 0, run_log.read_text()[-3000:]
    assert journal_steps(journal) == list(range(steps))


@pytest.mark.parametrize("keep_acked", [0, 16], ids=["steps-gone", "steps-kept"])
async def test_a_trainer_restarted_behind_its_acknowledged_step(tmp_path: Path, keep_acked: int) -> None:
    """Item 4: the trainer acknowledged steps its restart does not have (its journal cut back). With the steps
    kept (transport.keep_acked) it gets them again; without, it is refused at once naming the steps it lacks
    and the checkpoint it needs, on both sides, and a trainer restarted from that checkpoint finishes the run."""
    steps = 8
    journal, ckpt = tmp_path / "trainer.jsonl", tmp_path / "ckpt"
    run_log = tmp_path / "run.log"
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, steps, "behind")
        async with orchestrator_process("run", str(cfg), "--set", f"transport.keep_acked={keep_acked}",
                                        log=run_log) as run:
            async with trainer(out, journal, ckpt, tmp_path / "first.log") as first:
                # the orchestrator has seen step 3 acknowledged (its state says so after a step's send)
                await wait_until(lambda: (out / "orchestrator-state.msgpack").exists()
                                 and load_state(out, "behind").acked_step >= 3, HANG_GUARD_S, "step 3 acknowledged",
                                 alive=run)
                os.kill(first.pid, signal.SIGKILL)
                await first.wait()
            shutil.copy(journal, tmp_path / "full.jsonl")
            cut_journal(journal, 2)  # restarts holding step 1
            async with trainer(out, journal, ckpt, tmp_path / "behind.log") as behind:
                if keep_acked:
                    code = await asyncio.wait_for(run.wait(), HANG_GUARD_S)
                    assert code == 0, run_log.read_text()[-3000:]
                    assert journal_steps(journal) == list(range(steps))
                    return
                assert await asyncio.wait_for(behind.wait(), HANG_GUARD_S) == 1
            said = "refused this trainer: it holds steps up to 1, but steps 2.."
            assert logged(tmp_path / "behind.log", said), (tmp_path / "behind.log").read_text()[-3000:]
            refused = logged(run_log, "refused trainer")
            assert len(refused) == 1
            assert " ERROR " in refused[0]
            assert "restart it from a checkpoint of step " in refused[0]
            assert run.returncode is None  # it waits for a trainer that can go on
            shutil.copy(tmp_path / "full.jsonl", journal)  # restarted from its newest checkpoint
            async with trainer(out, journal, ckpt, tmp_path / "trainer.log"):
                code = await asyncio.wait_for(run.wait(), HANG_GUARD_S)
    assert code == 0, run_log.read_text()[-3000:]
    assert journal_steps(journal) == list(range(steps))


async def test_a_second_trainer_on_the_address_is_refused_and_the_first_gets_every_step(tmp_path: Path) -> None:
    """Item 5: a second trainer started on the same address used to get every other step (both then rejected
    the rest, silently). It is refused, says why and exits 1; the first trainer gets every step. The first is
    stopped (SIGSTOP) meanwhile, still connected, so the run cannot end before the second is refused."""
    steps = 6
    journal, ckpt = tmp_path / "trainer.jsonl", tmp_path / "ckpt"
    run_log = tmp_path / "run.log"
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, steps, "two")
        async with orchestrator_process("run", str(cfg), log=run_log) as run, \
                trainer(out, journal, ckpt, tmp_path / "first.log") as first:
            await wait_until(lambda: len(journal_steps(journal)) >= 1, HANG_GUARD_S, "a step at the trainer",
                             alive=run)
            os.kill(first.pid, signal.SIGSTOP)
            try:
                async with trainer(out, tmp_path / "second.jsonl", ckpt, tmp_path / "second.log") as second:
                    assert await asyncio.wait_for(second.wait(), HANG_GUARD_S) == 1
            finally:
                os.kill(first.pid, signal.SIGCONT)
            code = await asyncio.wait_for(run.wait(), HANG_GUARD_S)
    assert code == 0, run_log.read_text()[-3000:]
    assert journal_steps(journal) == list(range(steps))
    assert journal_steps(tmp_path / "second.jsonl") == []
    said = logged(tmp_path / "second.log", "refused this trainer: trainer ")
    assert said, (tmp_path / "second.log").read_text()[-3000:]
    assert "already receives this link's batches" in said[0]
    assert len(logged(run_log, "refused trainer ")) == 1
