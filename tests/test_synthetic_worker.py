"""The synthetic env worker (orchestrator.testing.synthetic_worker) as the benchmark uses it: a process admitted
as a remote worker, its fixed-shape rollouts reaching the trainer whole, on both data planes."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.app import Orchestrator
from orchestrator.columns.samples import Sample
from orchestrator.config import load_config
from orchestrator.contracts.wire import Batch
from orchestrator.procs import terminate
from orchestrator.testing.sim import sim_servers
from orchestrator.testing.synthetic_worker import ResidentStore, job_toml, worker_command
from orchestrator.trainer.reference import ReferenceTrainer

pytestmark = pytest.mark.slow
JOB_GUARD_S = 240.0  # a hang guard: the job takes seconds on a quiet host
TOKENS, LAYERS, TOP_K = 96, 4, 2


@pytest.mark.parametrize("plane", ["through", "direct"])  # not the data_plane fixture: both, in every run
async def test_synthetic_rollouts_reach_the_trainer_whole(tmp_path: Path, plane: str) -> None:
    async with sim_servers(1) as servers:
        job = tmp_path / "job.toml"
        job.write_text(job_toml(tmp_path / "out", servers[0].url, data_plane=plane, batch=16, steps=2, workers=1,
                                pool_mb=8))
        cfg = load_config(job)
        batches: list[Batch] = []
        switch = sys.getswitchinterval()
        during: list[float] = []
        async with Orchestrator.open(cfg) as orch:
            orch.on_step = lambda _m: during.append(sys.getswitchinterval())
            worker = await asyncio.create_subprocess_exec(*worker_command(
                orch.hub.address, "syn-0", tokens=TOKENS, layers=LAYERS, top_k=TOP_K, rate=200,
                prefault=plane == "direct"))
            try:
                trainer = ReferenceTrainer(orch.sender.address, max_steps=2, on_batch=batches.append, announce=False)
                async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                    tg.create_task(trainer.run())
                    await orch.run()
            finally:
                await terminate(worker, 10)
            pool = orch.hub.pools.pool("syn-0")
            released = orch.hub.metrics["released"]
    assert (pool is not None, released > 0) == (plane == "direct",) * 2  # direct: columns in the worker's pool
    assert [r.step for r in trainer.received] == [0, 1]
    assert during == [cfg.run.gil_switch_ms / 1e3] * 2  # run.gil_switch_ms while the job runs, then as it was
    assert sys.getswitchinterval() == switch
    for batch in batches:
        n = batch.num_samples
        assert n == 16  # two whole groups of 8 (random float rewards: none tie, none filtered)
        assert batch.columns["token_ids"].shape == (n * TOKENS,)
        assert batch.columns["routed_experts"].shape == (n * TOKENS, LAYERS, TOP_K)
        first = batch.columns["token_ids"][:TOKENS]
        assert np.array_equal(batch.columns["token_ids"][-TOKENS:], first)  # the worker's one sample, each time


def rss_shmem_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def test_a_resident_store_is_faulted_in_when_made_and_still_stores() -> None:
    before = rss_shmem_mb()
    store = ResidentStore(32 << 20)
    try:
        assert rss_shmem_mb() - before >= 31  # every page of the pool is resident before any rollout
        sample = Sample(np.arange(TOKENS, dtype=np.int32), np.ones(TOKENS, np.uint8), np.zeros(TOKENS, np.float32),
                        np.full((TOKENS, LAYERS, TOP_K), 7, np.uint8))
        span = store.put("r0", [sample])
        assert span is not None
        assert np.array_equal(np.frombuffer(store.buffer()[span.offset:span.offset + TOKENS * 4], np.int32),
                              sample.token_ids)
    finally:
        store.close()
