"""Weights over the wire in whole jobs against simulated servers with the gloo engine: the orchestrator forms the
group and runs every update, the reference trainer (learning the tiny policy) sends its weights over real gloo
broadcasts, the servers sample from exactly what it learned, and a server that comes back gets the current
weights (from disk when the trainer wrote them there, else by a broadcast) before it serves rollouts again. The
rules around it, without rollouts, are in test_broadcast_rules.py.

Real env worker processes, real sim servers over HTTP, a real ZMQ trainer link, real gloo groups (torch); the
trainer runs in this process (its blocking gloo calls in threads, as ``orchestrator receive --broadcast`` runs
them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.config import JobConfig
from orchestrator.contracts.wire import Batch
from orchestrator.inference.pool import Server
from orchestrator.policy import Policy
from orchestrator.sim.server import SimServer
from orchestrator.sim.transfer import BROADCAST, PARTLY
from orchestrator.testing.jobs import ARITHMETIC, Section, job_config
from orchestrator.testing.procs import wait_until
from orchestrator.testing.sim import sim_cluster
from orchestrator.trainer.gloo_broadcast import GlooBroadcaster
from orchestrator.trainer.learner import PolicyLearner
from orchestrator.trainer.reference import ReferenceTrainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("verifiers_home")]
JOB_GUARD_S = 240.0
TIMEOUT_S = 20.0  # the gloo bound of these jobs (inference.broadcast.timeout_s), unless a test shortens it
ARITH: Section = {**ARITHMETIC, "name": "arith", "sampling": {"max_tokens": 6}}


def job(tmp_path: Path, urls: list[str], *, steps: int = 4, broadcast: Section | None = None,
        inference: Section | None = None) -> JobConfig:
    return job_config(
        tmp_path, overrides=["pipeline.gates=[]"],
        run={"name": "t", "max_steps": steps},
        inference={"servers": urls, "request_timeout_s": 120.0, "probe_interval_s": 0.2,
                   "weight_transfer": "broadcast",
                   "broadcast": {"timeout_s": TIMEOUT_S, "retry_s": 0.5, **(broadcast or {})}, **(inference or {})},
        scheduler={"batch_size": 8, "max_inflight": 8, "max_async_level": 0, "max_off_policy_steps": 1},
        env=[ARITH])


def metrics(tmp_path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_bytes().splitlines()]


def syncs(tmp_path: Path) -> list[dict[str, Any]]:
    return [s for m in metrics(tmp_path) for s in m.get("weight_syncs", [])]


class Trainer(ReferenceTrainer):
    """The reference trainer learning the tiny policy, sending it over gloo; ``task`` runs it (a test may cancel
    it: the trainer's process dies)."""

    task: asyncio.Task[None] | None = None


def trainer(orch: Orchestrator, cfg: JobConfig, *, save_every: int = 1, broadcaster: GlooBroadcaster | None = None,
            learner: PolicyLearner | None = None) -> Trainer:
    learner = learner or PolicyLearner()
    return Trainer(orch.sender.address, max_steps=cfg.run.max_steps, checkpoint_dir=Path(cfg.run.output_dir) / "ckpt",
                   learner=learner, save_every=save_every, broadcaster=broadcaster or GlooBroadcaster(learner.weights))


async def run(cfg: JobConfig, make: Callable[[Orchestrator], ReferenceTrainer],
              during: Callable[[Orchestrator, Trainer], Coroutine[Any, Any, None]] | None = None
              ) -> tuple[Orchestrator, ReferenceTrainer]:
    async with Orchestrator.open(cfg) as orch:
        t = make(orch)
        async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
            task = tg.create_task(t.run())
            if isinstance(t, Trainer):
                t.task = task
            side = tg.create_task(during(orch, t)) if during is not None and isinstance(t, Trainer) else None
            await orch.run()
            if side is not None and not side.done():
                side.cancel()
    return orch, t


async def test_a_trainer_whose_last_weights_the_run_never_asks_for_stops_when_the_run_ends(tmp_path: Path) -> None:
    """The trainer announces its last weights after the run has ended (its last step's training outlasts it), so
    nothing asks for them: it stops serving when the orchestrator says the run has ended, not after
    ``transfer_wait_s`` (600 s, longer than this test's guard: seen on the real stack)."""
    ended = asyncio.Event()

    class Late(Trainer):
        async def train(self, batch: Batch) -> None:
            if batch.step == cfg.run.max_steps - 1:
                await ended.wait()

    async with sim_cluster(1, weight_transfer="gloo") as cluster:
        cfg = job(tmp_path, cluster.urls, steps=2)
        learner = PolicyLearner()
        async with Orchestrator.open(cfg) as orch:
            t = Late(orch.sender.address, max_steps=cfg.run.max_steps, learner=learner,
                     checkpoint_dir=Path(cfg.run.output_dir) / "ckpt", broadcaster=GlooBroadcaster(learner.weights))
            assert t.transfer_wait_s > JOB_GUARD_S
            async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                tg.create_task(t.run())
                await orch.run()
                ended.set()
        assert [r.step for r in t.received] == [0, 1]
        assert t.receiver is not None
        assert t.receiver.run_ended


def same_weights(server: SimServer, learner: PolicyLearner) -> bool:
    theirs, mine = server.policy.model.weights, learner.weights()
    return set(theirs) == set(mine) and all(np.array_equal(theirs[k], mine[k]) for k in mine)


async def test_every_update_goes_over_the_wire_and_the_servers_sample_from_what_the_trainer_learned(
        tmp_path: Path) -> None:
    async with sim_cluster(2, weight_transfer="gloo") as cluster:
        cfg = job(tmp_path, cluster.urls)
        _, t = await run(cfg, lambda orch: trainer(orch, cfg, save_every=3))
        learner = t.learner
        assert isinstance(learner, PolicyLearner)
        assert [r.step for r in t.received] == [0, 1, 2, 3]
        for i in range(2):
            server = cluster[i]
            assert server.weight_version in ("3", "4")  # the last step the run synced, as the version
            assert server.weights_path == BROADCAST
            log = server.log_json()
            assert not [c for c in log["admin"] if c["path"] == "/collective_rpc"]  # nothing loaded from disk
            assert server.transfer.updates >= 3  # the announcement after the last step may have been synced too
            assert not server.gate.paused  # none left paused or mid-update (a sync under way finishes first)
            assert not server.transfer.active
        # the servers hold what the learner holds (weights 4, announced after the last step and synced as the run
        # ended), or checkpoint 3, which it saved (save_every = 3)
        saved = Policy.load(Path(cfg.run.output_dir) / "ckpt" / "step_3")
        assert saved is not None
        for i in range(2):
            held = cluster[i].policy.model.weights
            if cluster[i].weight_version == "4":
                assert same_weights(cluster[i], learner)
            else:
                assert all(np.array_equal(held[k], saved.weights[k]) for k in saved.weights)
    assert sorted(p.name for p in (Path(cfg.run.output_dir) / "ckpt").glob("step_*")) == ["step_3"]
    rows = syncs(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]  # a sync after the last step is in no step's metrics
    assert all(r["mode"] == "broadcast" and r["servers"] == 2 and r["failed"] == 0 for r in rows)
    for r in rows:
        for phase in ("pause_s", "start_s", "transfer_s", "finish_s", "resume_s", "ask_s"):
            assert r[phase] >= 0, (phase, r)
        assert r["total_s"] >= r["transfer_s"]
    assert rows[0].get("formed") is True  # one group for the whole run
    assert all("formed" not in r for r in rows[1:])
    assert [m["policy"] for m in metrics(tmp_path)] == [0, 1, 2, 3]


@pytest.mark.parametrize("save_every", [1, 1000], ids=["on-disk", "not-on-disk"])
async def test_a_server_that_comes_back_gets_the_current_weights_and_the_job_goes_on(
        tmp_path: Path, save_every: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Killed after step 1 and started again (with the weights it started with): out of rotation, it is healthy;
    the current weights come from disk when the trainer wrote them there (every step), else by a broadcast whose
    re-formed group takes it in. Only then does it rejoin, and it serves rollouts again; the next broadcasts
    reach it (its new engine joins a group formed again)."""
    steps = 6
    facts: dict[str, int] = {}

    async def kill_and_restart(orch: Orchestrator, _t: Trainer) -> None:
        # after the weights of step 1 are on both: killed during their sync, it could rejoin on step 0's
        await wait_until(lambda: orch.summary.steps >= 1 and all(s.version >= 1 for s in orch.pool.servers),
                         JOB_GUARD_S, "the weights of step 1 on every server")
        server, pool = orch.pool.servers[1], orch.pool
        rotate = pool._set_rotation

        def rejoins(s: Server, on: bool, why: str) -> None:  # what it serves at the moment it rejoins
            if s is server and on and not s.in_rotation and "rejoined_at" not in facts:
                facts.update(rejoined_at=orch.summary.steps, target=pool.target.step,
                             version=int(cluster[1].weight_version))
            rotate(s, on, why)

        monkeypatch.setattr(pool, "_set_rotation", rejoins)
        await cluster.kill(1)
        await wait_until(lambda: not server.in_rotation, JOB_GUARD_S, "the killed server to leave rotation")
        await cluster.restart(1)
        facts["restarted_at"] = orch.summary.steps
        await wait_until(lambda: "rejoined_at" in facts, JOB_GUARD_S, "the restarted server to rejoin")

    async with sim_cluster(2, weight_transfer="gloo") as cluster:
        cfg = job(tmp_path, cluster.urls, steps=steps)
        orch, t = await run(cfg, lambda orch: trainer(orch, cfg, save_every=save_every), during=kill_and_restart)
        assert "rejoined_at" in facts, facts
        assert facts["version"] == facts["target"] >= 1, facts  # it rejoined on the current weights
        assert orch.pool.metrics["rejoins"] >= 1
        back = cluster[1]
        log = back.log_json()
        loaded = [c for c in log["admin"] if c["path"] == "/collective_rpc"]
        if save_every == 1:
            assert loaded  # from disk: the newest checkpoint
        else:
            assert not loaded  # nothing on disk to load: a broadcast brought them
            assert back.transfer.updates >= 1
        served = [g for g in log["generate"] if g["status"] == 200 and g["cache_salt"] != "probe"]
        assert served  # it served rollouts after it rejoined
        assert all(g["weights_path"] != PARTLY for g in log["generate"])
        assert back.weight_version == cluster[0].weight_version  # the syncs since reached both
        assert "weight transfer not initialized" not in caplog.text  # no broadcast went to its new engine ungrouped
    assert [r.step for r in t.received] == list(range(steps))  # nothing lost, nothing twice
