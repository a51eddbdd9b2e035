"""End to end: real env worker processes (verifiers inside), real sim servers over HTTP, real ZMQ."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.config import JobConfig
from orchestrator.contracts.checkpoints import write_marker
from orchestrator.contracts.wire import Batch
from orchestrator.delivery.filesystem import FileBatchReceiver
from orchestrator.errors import EnvironmentLoadError, TransportError
from orchestrator.sim.server import Faults
from orchestrator.state import load_state
from orchestrator.steps.dump import load_dump
from orchestrator.testing.jobs import ARITHMETIC, Section, job_config
from orchestrator.testing.procs import wait_until
from orchestrator.testing.sim import sim_servers
from orchestrator.trainer.reference import ReferenceTrainer, save_initial_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("verifiers_home")]
JOB_GUARD_S = 240.0  # a hang guard: a job takes seconds on a quiet host, many times that with every core busy


ARITH: Section = {**ARITHMETIC, "name": "arith", "sampling": {"max_tokens": 6}}


def job(tmp_path: Path, urls: list[str], *, envs: Sequence[Section] = (ARITH,), steps: int = 3,
        backend: str = "vllm", weights_path: str | None = None, data_plane: str = "through",
        transport: Section | None = None, pipeline: Section | None = None) -> JobConfig:
    """``transport``, ``pipeline``: more keys of those sections."""
    return job_config(
        tmp_path, overrides=["pipeline.gates=[]"],  # every finished group trains: not a test of gates
        run={"name": "t", "max_steps": steps},
        inference={"servers": urls, "backend": backend, **({"weights_path": weights_path} if weights_path else {}),
                   # slow replies on a busy host must not fail rollouts: only a hang would time out
                   "request_timeout_s": 120.0, "failures_to_evict": 3, "probe_interval_s": 0.2},
        scheduler={"batch_size": 8, "max_inflight": 8, "max_async_level": 1, "max_off_policy_steps": 2,
                   "max_buffered_rollouts": 16},
        transport={"data_plane": data_plane, **(transport or {})}, pipeline=pipeline or {}, env=envs)


async def run_job(cfg: JobConfig) -> tuple[Orchestrator, ReferenceTrainer]:
    async with Orchestrator.open(cfg) as orch:
        trainer = ReferenceTrainer(orch.sender.address, max_steps=cfg.run.max_steps,
                                   checkpoint_dir=Path(cfg.run.output_dir) / "ckpt")
        async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
            tg.create_task(trainer.run())
            await orch.run()
    return orch, trainer


async def test_steps_reach_the_trainer_in_order_with_weight_sync(tmp_path: Path, data_plane: str) -> None:
    async with sim_servers(2, layers=3, top_k=2, profile="prime-rl") as servers:  # router replay: prime-rl's server
        cfg = job(tmp_path, [s.url for s in servers], backend="prime-rl", data_plane=data_plane)
        orch, trainer = await run_job(cfg)
    assert [r.step for r in trainer.received] == [0, 1, 2]
    batch_size = cfg.scheduler.batch_size
    assert batch_size is not None
    for r in trainer.received:
        assert r.samples >= batch_size - 4  # whole groups; zero-advantage rollouts filtered
        assert r.routed_shape is not None
        assert r.routed_shape[1:] == (3, 2)
        assert r.routed_shape[0] == r.tokens
    # the trainer announced checkpoints, so servers moved to newer weights
    assert max(s.loads for s in servers) >= 1
    out = tmp_path / "out"
    metrics = [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    # direct: the orchestrator released spans in the workers' pools (step 0's, acknowledged before step 2 went)
    assert (metrics[2]["hub"].get("released", 0) > 0) == (data_plane == "direct")
    for key in ("phase_s", "lag", "rss_mb", "rollouts", "filtered", "failed", "reward_mean", "off_policy",
                "tokens", "rollouts_per_s"):
        assert key in metrics[0], key
    rows = [orjson.loads(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]
    assert len(rows) == sum(m["rollouts"] for m in metrics)
    # per-worker throughput since the previous step: every finished rollout is counted once, by one worker
    per_worker = [w for m in metrics for w in m["scheduler"]["workers"].values()]
    assert 0 < sum(w["rollouts"] for w in per_worker) <= len(rows) + cfg.scheduler.max_inflight
    assert all(w["rollouts_per_s"] >= 0 for w in per_worker)
    for row in rows:  # the async level: no rollout older than allowed reached a batch
        assert row["policy"] >= row["step"] - cfg.scheduler.max_async_level
    assert load_state(out, "t").next_step == 3
    assert orch.summary.steps == 3
    assert not (out / "dumps").exists()  # none asked for


async def test_a_dumped_step_holds_the_batch_the_trainer_got(tmp_path: Path, data_plane: str) -> None:
    """Direct mode too: the dump reads the step's columns back from the env workers' pools, before the step is
    sent (dataplane/readback.py), and holds what the trainer got."""
    async with sim_servers(1, layers=3, top_k=2, profile="prime-rl") as servers:
        cfg = job(tmp_path, [s.url for s in servers], pipeline={"dump_steps": [1]}, steps=2,
                  backend="prime-rl", data_plane=data_plane)
        _orch, trainer = await run_job(cfg)
    out = tmp_path / "out"
    metrics = [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()]
    rows = [orjson.loads(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]
    # pipeline.dump_steps = [1]: step 1 only, with the batch the trainer got and the step's rollout rows
    assert [p.name for p in (out / "dumps").iterdir()] == ["step_000001"]
    dump = load_dump(out / "dumps" / "step_000001")
    assert (dump.batch.step, dump.batch.num_samples) == (1, trainer.received[1].samples)
    assert dump.batch.num_tokens == trainer.received[1].tokens
    assert dump.batch.columns["routed_experts"].shape[1:] == (3, 2)
    assert dump.rows == [r for r in rows if r["step"] == 1]
    assert all(len(r.frames) == 5 and r.columns[3] == "versions"  # replayable: every column
               for g in dump.groups for r in g.records if r.ok)
    assert "versions" in dump.batch.columns
    assert "dump" in metrics[1]["phase_s"]
    assert "dump" not in metrics[0]["phase_s"]


async def test_failing_server_and_partial_groups(tmp_path: Path, data_plane: str) -> None:
    async with sim_servers(2) as servers:
        servers[0].faults = Faults(error_rate=0.3)
        cfg = job(tmp_path, [s.url for s in servers], data_plane=data_plane, envs=[
            {"name": "guess", "taskset": "orchestrator-guess-number", "args": {"max_turns": 3}, "group_size": 4,
             "workers": 1, "sampling": {"max_tokens": 5}}])
        _orch, trainer = await run_job(cfg)
    assert [r.step for r in trainer.received] == [0, 1, 2]
    rows = [orjson.loads(x) for x in (tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines()]
    failed = [r for r in rows if not r["ok"]]
    assert servers[0].counters.errors > 0
    # every injected 500 surfaces as a failed rollout with its reason (verifiers may retry a call)
    assert failed
    assert all(r["error"] for r in failed)


async def test_environment_that_fails_to_load_is_named(tmp_path: Path, data_plane: str) -> None:
    async with sim_servers(1) as servers:
        cfg = job(tmp_path, [servers[0].url], data_plane=data_plane,
                  envs=[{"name": "broken", "taskset": "no-such-taskset-xyz", "group_size": 4, "workers": 1}])
        with pytest.raises(ExceptionGroup) as info:
            await run_job(cfg)
    matched = info.value.subgroup(EnvironmentLoadError)
    assert matched is not None
    leaf: BaseException = matched
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert "environment 'broken'" in str(leaf)
    assert "no-such-taskset-xyz" in str(leaf)


async def test_worker_killed_mid_run_is_restarted_and_no_step_is_lost(tmp_path: Path, data_plane: str) -> None:
    async with sim_servers(1, faults=Faults(latency_ms=20.0)) as servers:
        cfg = job(tmp_path, [servers[0].url], data_plane=data_plane, envs=[{**ARITH, "workers": 2,
                                                                             "sampling": {"max_tokens": 4}}], steps=8)
        killed: list[int] = []
        async with Orchestrator.open(cfg) as orch:

            class WaitsForTheRestart(ReferenceTrainer):
                """Trains no step after the kill until the hub has restarted the worker: a job of fast steps
                could otherwise end first, whatever the machine's speed."""

                async def train(self, batch: Batch) -> None:
                    await super().train(batch)
                    if killed:
                        await wait_until(lambda: orch.hub.metrics["restarts"] >= 1, 120, "the worker restarted",
                                         poll_s=0.05)

            trainer = WaitsForTheRestart(orch.sender.address, max_steps=cfg.run.max_steps,
                                         checkpoint_dir=tmp_path / "ckpt")

            def kill_after_first_step(metrics: dict[str, object]) -> None:
                if not killed:
                    pid = orch.hub.local_pids()["local-0"]
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

            orch.on_step = kill_after_first_step
            async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                tg.create_task(trainer.run())
                await orch.run()
            restarts, pids = orch.hub.metrics["restarts"], orch.hub.local_pids()
    assert killed
    assert [r.step for r in trainer.received] == list(range(8))
    assert restarts == 1  # restarted once, under its name
    assert killed[0] not in pids.values()
    assert len(pids) == 2
    rows = [orjson.loads(x) for x in (tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines()]
    died = [r for r in rows if r["failure"] == "worker_died"]
    metrics = [orjson.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_bytes().splitlines()]
    reported = sum(m["scheduler"].get("failed:worker_died", 0) for m in metrics)
    assert reported >= len(died)


async def test_filesystem_transport_with_marker_checkpoints(tmp_path: Path) -> None:
    batches, markers = tmp_path / "batches", tmp_path / "markers"
    async with sim_servers(1) as servers:
        # kind = "filesystem" keeps the through path: it has no channel back for releases (docs/data-plane.md)
        cfg = job(tmp_path, [servers[0].url], weights_path=f"{tmp_path}/ckpt/step_{{step}}", transport={
            "kind": "filesystem", "directory": batches, "checkpoint_source": "marker", "marker_dir": markers})
        receiver = FileBatchReceiver(batches)
        got: list[int] = []

        async def trainer() -> None:
            while len(got) < cfg.run.max_steps:
                batch = await receiver.arecv()
                got.append(batch.step)
                await asyncio.to_thread(save_initial_checkpoint, tmp_path / "ckpt", batch.step + 1)  # the weights
                await asyncio.to_thread(write_marker, markers, batch.step + 1)  # no path: weights_path names it

        async with Orchestrator.open(cfg) as orch, asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
            tg.create_task(trainer())
            await orch.run()
        assert got == [0, 1, 2]
        assert servers[0].loads >= 1  # marker announcements reached the weight sync
        assert load_state(tmp_path / "out", "t").acked_step == 2
        # a new run into a directory still holding batch files is refused, naming them
        (batches / "step_00000007.batch").write_bytes(b"left over")
        with pytest.raises(TransportError, match=r"steps \[7\] from an earlier run"):
            async with Orchestrator.open(cfg):
                pass
