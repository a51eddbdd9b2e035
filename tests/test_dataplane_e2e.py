"""End to end in direct mode: real env worker processes writing their own column pools, real sim servers, the
reference trainer gathering each step from the pools a step manifest names; acknowledgements free the spans.

What only direct mode has (pools, spans, releases) is checked here; the end-to-end, resume, fault, shutdown and
supervision suites run on either path (``pytest --data-plane direct``; scripts/test.sh runs both)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.config import JobConfig
from orchestrator.contracts.wire import Batch
from orchestrator.dataplane.direct import DirectPlane
from orchestrator.sim.server import Faults
from orchestrator.testing.jobs import ARITHMETIC, job_config
from orchestrator.testing.procs import wait_until
from orchestrator.testing.sim import sim_servers
from orchestrator.trainer.reference import ReferenceTrainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("verifiers_home")]
JOB_GUARD_S = 240.0  # a hang guard: a job takes seconds on a quiet host, many times that with every core busy


def direct_job(tmp_path: Path, urls: list[str], steps: int = 3, overrides: tuple[str, ...] = ()) -> JobConfig:
    return job_config(
        tmp_path, overrides=["pipeline.gates=[]", *overrides], run={"name": "t", "max_steps": steps},
        inference={"servers": urls, "backend": "prime-rl", "request_timeout_s": 120.0},
        scheduler={"batch_size": 8, "max_inflight": 8, "max_async_level": 1, "max_off_policy_steps": 2,
                   "max_buffered_rollouts": 16},
        transport={"data_plane": "direct", "worker_pool_mb": 4},
        env=[{**ARITHMETIC, "name": "arith", "workers": 2, "sampling": {"max_tokens": 6}}])


def unacked_steps(orch: Orchestrator) -> dict[int, object]:
    """The steps ``orch`` sent in direct mode that the trainer has not acknowledged."""
    assert isinstance(orch.plane, DirectPlane)
    return dict(orch.plane.unacked.steps)


async def test_steps_reach_the_trainer_from_the_workers_pools_and_acknowledgements_free_them(tmp_path: Path) -> None:
    batches: list[Batch] = []
    async with sim_servers(1, layers=3, top_k=2, profile="prime-rl") as servers:
        cfg = direct_job(tmp_path, [s.url for s in servers])
        async with Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=cfg.run.max_steps,
                                       checkpoint_dir=Path(cfg.run.output_dir) / "ckpt", on_batch=batches.append)
            async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                tg.create_task(trainer.run())
                await orch.run()
            hub, sender = orch.hub, orch.sender
            assert sorted(hub.pools.pools()) == ["local-0", "local-1"]  # each worker announced its own pool
            assert sender.acked == cfg.run.max_steps - 1
            assert unacked_steps(orch) == {}  # every step's rollouts released on acknowledgement
    assert [r.step for r in trainer.received] == [0, 1, 2]
    batch_size = cfg.scheduler.batch_size
    assert batch_size is not None
    for r, batch in zip(trainer.received, batches, strict=True):
        assert r.samples >= batch_size - 4  # whole groups; zero-advantage rollouts filtered
        assert r.routed_shape is not None
        assert r.routed_shape[1:] == (3, 2)
        assert batch.columns["token_ids"].dtype.str == "<i4"
    trained = sum(r.samples for r in trainer.received)
    assert hub.metrics["released"] >= trained  # trained ones on acknowledgement, plus every one dropped
    assert hub.metrics["rejected:corrupt_record"] == 0
    # the trainer link carried manifests only: far less than the columns (tokens x (4 + 1 + 4 + 3 * 2) bytes)
    tokens = sum(r.tokens for r in trainer.received)
    assert sender.bytes_sent < tokens * 15
    rows = [orjson.loads(x) for x in (tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines()]
    assert {row["step"] for row in rows} == {0, 1, 2}


async def test_a_worker_killed_mid_run_loses_its_buffered_rollouts_and_no_step_is_lost(tmp_path: Path) -> None:
    async with sim_servers(1, faults=Faults(latency_ms=20.0), profile="prime-rl") as servers:
        cfg = direct_job(tmp_path, [servers[0].url], steps=5)
        killed: list[int] = []
        killed_pools: list[str] = []
        async with Orchestrator.open(cfg) as orch:

            class KillsAWorker(ReferenceTrainer):
                """After step 0 (so both pools are mapped here, from their announcements), kill local-0 and
                train nothing more until the hub has seen its pool go: later steps come from the other pools."""

                async def train(self, batch: Batch) -> None:
                    await super().train(batch)
                    if not killed:
                        old = orch.hub.pools.pool("local-0")
                        assert old is not None
                        killed_pools.append(old.id)
                        pid = orch.hub.local_pids()["local-0"]
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                        await wait_until(lambda: orch.hub.metrics["pools_gone"] >= 1, JOB_GUARD_S,
                                         "the hub to report the pool gone", poll_s=0.05)

            trainer = KillsAWorker(orch.sender.address, max_steps=cfg.run.max_steps,
                                   checkpoint_dir=Path(cfg.run.output_dir) / "ckpt")
            async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                tg.create_task(trainer.run())
                await orch.run()
            hub = orch.hub
            assert unacked_steps(orch) == {}
    assert killed
    assert [r.step for r in trainer.received] == list(range(5))  # every step once, in order, complete
    assert hub.metrics["pools_gone"] >= 1
    assert killed_pools[0] not in {p.id for p in hub.pools.pools().values()}  # never named again


async def test_a_resumed_orchestrator_feeds_the_same_trainer_from_renewed_pools(tmp_path: Path) -> None:
    """The orchestrator stops after 2 steps and is resumed for 2 more; one trainer sees all four, once, in order.
    The second run's workers are new processes with new pools: the trainer maps those and keeps going."""
    pools: list[set[str]] = []
    async with sim_servers(1, profile="prime-rl") as servers:
        first = direct_job(tmp_path, [s.url for s in servers], steps=2)
        trainer: ReferenceTrainer | None = None
        async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
            training: asyncio.Task[None] | None = None
            for cfg, resume in ((first, False), (dataclasses.replace(first, run=dataclasses.replace(
                    first.run, max_steps=4)), True)):
                async with Orchestrator.open(cfg, resume=resume) as orch:
                    if trainer is None:
                        trainer = ReferenceTrainer(orch.sender.address, max_steps=4,
                                                   checkpoint_dir=Path(cfg.run.output_dir) / "ckpt")
                        training = tg.create_task(trainer.run())
                    await orch.run()
                    pools.append({p.id for p in orch.hub.pools.pools().values()})
                    assert unacked_steps(orch) == {}
            assert training is not None
            await training
    assert trainer is not None
    assert [r.step for r in trainer.received] == [0, 1, 2, 3]
    assert pools[0].isdisjoint(pools[1])  # the steps after the resume came from other pools
