"""No message can stall or stop the worker hub, and nothing a process that was not assigned a rollout sends
reaches a step.

A real ``WorkerHub`` on a real ZMQ socket: a well-behaved fake worker runs one group, while rogue processes
(hypothesis: random bytes, random maps, forged records of that group, byte-flipped valid messages, with
random frames) send whatever they like. Every rogue message is handled (counted), most are rejections, the
hub keeps running, and the events it hands the scheduler are exactly the fake worker's records. Then a
whole job runs while a rogue floods its hub: the job completes, the rejections are counted, and nothing the
rogue forged is in any batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import orjson
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.app import Orchestrator
from orchestrator.contracts.events import RecordsIn
from orchestrator.contracts.protocol import (
    Assign,
    EnvSpec,
    Fatal,
    Heartbeat,
    Hello,
    Ready,
    Records,
    RolloutHeader,
    Setup,
    decode_orchestrator_message,
    pack,
)
from orchestrator.contracts.wire import Batch
from orchestrator.hub.hub import WorkerHub
from orchestrator.testing.jobs import ARITHMETIC, job_config
from orchestrator.testing.procs import wait_until
from orchestrator.testing.sim import sim_servers
from orchestrator.trainer.reference import ReferenceTrainer

FORGED_REWARD = 7.75
FORGED_TOKEN = 4242  # no sampled token has this id in the built-in vocabulary
WAIT_S = 60.0  # a hang guard: every wait below ends on a message or a count
FLOOD_BEFORE_TRAINING = 50  # rogue messages sent (its hello handled) before the trainer starts
SETUP = Setup([EnvSpec("e", "orchestrator-arithmetic")], "sim-model", "unused")
GROUP = Assign("g1", "e", 0, ["g1-0", "g1-1"], "http://127.0.0.1:9/v1", {}, 0)


def header(rid: str, worker: str, reward: float = 1.0) -> RolloutHeader:
    return RolloutHeader(rid=rid, group="g1", env="e", task=0, policy_step=0, worker=worker, server="s", ok=True,
                         reward=reward, samples=[(2, 0, 0)], tokens=2)


def columns(token: int) -> list[bytes]:
    return [np.full(2, token, np.int32).tobytes(), b"\x01\x01", np.zeros(2, np.float32).tobytes(), b""]


def records(worker: str, reward: float, token: int) -> list[bytes]:
    headers = [header(rid, worker, reward) for rid in GROUP.rids]
    for h in headers:
        h.frames = 4
    return [pack(Records("g1", headers)), *columns(token), *columns(token)]


# hello, ready, then the group's records forged: in this order, the straight attack
VALID = [[pack(Hello("rogue", 7))], [pack(Ready("rogue", {"e": 1}))], records("rogue", FORGED_REWARD, FORGED_TOKEN),
         [pack(Heartbeat("rogue", 0))], [pack(Fatal("rogue", "I say stop"))]]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
                    st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                            max_size=3), max_leaves=8)
random_map = st.dictionaries(st.sampled_from(["type", "worker", "group", "records", "envs", "error", "pid", "x"]),
                             values, max_size=5).map(lambda d: msgpack.packb(d, use_bin_type=True))
typed_map = st.tuples(st.sampled_from(["hello", "ready", "records", "heartbeat", "fatal", "setup", "assign", "?"]),
                      st.dictionaries(st.text(max_size=8), values, max_size=4)).map(
    lambda t: msgpack.packb({"type": t[0], **t[1]}, use_bin_type=True))


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    frames = [bytearray(f) for f in draw(st.sampled_from(VALID))]
    for _ in range(draw(st.integers(1, 4))):
        f = frames[draw(st.integers(0, len(frames) - 1))]
        if f:
            f[draw(st.integers(0, len(f) - 1))] ^= draw(st.integers(1, 255))
    return [bytes(f) for f in frames]


message = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=5),
    st.tuples(random_map | typed_map, st.lists(st.binary(max_size=16), max_size=4)).map(lambda t: [t[0], *t[1]]),
    st.sampled_from(VALID),
    mutated(),
)


@contextlib.asynccontextmanager
async def hub_with_worker(tmp_path: Path) -> AsyncIterator[tuple[WorkerHub, zmq.asyncio.Socket, str]]:
    """A running hub (no local processes) and a fake worker, ready, running group g1."""
    address = f"ipc://{tmp_path}/workers.sock"
    ctx = zmq.asyncio.Context()
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"w0")
    worker.setsockopt(zmq.LINGER, 0)
    try:
        async with WorkerHub.open(address, SETUP, local=0, remote=1) as hub, asyncio.TaskGroup() as tg:
            running = tg.create_task(hub.run())
            worker.connect(hub.address)
            await worker.send(pack(Hello("w0", None)))
            assert decode_orchestrator_message(await asyncio.wait_for(worker.recv(), WAIT_S)) == SETUP
            await worker.send(pack(Ready("w0", {"e": 1})))
            await asyncio.wait_for(hub.wait_ready(1, WAIT_S, WAIT_S), WAIT_S)
            assert hub.assign(GROUP) == "w0"
            yield hub, worker, hub.address
            assert not running.done()  # nothing stopped it
            running.cancel()
    finally:
        worker.close()
        ctx.term()


async def rogue_run(tmp_path: Path, batches: list[list[list[bytes]]]) -> tuple[list[Any], dict[str, int]]:
    async with hub_with_worker(tmp_path) as (hub, worker, address):
        ctx = zmq.asyncio.Context()
        rogues = [ctx.socket(zmq.DEALER) for _ in batches]
        try:
            for i, rogue in enumerate(rogues):
                rogue.setsockopt(zmq.IDENTITY, f"rogue-{i}".encode())
                rogue.setsockopt(zmq.LINGER, 0)
                rogue.connect(address)
            # every rogue first tries the straight attack: register, then report the group's rollouts itself
            batches = [[*VALID[:3], *batch] for batch in batches]
            sent = hub.metrics["messages"] + sum(len(b) for b in batches)
            for rogue, batch in zip(rogues, batches, strict=True):
                for frames in batch:
                    await rogue.send_multipart(frames)
            await wait_until(lambda: hub.metrics["messages"] >= sent, WAIT_S, "every rogue message handled",
                             poll_s=0.005)
            await worker.send_multipart(records("w0", 1.0, 7))  # the real records, after all that
            event = await asyncio.wait_for(hub.events.get(), WAIT_S)
            leftovers = []
            while not hub.events.empty():
                leftovers.append(hub.events.get_nowait())
        finally:
            for rogue in rogues:
                rogue.close()
            ctx.term()
        assert isinstance(event, RecordsIn)
        return [event, *leftovers], dict(hub.metrics)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(message, min_size=1, max_size=12), min_size=1, max_size=3))
def test_nothing_a_rogue_sends_stops_the_hub_or_reaches_the_scheduler(tmp_path: Path,
                                                                     batches: list[list[list[bytes]]]) -> None:
    events, metrics = asyncio.run(rogue_run(tmp_path, batches))
    assert len(events) == 1  # only the fake worker's records
    got = events[0].records
    assert [(r.rid, r.header.worker, r.reward) for r in got] == [("g1-0", "w0", 1.0), ("g1-1", "w0", 1.0)]
    assert all(r.column("token_ids").tolist() == [7, 7] for r in got)
    rejected = sum(v for k, v in metrics.items() if k.startswith("rejected:"))
    accepted_kinds = metrics.get("lost", 0) + metrics.get("fatal", 0)
    assert rejected + accepted_kinds <= metrics["messages"]


async def test_a_worker_that_keeps_sending_invalid_messages_is_dropped(tmp_path: Path) -> None:
    async with hub_with_worker(tmp_path) as (hub, worker, _):
        for _ in range(25):
            await worker.send_multipart([b"\xc1 not msgpack"])
        lost = await asyncio.wait_for(hub.events.get(), WAIT_S)  # its group's rollouts are lost, not left hanging
        assert (lost.worker, sorted(getattr(lost, "rids", []))) == ("w0", GROUP.rids)
        assert hub.metrics["dropped"] == 1
        assert not hub.has_ready()
        await worker.send_multipart(records("w0", 1.0, 7))  # too late: it is not admitted again
        await wait_until(lambda: hub.metrics["rejected:dropped_worker"] >= 1, WAIT_S, "the dropped worker ignored",
                         poll_s=0.005)
        assert hub.events.empty()


@dataclass
class Flood:
    """A rogue that sends forged and random messages to the hub at ``address`` (``run``) until ``stop`` is set;
    ``sent``: how many so far."""

    address: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    sent: int = 0

    async def run(self, seed: int = 0) -> None:
        rng = random.Random(seed)
        ctx = zmq.asyncio.Context()
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.IDENTITY, b"rogue")
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(self.address)
        try:
            await self._send(rogue, rng)
        finally:
            rogue.close()
            ctx.term()

    async def _send(self, rogue: zmq.asyncio.Socket, rng: random.Random) -> None:
        await rogue.send(pack(Hello("local-0", 1)))  # claims a local worker's name, with another pid
        await rogue.send(pack(Ready("rogue", {"orchestrator-arithmetic": 1000})))
        while not self.stop.is_set():
            group = f"g{rng.randint(1, 20)}"
            forged = [header(f"{group}-{i}", "local-0", FORGED_REWARD) for i in range(4)]
            for h in forged:
                h.group, h.env, h.frames = group, "orchestrator-arithmetic", 4
            choice = rng.random()
            if choice < 0.4:
                frames = [pack(Records(group, forged)), *columns(FORGED_TOKEN) * 4]
            elif choice < 0.6:
                frames = [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(1, 3))]
            elif choice < 0.8:
                flipped = [bytearray(f) for f in rng.choice(VALID)]
                flipped[0][rng.randrange(len(flipped[0]))] ^= 0xFF
                frames = [bytes(f) for f in flipped]
            else:
                frames = [pack(Fatal("local-0", "I say stop"))]
            await rogue.send_multipart([bytes(f) for f in frames])
            self.sent += 1
            await asyncio.sleep(0.002)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_job_completes_while_a_rogue_floods_its_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    batches: list[Batch] = []
    async with sim_servers(1) as servers:
        cfg = job_config(tmp_path, run={"name": "fuzz", "max_steps": 3}, inference={"servers": [servers[0].url]},
                         scheduler={"batch_size": 8, "max_inflight": 8},
                         pipeline={"gates": []},  # every finished group trains: gates are not what this test is about
                         env=[ARITHMETIC])
        async with Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=3, on_batch=lambda b: batches.append(
                Batch(b.run, b.step, {k: v.copy() for k, v in b.columns.items()}, b.offsets.copy(), dict(b.scalars))),
                checkpoint_dir=tmp_path / "ckpt")
            rogue = Flood(orch.hub.address)

            async def train_once_the_flood_is_on() -> None:
                # the job cannot end before the trainer takes its steps (at most send_hwm = 2 of its 3 go out
                # unacknowledged), so the flood is on, its hello refused, while the job runs, however fast either goes
                await wait_until(lambda: rogue.sent >= FLOOD_BEFORE_TRAINING
                                 and orch.hub.metrics["rejected:unknown_worker"] >= 1, WAIT_S,
                                 "the flood to begin", poll_s=0.01)
                await trainer.run()

            async with asyncio.timeout(240), asyncio.TaskGroup() as tg:
                tg.create_task(train_once_the_flood_is_on())
                tg.create_task(rogue.run())
                await orch.run()
                rogue.stop.set()
            metrics = dict(orch.hub.metrics)
    assert rogue.sent >= FLOOD_BEFORE_TRAINING
    assert metrics["rejected:unknown_worker"] >= 1  # its hellos: no remote worker was expected
    assert [b.step for b in batches] == [0, 1, 2]
    assert all(FORGED_TOKEN not in b.columns["token_ids"] for b in batches)
    assert all(FORGED_REWARD not in b.scalars["reward"] for b in batches)
    rows = [orjson.loads(line) for line in (tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines()]
    assert all(r["reward"] != FORGED_REWARD for r in rows)
    assert sum(v for k, v in metrics.items() if k.startswith("rejected:")) > 0, metrics
