"""The hub's edge for direct-mode records, on a real ZMQ socket: a span must lie in the pool its worker announced;
spans of records the hub does not pass on are released to their worker, those it passed on when the scheduler
says so (once); a re-admitted worker is told what to keep, a replaced pool is reported gone, and a worker whose
pool has no room gets no group."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
import zmq.asyncio

from orchestrator.columns.layout import SpanLoc, span_layout
from orchestrator.contracts.events import PoolGone, RecordsIn
from orchestrator.contracts.protocol import (
    Assign,
    Cancel,
    EnvSpec,
    Heartbeat,
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
from orchestrator.errors import Failure
from orchestrator.hub.hub import WorkerHub
from orchestrator.testing.procs import wait_until

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
            await asyncio.wait_for(hub.wait_ready(1, WAIT_S, WAIT_S), WAIT_S)
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


async def next_message(worker: zmq.asyncio.Socket, kind: type) -> object:
    """The next message of ``kind`` the fake worker gets (the hub may send others first)."""
    while True:
        msg = decode_orchestrator_message(await asyncio.wait_for(worker.recv(), WAIT_S))
        if isinstance(msg, kind):
            return msg


async def test_records_passed_on_are_released_once_when_the_scheduler_drops_them(tmp_path: Path) -> None:
    async with direct_hub(tmp_path, POOL) as (hub, worker):
        spans = [header(f"g1-{i}", SpanLoc("pool-1", i * 64 * 4, NBYTES)) for i in range(2)]
        await worker.send(pack(Records("g1", spans)))
        event = await records_in(hub)
        hub.release(event.records)
        assert await next_message(worker, Release) == Release(["g1-0", "g1-1"])
        hub.release(event.records)  # again: nothing to send
        hub.assign(Assign("g2", "e", 0, ["g2-0"], "http://127.0.0.1:9/v1", {}, 0))
        assert isinstance(decode_orchestrator_message(await asyncio.wait_for(worker.recv(), WAIT_S)), Assign)
        assert hub.metrics["released"] == 2


async def test_a_worker_readmitted_with_its_pool_keeps_what_is_held_and_frees_the_rest(tmp_path: Path) -> None:
    async with direct_hub(tmp_path, POOL) as (hub, worker):
        spans = [header(f"g1-{i}", SpanLoc("pool-1", i * 64 * 4, NBYTES)) for i in range(2)]
        await worker.send(pack(Records("g1", spans)))
        event = await records_in(hub)
        hub.release(event.records[:1])  # sent while the worker may be away: the resync covers a lost one
        assert await next_message(worker, Release) == Release(["g1-0"])
        await worker.send(pack(Hello("w0", None)))  # it lost us (or we lost it) and says hello again
        assert await next_message(worker, Setup) == SETUP
        await worker.send(pack(Ready("w0", {"e": 1}, POOL)))
        assert await next_message(worker, Release) == Release([], keep=["g1-1"])
        assert hub.events.empty()  # the same pool: nothing is lost


async def test_a_worker_that_comes_back_with_a_new_pool_reports_the_old_one_gone(tmp_path: Path) -> None:
    async with direct_hub(tmp_path, POOL) as (hub, worker):
        await worker.send(pack(Records("g1", [header("g1-0", SpanLoc("pool-1", 0, NBYTES))])))
        await records_in(hub)
        await worker.send(pack(Hello("w0", None)))
        assert await next_message(worker, Setup) == SETUP
        await worker.send(pack(Ready("w0", {"e": 1}, PoolInfo(id="pool-2", size=1 << 16, host="h"))))
        events = [await asyncio.wait_for(hub.events.get(), WAIT_S) for _ in range(2)]
        assert PoolGone("w0", "pool-1", "replaced by pool pool-2") in events  # and WorkerLost for g1-1
        assert hub.pools.pool("w0") == PoolInfo(id="pool-2", size=1 << 16, host="h")


async def test_a_worker_whose_pool_has_no_room_gets_no_group_until_it_has(tmp_path: Path) -> None:
    async with direct_hub(tmp_path, POOL) as (hub, worker):
        await worker.send(pack(Records("g1", [header("g1-0", SpanLoc("pool-1", 0, NBYTES))])))
        await records_in(hub)
        assert hub.has_ready()
        await worker.send(pack(Heartbeat("w0", pool_free=NBYTES - 64)))  # its largest rollout does not fit
        await wait_until(lambda: not hub.has_ready(), WAIT_S, "the hub to take the heartbeat", poll_s=0.01)
        assert hub.metrics["pool_full"] == 1
        await worker.send(pack(Heartbeat("w0", pool_free=NBYTES)))
        await wait_until(hub.has_ready, WAIT_S, "the hub to take the heartbeat", poll_s=0.01)
        hub.assign(Assign("g2", "e", 0, ["g2-0"], "http://127.0.0.1:9/v1", {}, 0))
        assert isinstance(await next_message(worker, Assign), Assign)
