"""The rules of weights over the wire, fast: the weight sync loop against simulated servers with the gloo engine,
a real trainer link (ZMQ) and a real trainer half (a receiver with a ``GlooBroadcaster``), without env workers or
rollouts. Each test announces checkpoints as a trainer does and watches what reaches the servers.

- a group forms once and each update goes through pause, start, transfer, finish, resume, the step as the version;
- a rendezvous that fails is retried; the servers keep their weights and their place in rotation;
- a trainer holding newer weights answers stale: no server is paused for nothing;
- a trainer that does not broadcast gets its checkpoints loaded from disk (once warned);
- a trainer that dies mid-broadcast ends the loop (TransferError) and no server stays paused;
- a server gone silent mid-broadcast fails the update within the timeout; the servers it failed wait, paused,
  until a broadcast brings them the weights;
- a server that joins late waits out of rotation and gets the current weights by a broadcast;
- a member that restarts between two broadcasts is taken into a group formed again;
- a trainer waiting to be asked for its last weights stops when the run ends;
- preflight names a server started without the engine, or with another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.assets import tokenizer_dir
from orchestrator.config import JobConfig, load_config
from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.contracts.transfer import JoinGroup, Params, SendWeights
from orchestrator.delivery.zmq_link import BatchSender
from orchestrator.engines import job_scheduler
from orchestrator.errors import ConfigError, Failure, TransferError
from orchestrator.inference.pool import InferencePool
from orchestrator.inference.preflight import PreflightError, preflight
from orchestrator.policy import Policy
from orchestrator.rollouts.scheduler import Scheduler
from orchestrator.sim.transfer import BROADCAST
from orchestrator.state import OrchestratorState
from orchestrator.testing.jobs import ARITHMETIC, job_config, toml_text
from orchestrator.testing.procs import wait_until
from orchestrator.testing.sim import SimCluster, sim_cluster
from orchestrator.testing.workers import FakeWorkerHub
from orchestrator.trainer.gloo_broadcast import GlooBroadcaster
from orchestrator.trainer.receiver import BatchReceiver
from orchestrator.weights.sync_loop import WeightSyncLoop, back_to_disk

WAIT_S = 60.0  # hang guards for waits on events (a busy host is slow; nothing here takes that long when quiet)
TIMEOUT_S = 2.0  # the gloo bound (inference.broadcast.timeout_s): the failure tests wait for it once


def config(tmp_path: Path, urls: list[str], **broadcast: object) -> JobConfig:
    return job_config(tmp_path, inference={
        "servers": urls, "probe_interval_s": 0.1, "weight_transfer": "broadcast",
        "broadcast": {"timeout_s": TIMEOUT_S, "retry_s": 0.2, "trainer_timeout_s": 30.0, **broadcast}},
        scheduler={"batch_size": 8}, env=[{**ARITHMETIC, "name": "a"}])


class Weights:
    """The trainer's weights: the tiny policy, moved a little at each step (so each step's are new)."""

    def __init__(self) -> None:
        self.policy = Policy.initial()

    def step(self) -> None:
        rng = np.random.default_rng(self.policy.step or 0)
        self.policy = self.policy.moved({k: rng.normal(0, 0.01, v.shape).astype(np.float32)
                                         for k, v in self.policy.weights.items()}, step=(self.policy.step or 0) + 1)

    def __call__(self) -> dict[str, np.ndarray]:
        return self.policy.weights


class Rig:
    """A weight sync loop over sim servers, and a trainer on its link serving transfer requests."""

    def __init__(self, cfg: JobConfig, pool: InferencePool, sender: BatchSender, receiver: BatchReceiver,
                 weights: Weights) -> None:
        self.cfg, self.pool, self.sender, self.receiver, self.weights = cfg, pool, sender, receiver, weights
        self.sched: Scheduler = job_scheduler(cfg, pool, FakeWorkerHub({"a": 50}), 0)
        self.loop = WeightSyncLoop(pool, self.sched, OrchestratorState("t"), cfg.inference, channel=sender)

    async def announce(self, step: int, path: str | None = None) -> None:
        """The trainer trained on: new weights ``step``, announced (with ``path`` when it wrote them to disk)."""
        self.weights.step()
        await self.receiver.announce(step, path)

    async def policy(self, step: int) -> None:
        await wait_until(lambda: self.sched.policy == step, WAIT_S, f"policy {step}", poll_s=0.01)


@contextlib.asynccontextmanager
async def rig(tmp_path: Path, cluster: SimCluster, broadcaster: GlooBroadcaster | None = None,
              weights: Weights | None = None, **broadcast: object) -> AsyncIterator[Rig]:
    """The loop, the pool's prober and a trainer serving requests (inside ``recv``, which no batch ever ends)."""
    cfg = config(tmp_path, cluster.urls, **broadcast)
    weights = weights or Weights()
    async with InferencePool.open(cfg.inference, cfg.model.name) as pool, \
            BatchSender.open(f"ipc://{tmp_path}/t.sock") as sender:
        receiver = BatchReceiver(sender.address, broadcaster=broadcaster if broadcaster is not None
                                 else GlooBroadcaster(weights))
        r = Rig(cfg, pool, sender, receiver, weights)
        tasks = [asyncio.ensure_future(receiver.recv()), asyncio.ensure_future(pool.run())]
        try:
            await wait_until(lambda: sender.holder is not None, WAIT_S, "the trainer to connect", poll_s=0.01)
            yield r
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not receiver.batches.closed:  # a test may have closed it (its trainer died)
                receiver.close()


