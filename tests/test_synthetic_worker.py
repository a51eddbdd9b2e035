"""The synthetic env worker (orchestrator.testing.synthetic_worker) as the benchmark uses it: a process admitted
as a remote worker, its fixed-shape rollouts reaching the trainer whole, on both data planes."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.app import Orchestrator
from orchestrator.config import load_config
from orchestrator.procs import terminate
from orchestrator.testing.sim import sim_servers
from orchestrator.transport.trainer import ReferenceTrainer
from orchestrator.transport.wire import Batch

pytestmark = pytest.mark.slow
JOB_GUARD_S = 240.0  # a hang guard: the job takes seconds on a quiet host
TOKENS, LAYERS, TOP_K = 96, 4, 2


@pytest.mark.parametrize("data_plane", ["through", "direct"])
async def test_synthetic_rollouts_reach_the_trainer_whole(tmp_path: Path, data_plane: str) -> None:
    async with sim_servers(1) as servers:
        job = tmp_path / "job.toml"
        job.write_text(f"""
[run]
name = "syn"
output_dir = "{tmp_path / 'out'}"
max_steps = 2
[inference]
servers = ["{servers[0].url}"]
[scheduler]
batch_size = 16
max_inflight = 16
max_async_level = 2
remote_workers = 1
worker_address = "ipc://{tmp_path}/workers.sock"
[transport]
data_plane = "{data_plane}"
worker_pool_mb = 8
[pipeline]
gates = []
[[env]]
name = "syn"
taskset = "orchestrator-arithmetic"
group_size = 8
workers = 0
""")
        cfg = load_config(job)
        batches: list[Batch] = []
        async with Orchestrator.open(cfg) as orch:
            worker = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "orchestrator.testing.synthetic_worker", "--connect",
                f"ipc://{tmp_path}/workers.sock", "--id", "syn-0", "--tokens", str(TOKENS), "--layers", str(LAYERS),
                "--top-k", str(TOP_K), "--rate", "200")
            try:
                trainer = ReferenceTrainer(orch.sender.address, max_steps=2, on_batch=batches.append, announce=False)
                async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                    tg.create_task(trainer.run())
                    await orch.run()
            finally:
                await terminate(worker, 10)
    assert [r.step for r in trainer.received] == [0, 1]
    for batch in batches:
        n = batch.num_samples
        assert n >= 8  # whole groups of 8; a group whose rewards tie would be filtered (drawn at random: rare)
        assert batch.columns["token_ids"].shape == (n * TOKENS,)
        assert batch.columns["routed_experts"].shape == (n * TOKENS, LAYERS, TOP_K)
        first = batch.columns["token_ids"][:TOKENS]
        assert np.array_equal(batch.columns["token_ids"][-TOKENS:], first)  # the worker's one sample, each time
