"""The hub's edge for direct-mode records, on a real ZMQ socket: a span must lie in the pool its worker announced;
spans of records the hub does not pass on are released to their worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
import zmq.asyncio

from orchestrator.dataplane.layout import SpanLoc, span_layout
from orchestrator.errors import Failure
from orchestrator.worker.hub import RecordsIn, WorkerHub
from orchestrator.worker.protocol import (
    Assign,
    Cancel,
    EnvSpec,
    Hello,
    PoolInfo,
    Ready,
    Records,
    Release,
    RolloutHeader,
    Setup,
    decode_orchestrator_message,
    pack,
)

WAIT_S = 60.0  # a hang guard: every wait below ends on a message
SETUP = Setup([EnvSpec("e", "orchestrator-arithmetic")], "sim-model", "unused")
POOL = PoolInfo(id="pool-1", size=1 << 16, host="h", path=None)
NBYTES = span_layout(2, 0, 0, "uint8").nbytes


def header(rid: str, span: SpanLoc) -> RolloutHeader:
    return RolloutHeader(rid=rid, group="g1", env="e", task=0, policy_step=0, worker="w0", server="s", ok=True,
                         reward=1.0, samples=[(2, 0, 0)], tokens=2, span=span)


@contextlib.asynccontextmanager
async def direct_hub(tmp_path: Path, pool: PoolInfo | None) -> AsyncIterator[tuple[WorkerHub, zmq.asyncio.Socket]]:
    """A running hub (no local processes) and a fake worker that announced ``pool``, assigned group g1."""
    ctx = zmq.asyncio.Context()
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"w0")
    worker.setsockopt(zmq.LINGER, 0)
    try:
        async with WorkerHub.open(f"ipc://{tmp_path}/workers.sock", SETUP, local=0, remote=1) as hub, \
                asyncio.TaskGroup() as tg:
            running = tg.create_task(hub.run())
            worker.connect(hub.address)
            await worker.send(pack(Hello("w0", None)))
            assert decode_orchestrator_message(await asyncio.wait_for(worker.recv(), WAIT_S)) == SETUP
            await worker.send(pack(Ready("w0", {"e": 1}, pool)))
            await asyncio.wait_for(hub.wait_ready(1, WAIT_S), WAIT_S)
            hub.assign(Assign("g1", "e", 0, ["g1-0", "g1-1"], "http://127.0.0.1:9/v1", {}, 0))
            assert isinstance(decode_orchestrator_message(await asyncio.wait_for(worker.recv(), WAIT_S)), Assign)
            yield hub, worker
            running.cancel()
    finally:
        worker.close()
        ctx.term()


async def records_in(hub: WorkerHub) -> RecordsIn:
    event = await asyncio.wait_for(hub.events.get(), WAIT_S)
    assert isinstance(event, RecordsIn)
    return event


async def test_a_span_in_the_announced_pool_passes_and_one_outside_it_is_corrupt_and_released(
        tmp_path: Path) -> None:
    async with direct_hub(tmp_path, POOL) as (hub, worker):
        good = header("g1-0", SpanLoc("pool-1", 0, NBYTES))
        outside = header("g1-1", SpanLoc("pool-1", POOL.size - 64, NBYTES))  # runs past the pool's end
        await worker.send(pack(Records("g1", [good, outside])))
        event = await records_in(hub)
        assert [(r.rid, r.ok, r.header.failure) for r in event.records] == [
            ("g1-0", True, None), ("g1-1", False, Failure.CORRUPT)]
        assert event.records[0].header.span == good.span
        assert hub.metrics["rejected:corrupt_record"] == 1
        released = decode_orchestrator_message(await asyncio.wait_for(worker.recv(), WAIT_S))
        assert released == Release(["g1-1"])  # nobody will read it: the worker may reuse its bytes now


async def test_a_span_in_another_pool_or_from_a_worker_without_one_is_corrupt(tmp_path: Path) -> None:
    for pool, span_pool in ((POOL, "pool-0"), (None, "pool-1")):
        async with direct_hub(tmp_path, pool) as (hub, worker):
            await worker.send(pack(Records("g1", [header("g1-0", SpanLoc(span_pool, 0, NBYTES))])))
            event = await records_in(hub)
            assert [r.header.failure for r in event.records] == [Failure.CORRUPT]
            assert "pool" in (event.records[0].header.error or "")
            assert decode_orchestrator_message(await asyncio.wait_for(worker.recv(), WAIT_S)) == Release(["g1-0"])


async def test_the_span_of_a_late_record_is_released(tmp_path: Path) -> None:
    async with direct_hub(tmp_path, POOL) as (hub, worker):
        hub.cancel("g1", ["g1-0", "g1-1"])  # stale: cancelled while the worker finishes it
        assert isinstance(decode_orchestrator_message(await asyncio.wait_for(worker.recv(), WAIT_S)), Cancel)
        await worker.send(pack(Records("g1", [header("g1-0", SpanLoc("pool-1", 0, NBYTES))])))
        assert decode_orchestrator_message(await asyncio.wait_for(worker.recv(), WAIT_S)) == Release(["g1-0"])
        assert hub.metrics["late"] == 1
        assert hub.events.empty()