def started(r: Rig) -> asyncio.Future[None]:
    return asyncio.ensure_future(r.loop.run(r.sender.announcements()))


async def stop(run: asyncio.Future[None]) -> None:
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run


def admin(cluster: SimCluster, i: int, path: str) -> list[dict[str, Any]]:
    return [c for c in cluster[i].log_json()["admin"] if c["path"] == path]


async def test_a_group_forms_once_and_every_update_puts_the_trainers_weights_on_every_server(tmp_path: Path) -> None:
    async with sim_cluster(2, weight_transfer="gloo") as cluster, rig(tmp_path, cluster) as r:
        run = started(r)
        for step in (1, 2, 3):
            await r.announce(step)
            await r.policy(step)
            for i in range(2):
                assert cluster[i].weight_version == str(step)
                assert all(np.array_equal(cluster[i].policy.model.weights[k], v) for k, v in r.weights().items())
        await stop(run)
        for i in range(2):
            assert len(admin(cluster, i, "/init_weight_transfer_engine")) == 1  # one group
            calls = [c["path"] for c in cluster[i].log_json()["admin"] if c["path"] != "/get_world_size"]
            assert calls[1:] == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                                 "/resume"] * 3
            assert [c["query"] for c in admin(cluster, i, "/pause")] == [{"mode": "keep", "clear_cache": "false"}] * 3
            assert [c["body"] for c in admin(cluster, i, "/finish_weight_update")] == [
                {"weight_version": str(s)} for s in (1, 2, 3)]
            assert cluster[i].weights_path == BROADCAST
            assert not cluster[i].gate.paused
        inits = [admin(cluster, i, "/init_weight_transfer_engine")[0]["body"]["init_info"] for i in range(2)]
        assert [i["rank_offset"] for i in inits] == [1, 2]  # each server's world size is 1: the trainer is rank 0
        assert {i["world_size"] for i in inits} == {3}
        reports = r.loop.take_reports()
        assert [x["step"] for x in reports] == [1, 2, 3]
        assert [x.get("formed", False) for x in reports] == [True, False, False]


