"""The weight sync loop (sync_loop.py) over in-memory servers and a real scheduler: a refused checkpoint keeps
the servers' policy and is checked again, a loadable one cancels the refusal clock, and a job whose checkpoints
cannot be loaded for ``inference.unloadable_checkpoint_s`` stops naming the checkpoint. The event loop's clock is
virtual (orchestrator.testing.clock): the real bound and recheck interval, at full speed, and no bound depends on
how fast this machine is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.engines import job_scheduler
from orchestrator.errors import CheckpointError, UnloadableCheckpoint
from orchestrator.inference.pool import InferencePool
from orchestrator.policy import Policy
from orchestrator.state import OrchestratorState
from orchestrator.testing.clock import virtual_time
from orchestrator.testing.fake_server import FakeInferenceServer
from orchestrator.testing.procs import wait_until
from orchestrator.testing.workers import FakeWorkerHub
from orchestrator.weights.sync_loop import RECHECK_S, WeightSyncLoop

BOUND_S = 30.0
WAIT_S = 60.0  # a hang guard for waits on the loop's own events (virtual seconds)


class Job:
    """A loop, its scheduler and servers, and the announcements it reads."""

    def __init__(self, tmp_path: Path) -> None:
        path = tmp_path / "job.toml"
        path.write_text(f'[inference]\nservers = ["http://fake.invalid/v1"]\nweights_path = "{tmp_path}/step_{{step}}"'
                        f'\nunloadable_checkpoint_s = {BOUND_S}\n[scheduler]\nbatch_size = 8\n'
                        '[[env]]\nname = "a"\ntaskset = "x"\ngroup_size = 4\n')
        cfg = load_config(path)
        self.dir = tmp_path
        self.fake = FakeInferenceServer()
        self.pool = InferencePool(cfg.inference, [self.fake])
        self.sched = job_scheduler(cfg, self.pool, FakeWorkerHub({"a": 50}), 0)
        self.state = OrchestratorState("t")
        self.loop = WeightSyncLoop(self.pool, self.sched, self.state, cfg.inference)
        self.queue: asyncio.Queue[Checkpoint] = asyncio.Queue()

    async def announcements(self) -> AsyncIterator[Checkpoint]:
        while True:
            yield await self.queue.get()

    def good(self, step: int) -> None:
        Policy.initial().save(self.dir / f"step_{step}")

    async def policy(self, step: int) -> None:
        await wait_until(lambda: self.sched.policy == step, WAIT_S, f"policy {step}", poll_s=0.01)

    async def refused(self, step: int) -> None:
        await wait_until(lambda: f"checkpoint {step} cannot be loaded" in (self.sched.loading or ""), WAIT_S,
                         f"checkpoint {step} refused", poll_s=0.01)

    def loads(self) -> list[str]:
        return [c[3]["kwargs"]["weights_path"] for c in self.fake.calls if c[1] == "/collective_rpc"]


@contextlib.asynccontextmanager
async def running(job: Job) -> AsyncIterator[asyncio.Future[None]]:
    run = asyncio.ensure_future(job.loop.run(job.announcements()))
    try:
        yield run
    finally:
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await run


@virtual_time
async def test_a_refused_checkpoint_is_retried_and_a_run_without_a_loadable_one_stops_naming_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = asyncio.get_running_loop()
    job = Job(tmp_path)
    job.good(1)
    with caplog.at_level(logging.DEBUG, logger="orchestrator"):
        async with running(job) as run:
            job.queue.put_nowait(Checkpoint(1))
            await job.policy(1)
            job.queue.put_nowait(Checkpoint(2))
            await job.refused(2)
            refused_at = clock.time()
            assert (job.sched.policy, job.sched.syncing, job.loads()) == (1, False, [f"{tmp_path}/step_1"])
            assert f"{tmp_path}/step_2 does not exist; the servers keep the weights of step 1, in rotation; the " \
                   "run stops at " in (job.sched.loading or "")
            await asyncio.sleep(BOUND_S - RECHECK_S - 1)
            job.good(2)  # mended (written late): the next recheck, the last before the bound, loads it
            await job.policy(2)
            assert BOUND_S - RECHECK_S - 1 < clock.time() - refused_at < BOUND_S
            job.queue.put_nowait(Checkpoint(3))
            await job.refused(3)
            refused_at = clock.time()
            await asyncio.sleep(BOUND_S - 1)  # the clock started again at this refusal: not up yet
            again = f"checkpoint 3 cannot be loaded: {tmp_path}/step_3 does not exist (checked again)"
            assert again in caplog.text
            assert not run.done()
            with pytest.RaisesGroup(pytest.RaisesExc(CheckpointError, match=(
                    f"^checkpoint 3 cannot be loaded: {tmp_path}/step_3 does not exist; no checkpoint has loaded for "
                    "30 s since the first was refused \\(inference.unloadable_checkpoint_s\\), so the run stops"))):
                await asyncio.wait_for(run, WAIT_S)
            # at the bound (give or take refused()'s poll and the real time of the rechecks' file checks)
            assert abs(clock.time() - refused_at - BOUND_S) < 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert [e.split(";")[0] for e in errors] == [f"checkpoint 2 cannot be loaded: {tmp_path}/step_2 does not exist",
                                                 f"checkpoint 3 cannot be loaded: {tmp_path}/step_3 does not exist"]
    assert job.loads() == [f"{tmp_path}/step_1", f"{tmp_path}/step_2"]  # nothing unloadable reached the server


@virtual_time
async def test_a_newer_checkpoint_that_loads_cancels_the_clock(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.good(3)
    async with running(job) as run:
        job.queue.put_nowait(Checkpoint(2))
        await job.refused(2)
        await asyncio.sleep(BOUND_S - 1)
        job.queue.put_nowait(Checkpoint(3))
        await job.policy(3)
        assert job.sched.loading is None
        await asyncio.sleep(BOUND_S)  # past the first refusal's bound: it no longer counts
        job.queue.put_nowait(Checkpoint(4))
        await job.refused(4)
        assert not run.done()


@virtual_time
async def test_a_policy_refused_at_resume_is_the_loops_to_retry(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.sched.policy = 5  # the state's policy; its directory is gone
    ckpt = Checkpoint(5, f"{tmp_path}/kept/5")
    with pytest.raises(UnloadableCheckpoint) as refused:
        await job.pool.update_weights(ckpt)
    job.loop.refuse(ckpt, refused.value)
    assert "checkpoint 5 cannot be loaded" in (job.sched.loading or "")
    async with running(job):
        Policy.initial().save(tmp_path / "kept" / "5")
        await wait_until(lambda: job.state.policy_path == ckpt.path, WAIT_S, "the policy reloaded", poll_s=0.01)
        assert job.loads() == [ckpt.path]