async def test_a_rendezvous_that_fails_is_retried_and_the_servers_keep_their_weights_and_rotation(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The trainer serves the first rendezvous and never joins it: every server's init fails after the timeout;
    ``retry_s`` later a new group forms and the weights go through. Nothing was paused: no server left rotation."""

    class FirstJoinHangs(GlooBroadcaster):
        joins = 0

        def join(self, request: JoinGroup) -> Params:
            self.joins += 1
            if self.joins == 1:
                time.sleep(request.timeout_s + 0.5)
                raise RuntimeError("never joined")
            return super().join(request)

    weights = Weights()
    async with sim_cluster(2, weight_transfer="gloo") as cluster, \
            rig(tmp_path, cluster, FirstJoinHangs(weights), weights) as r:
        run = started(r)
        with caplog.at_level(logging.ERROR, logger="orchestrator"):
            await r.announce(1)
            await r.policy(1)
        await stop(run)
        assert r.pool.metrics["evictions"] == 0
        assert all(cluster[i].weight_version == "1" for i in range(2))
        assert all(len(admin(cluster, i, "/init_weight_transfer_engine")) == 2 for i in range(2))
        assert not any(admin(cluster, i, "/pause")[:-1] for i in range(2))  # paused once: for the update itself
    assert f"did not form within {TIMEOUT_S:g} s" in caplog.text


async def test_a_trainer_holding_newer_weights_answers_stale_and_no_server_is_paused(tmp_path: Path) -> None:
    async with sim_cluster(1, weight_transfer="gloo") as cluster, rig(tmp_path, cluster) as r:
        r.weights.step()  # it trained past step 1 without announcing it
        await r.receiver.announce(2)
        r.loop.feed.offer(Checkpoint(1))  # an older announcement the loop still holds (e.g. read late)
        run = started(r)
        await r.policy(2)
        await stop(run)
        versions = [c["body"] for c in admin(cluster, 0, "/finish_weight_update")]
        assert versions == [{"weight_version": "2"}]
        assert len(admin(cluster, 0, "/pause")) == 1


async def test_a_trainer_that_does_not_broadcast_gets_its_checkpoints_loaded_from_disk(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with sim_cluster(1, weight_transfer="gloo") as cluster:
        cfg = config(tmp_path, cluster.urls)
        async with InferencePool.open(cfg.inference, cfg.model.name) as pool, \
                BatchSender.open(f"ipc://{tmp_path}/t.sock") as sender:
            receiver = BatchReceiver(sender.address)  # no broadcaster
            r = Rig(cfg, pool, sender, receiver, Weights())
            task = asyncio.ensure_future(receiver.recv())
            await wait_until(lambda: sender.holder is not None, WAIT_S, "the trainer", poll_s=0.01)
            run = started(r)
            with caplog.at_level(logging.WARNING, logger="orchestrator"):
                for step in (1, 2):
                    path = Policy.initial().save(tmp_path / f"step_{step}").parent
                    await receiver.announce(step, str(path))
                    await r.policy(step)
            await stop(run)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            receiver.close()
        assert [c["body"]["kwargs"]["weights_path"] for c in admin(cluster, 0, "/collective_rpc")] == [
            str(tmp_path / "step_1"), str(tmp_path / "step_2")]
        assert not admin(cluster, 0, "/init_weight_transfer_engine")
    assert caplog.text.count("does not send weights with gloo") == 1


async def test_a_trainer_that_dies_mid_broadcast_ends_the_loop_and_no_server_stays_paused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Its gloo connections close during the broadcast of step 2 and its link goes: every server's receive fails
    at once, the loop raises TransferError naming the trainer and the step, and resumes the servers it had
    paused (their weights are partly updated: the error says what to do)."""
    weights = Weights()

    class Dies(GlooBroadcaster):
        def __init__(self) -> None:
            super().__init__(weights)
            self.died = threading.Event()
            self.released = threading.Event()

        def send(self, request: SendWeights) -> None:
            if request.step == 2:
                self.close()  # the process is gone: its sockets close, and it answers nothing
                self.died.set()
                self.released.wait(WAIT_S)
                return
            super().send(request)

    dies = Dies()
    async with sim_cluster(2, weight_transfer="gloo") as cluster, rig(tmp_path, cluster, dies, weights) as r:
        run = started(r)
        await r.announce(1)
        await r.policy(1)
        try:
            await r.announce(2)
            await asyncio.to_thread(dies.died.wait, WAIT_S)
            r.receiver.close()  # and its link
            with caplog.at_level(logging.WARNING, logger="orchestrator"), pytest.RaisesGroup(pytest.RaisesExc(
                    TransferError, match=r"^the trainer \S+ died during the broadcast of step 2: every server's "
                                         r"transfer failed \(.*Connection (closed|reset) by peer")):
                await asyncio.wait_for(run, WAIT_S)
        finally:
            dies.released.set()
        for i in range(2):
            assert not cluster[i].gate.paused
            assert cluster[i].weight_version == "1"
            assert cluster[i].transfer.failed == 1
    assert "resumed 2 server(s) a failed weight transfer had left paused" in caplog.text


async def test_a_server_gone_silent_mid_broadcast_fails_it_within_the_timeout_and_a_retry_brings_them_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Server 1's engine joins the update and never receives (a worker hung in the collective): gloo fails the
    ranks waiting for it after ``timeout_s`` (observed: the trainer's broadcast waits for it, so the other server
    got nothing either), the update is named in the log, the servers it failed leave rotation, paused with their
    weights partly updated, and a broadcast of the weights they missed brings them back."""
    async with sim_cluster(2, weight_transfer="gloo") as cluster, rig(tmp_path, cluster) as r:
        run = started(r)
        await r.announce(1)
        await r.policy(1)
        cluster.set_faults(1, transfer_stall=True)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="orchestrator"):
            await r.announce(2)
            await wait_until(lambda: not r.pool.servers[1].in_rotation, WAIT_S, "the failure", poll_s=0.01)
            took = time.monotonic() - t0
            failed = [i for i, s in enumerate(r.pool.servers) if not s.in_rotation]
            assert all(cluster[i].gate.paused for i in failed)  # no request goes on under partly updated weights
            assert all(cluster[i].weight_version == "1" for i in failed)
            cluster.set_faults(1)
            await r.policy(2)
        await wait_until(lambda: all(s.in_rotation for s in r.pool.servers), WAIT_S, "both back", poll_s=0.01)
        await stop(run)
        assert [cluster[i].weight_version for i in range(2)] == ["2", "2"]
        assert all(not cluster[i].gate.paused for i in range(2))
        assert all(np.array_equal(cluster[1].policy.model.weights[k], v) for k, v in r.weights().items())
    assert TIMEOUT_S <= took < TIMEOUT_S + 10.0 + WAIT_S / 2  # bounded by gloo's timeout, not by a hang
    assert "stalled (sim fault transfer_stall)" in caplog.text  # the failure, named


async def test_a_server_that_joins_late_waits_out_of_rotation_and_a_broadcast_brings_it_the_current_weights(
        tmp_path: Path) -> None:
    async with sim_cluster(2, weight_transfer="gloo") as cluster:
        await cluster.kill(1)  # not up when the run starts
        async with rig(tmp_path, cluster) as r:
            run = started(r)
            await r.announce(1)  # its /get_world_size fails: it leaves rotation, the group forms without it
            await r.policy(1)
            assert cluster[0].weight_version == "1"
            assert not r.pool.servers[1].in_rotation
            late = await cluster.restart(1)  # it starts with the model's own weights
            server = r.pool.servers[1]
            await wait_until(lambda: server.in_rotation, WAIT_S, "server 1 to rejoin", poll_s=0.01)
            assert late.weight_version == "1"  # a catch-up broadcast: the weights of step 1 are on no disk
            assert all(np.array_equal(late.policy.model.weights[k], v) for k, v in r.weights().items())
            assert [c["path"] for c in late.log_json()["admin"]].count("/pause") == 1  # only the one it took
            assert len(admin(cluster, 0, "/pause")) == 1  # the server in rotation was not touched by the catch-up
            await r.announce(2)  # the next update: a group of both
            await r.policy(2)
            await stop(run)
            assert [cluster[i].weight_version for i in range(2)] == ["2", "2"]


async def test_a_member_that_restarts_is_taken_into_a_group_formed_again(tmp_path: Path) -> None:
    """Crashed and restarted between two broadcasts, a member loads the current weights from disk and rejoins;
    its new engine is in no group, so the next broadcast forms the group again (seen in a whole job: it went to
    the old group, and failed on every member)."""
    async with sim_cluster(2, weight_transfer="gloo") as cluster, rig(tmp_path, cluster) as r:
        run = started(r)
        await r.announce(1, str(r.weights.policy.save(tmp_path / "step_1").parent))  # also written to disk
        await r.policy(1)
        server = r.pool.servers[1]
        await cluster.kill(1)
        for _ in range(r.pool.cfg.failures_to_evict):  # its requests fail: it leaves rotation
            r.pool.report_failure(server, Failure.PROVIDER, "Connection error.")
        back = await cluster.restart(1)
        await wait_until(lambda: server.in_rotation, WAIT_S, "it to rejoin", poll_s=0.01)
        assert back.weight_version == "1"
        assert [c["path"] for c in back.log_json()["admin"]].count("/collective_rpc") == 1  # from disk
        await r.announce(2)
        await r.policy(2)
        await stop(run)
        assert [cluster[i].weight_version for i in range(2)] == ["2", "2"]
        assert len(admin(cluster, 1, "/init_weight_transfer_engine")) == 1  # its new engine joined a group
        assert [x.get("formed", False) for x in r.loop.take_reports()] == [True, True]
        assert r.pool.metrics["weight_sync_failed"] == 0


async def test_a_trainer_waiting_to_be_asked_for_its_last_weights_stops_when_the_run_ends(tmp_path: Path) -> None:
    """The run ends before it asks for the weights announced after its last step (seen on the real stack: the
    trainer then waited out its 600 s): the orchestrator says so, and ``serve_transfers`` returns at once."""
    async with sim_cluster(1, weight_transfer="gloo") as cluster:
        cfg = config(tmp_path, cluster.urls)
        weights = Weights()
        async with InferencePool.open(cfg.inference, cfg.model.name) as pool, \
                BatchSender.open(f"ipc://{tmp_path}/t.sock") as sender:
            receiver = BatchReceiver(sender.address, broadcaster=GlooBroadcaster(weights))
            r = Rig(cfg, pool, sender, receiver, weights)
            prober = asyncio.ensure_future(pool.run())
            try:
                run = started(r)
                serving = asyncio.ensure_future(receiver.serve_transfers(None, WAIT_S))
                await r.announce(1)
                await r.policy(1)  # the group formed, and step 1 went over it
                serving.cancel()
                await asyncio.gather(serving, return_exceptions=True)
                await stop(run)  # the run is over: nothing asks for the next weights
                await r.announce(2)
                assert not receiver.run_ended
                sender.run_finished()
                async with asyncio.timeout(WAIT_S):  # a hang guard: without the word it waits its whole timeout_s
                    taken = await receiver.serve_transfers(2, timeout_s=10 * WAIT_S)
                assert taken is False
                assert receiver.run_ended
            finally:
                prober.cancel()
                await asyncio.gather(prober, return_exceptions=True)
                receiver.close()


async def test_preflight_names_a_server_without_the_engine_or_with_another(tmp_path: Path) -> None:
    async with sim_cluster(1) as plain, sim_cluster(1, weight_transfer="gloo") as gloo:
        cfg = config(tmp_path, [*plain.urls, *gloo.urls])
        async with InferencePool.open(cfg.inference, cfg.model.name) as pool:
            servers = [s.api for s in pool.servers]
            with pytest.raises(PreflightError) as e:
                await preflight(servers, backend="vllm", model=cfg.model.name, tokenizer=tokenizer_dir(),
                                resume=False, transfer="gloo")
            assert len(e.value.problems) == 1
            assert e.value.problems[0].startswith(f"{plain.urls[0]}: started without a weight transfer engine: "
                                                  "restart vllm serve with --weight-transfer-config")
            with pytest.raises(PreflightError) as e:
                await preflight(servers[1:], backend="vllm", model=cfg.model.name, tokenizer=tokenizer_dir(),
                                resume=False, transfer="nccl")
            assert "its weight transfer engine is 'gloo', inference.broadcast.backend is 'nccl'" in str(e.value)
            await preflight(servers[1:], backend="vllm", model=cfg.model.name, tokenizer=tokenizer_dir(),
                            resume=False, transfer="gloo")


@pytest.mark.parametrize(("section", "key", "why"), [
    ({"inference": {"backend": "prime-rl"}}, "inference.weight_transfer", "needs vLLM's weight transfer routes"),
    ({"transport": {"kind": "filesystem", "directory": "batches"}}, "inference.weight_transfer",
     "over the ZMQ trainer link"),
])
def test_a_broadcast_the_job_cannot_do_is_a_config_error_naming_the_key(
        tmp_path: Path, section: dict[str, dict[str, object]], key: str, why: str) -> None:
    path = tmp_path / "job.toml"
    inference = {"servers": ["http://127.0.0.1:1/v1"], "weight_transfer": "broadcast", **section.get("inference", {})}

    path.write_text(toml_text(inference=inference, transport=section.get("transport", {}),
                              scheduler={"batch_size": 8}, env=[{**ARITHMETIC, "name": "a"}]))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert any(f"{key}: " in p and why in p for p in e.value.problems), e.value.problems


def test_a_resumed_run_goes_back_to_the_newest_checkpoint_on_disk_when_its_policy_went_over_the_wire(
        tmp_path: Path) -> None:
    cfg = config(tmp_path, ["http://127.0.0.1:1/v1"]).inference
    state = OrchestratorState("t", policy_step=7, policy_path=None, disk_step=5, disk_path="/ckpt/step_5")
    assert back_to_disk(state, cfg)
    assert (state.policy_step, state.policy_path) == (5, "/ckpt/step_5")
    on_disk = OrchestratorState("t", policy_step=7, policy_path="/ckpt/step_7", disk_step=7, disk_path="/ckpt/step_7")
    assert not back_to_disk(on_disk, cfg)  # its policy is on disk: reloaded as it is
    assert on_disk.policy_step == 7
    filesystem = dataclasses.replace(cfg, weight_transfer="filesystem")
    assert not back_to_disk(OrchestratorState("t", policy_step=7), filesystem)


async def test_weights_announced_while_no_server_is_up_reach_the_first_one_that_comes_back(tmp_path: Path) -> None:
    async with sim_cluster(1, weight_transfer="gloo") as cluster, rig(tmp_path, cluster) as r:
        run = started(r)
        await cluster.kill(0)
        await r.announce(1)  # its server is down: nothing can take them
        await wait_until(lambda: not r.pool.servers[0].in_rotation, WAIT_S, "the server out", poll_s=0.01)
        assert r.sched.policy == 0
        back = await cluster.restart(0)
        await r.policy(1)  # retried every retry_s until a server could take them
        await stop(run)
        assert back.weight_version == "1"
        assert all(np.array_equal(back.policy.model.weights[k], v) for k, v in r.weights().items())
