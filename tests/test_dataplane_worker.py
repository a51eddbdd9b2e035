"""An env worker with ``data_plane = "direct"``, on a real ZMQ pair: records carry spans of its column pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from orchestrator.columns.layout import ALIGN
from orchestrator.columns.memfd import map_served_pool
from orchestrator.columns.samples import PlainNode, build_sample
from orchestrator.columns.versions import TokenVersions
from orchestrator.contracts.manifest import build_manifest
from orchestrator.contracts.protocol import (
    Assign,
    Cancel,
    Heartbeat,
    Ready,
    Records,
    Release,
    RolloutRecord,
    Setup,
    Stop,
    TokenFilter,
    decode_worker_message,
    pack,
    sample_frames,
    split_records,
)
from orchestrator.errors import Failure, TransportError
from orchestrator.scoring.filters import is_gibberish, is_repetition
from orchestrator.testing.keys import make_key_set
from orchestrator.trainer.fetch import fetch_spans
from orchestrator.trainer.reader import PoolMaps, PoolsLost
from orchestrator.workers.process import LoadedEnv, Worker

HANG_S = 30.0  # a hang guard only


def nodes_for(slot: int) -> list[PlainNode]:
    """Two turns whose every value depends on ``slot``; routed experts [tokens, 3, 2]."""
    rng = np.random.default_rng(slot)
    out = []
    for n in (7 + slot, 5):
        mask = [i >= 2 for i in range(n)]
        out.append(PlainNode(token_ids=rng.integers(0, 1000, n).tolist(), mask=mask,
                             logprobs=[-0.5 - slot] * sum(mask), routed_experts=rng.integers(0, 64, (n, 3, 2))))
    return out


@dataclass
class Branch:
    nodes: list[PlainNode]
    trainable: bool = True


@dataclass
class Trace:
    branches: list[Branch]
    reward: float = 1.0
    ok: bool = True
    errors: list[Any] = field(default_factory=list)
    stop_condition: str = "stop"
    metrics: dict[str, float] = field(default_factory=dict)
    num_turns: int = 2


@dataclass
class Episode:
    traces: list[Trace]
    ok: bool = True
    errors: list[Any] = field(default_factory=list)
    is_timeout: bool = False


class TraceEnv:
    """An environment whose slot ``i`` returns a deterministic two-turn trace; slots in ``hold`` wait for
    ``release`` first (a rollout still running); ``returned`` is set when a slot returns (the worker then writes
    its columns before it next yields to the loop)."""

    def __init__(self) -> None:
        self.taskset = [{"prompt": "x"}]
        self.hold: set[int] = set()
        self.release = asyncio.Event()
        self.returned = asyncio.Event()

    def slots(self, task: Any, n: int) -> list[int]:
        return list(range(n))

    async def run_slot(self, slot: int, ctx: Any) -> Episode:
        if slot in self.hold:
            await self.release.wait()
        self.returned.set()
        return Episode([Trace([Branch(nodes_for(slot))])])


def setup(tmp_path: Path, session: str = "s1", pool_bytes: int = 1 << 20) -> Setup:
    return Setup([], "m", "tok", data_plane="direct", worker_pool_bytes=pool_bytes, pool_dir=str(tmp_path),
                 session=session)


@contextlib.asynccontextmanager
async def direct_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool_bytes: int = 1 << 20,
                        span_address: str | None = None
                        ) -> AsyncIterator[tuple[Worker, TraceEnv, zmq.asyncio.Socket, zmq.asyncio.Socket]]:
    """A worker with a TraceEnv and its column pool (served in ``tmp_path``); (worker, env, its socket, ours)."""
    ctx = zmq.asyncio.Context()
    ours, theirs = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    ours.bind("inproc://direct-worker")
    theirs.connect("inproc://direct-worker")
    worker = Worker("inproc://unused", "w0", span_address=span_address)
    env = TraceEnv()
    worker.envs["e"] = LoadedEnv("e", env)
    monkeypatch.setattr(worker, "_model_context", lambda server, sampling: None)
    try:
        async with contextlib.AsyncExitStack() as stack:
            worker.setup = setup(tmp_path, pool_bytes=pool_bytes)
            await worker.open_store(stack, worker.setup)
            yield worker, env, theirs, ours
    finally:
        ours.close()
        theirs.close()
        ctx.term()


async def next_message(sock: zmq.asyncio.Socket) -> tuple[Any, list[memoryview]]:
    """The next message that is not a heartbeat, decoded, with its frames."""
    async with asyncio.timeout(HANG_S):
        while True:
            frames = await sock.recv_multipart(copy=False)
            msg = decode_worker_message(frames[0].buffer)
            if not isinstance(msg, Heartbeat):
                return msg, [f.buffer for f in frames[1:]]


def assign(group: str, n: int) -> Assign:
    return Assign(group, "e", 0, [f"{group}-{i}" for i in range(n)], "http://127.0.0.1:9/v1", {}, 0)


async def test_records_carry_spans_and_the_served_pool_holds_exactly_the_column_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with direct_worker(tmp_path, monkeypatch) as (worker, _env, theirs, ours):
        assert worker.store is not None
        assert worker.pool_path == str(tmp_path / "w0.pool")
        await worker._run_group(theirs, assign("g1", 3))
        msg, frames = await next_message(ours)
        assert isinstance(msg, Records)
        assert frames == []  # no column bytes travel with the records
        records = split_records(msg, frames)
        # as a trainer would, from another thread (the pool is served from this loop)
        mapping = await asyncio.to_thread(map_served_pool, worker.pool_path, worker.store.id, worker.store.capacity)
        view = memoryview(mapping)
        try:
            for slot, rec in enumerate(records):
                rec.check()  # what the hub checks
                span = rec.header.span
                assert span is not None
                assert span.pool == worker.store.id
                assert span.offset % ALIGN == 0
                shapes, expect = sample_frames([build_sample(nodes_for(slot), TokenVersions(0))])
                assert rec.header.samples == shapes
                at = span.offset
                for frame in expect:  # the same bytes the through path sends, in the layout's order
                    raw = frame if isinstance(frame, bytes) else frame.tobytes()
                    assert bytes(view[at:at + len(raw)]) == raw
                    at += -(-len(raw) // ALIGN) * ALIGN
            with pytest.raises(TypeError):
                view[0:1] = b"x"  # the trainer's mapping is read-only
        finally:
            view.release()
            mapping.close()
        assert worker.store.live_bytes == sum(r.header.span.nbytes for r in records if r.header.span)


async def test_a_record_without_frames_names_where_its_columns_are_instead_of_being_read_empty(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with direct_worker(tmp_path, monkeypatch) as (worker, _env, theirs, ours):
        await worker._run_group(theirs, assign("g1", 1))
        msg, frames = await next_message(ours)
        assert isinstance(msg, Records)
        rec = RolloutRecord(msg.records[0], frames)
        with pytest.raises(Exception, match="pool"):
            rec.column("token_ids")


async def test_a_cancelled_group_frees_the_spans_of_records_it_never_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with direct_worker(tmp_path, monkeypatch) as (worker, env, theirs, _ours):
        assert worker.store is not None
        env.hold = {1}  # slot 0 finishes and is written; slot 1 runs on
        group = asyncio.create_task(worker._run_group(theirs, assign("g1", 2)))
        await asyncio.wait_for(env.returned.wait(), HANG_S)
        assert worker.store.span("g1-0") is not None  # written, not sent: its group still runs
        group.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await group
        assert worker.store.live_bytes == 0
        assert worker.store.span("g1-0") is None


async def test_a_rollout_larger_than_the_pool_fails_and_the_group_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with direct_worker(tmp_path, monkeypatch, pool_bytes=4 * ALIGN) as (worker, _env, theirs, ours):
        await worker._run_group(theirs, assign("g1", 2))
        msg, _ = await next_message(ours)
        assert isinstance(msg, Records)
        assert [h.failure for h in msg.records] == [Failure.POOL_TOO_SMALL] * 2
        assert all("worker_pool_mb" in (h.error or "") for h in msg.records)


async def test_release_frees_spans_and_a_new_orchestrator_session_renews_the_pool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with direct_worker(tmp_path, monkeypatch) as (worker, _env, theirs, ours):
        store = worker.store
        assert store is not None
        serve = asyncio.create_task(worker._serve(theirs))
        try:
            await ours.send(pack(assign("g1", 2)))
            msg, _ = await next_message(ours)
            assert isinstance(msg, Records)
            assert store.live_bytes > 0
            first_pool = store.id
            await ours.send(pack(Release(["g1-0", "g1-1", "never-stored"])))
            await ours.send(pack(setup(tmp_path)))  # the same orchestrator sets the worker up again
            ready, _ = await next_message(ours)
            assert isinstance(ready, Ready)
            assert ready.pool is not None
            assert ready.pool.id == first_pool  # same session: the same pool (and its spans) stay
            assert store.live_bytes == 0  # the release came first

            await ours.send(pack(assign("g2", 1)))
            msg, _ = await next_message(ours)
            assert isinstance(msg, Records)
            assert store.live_bytes > 0
            await ours.send(pack(setup(tmp_path, session="s2")))  # a restarted orchestrator
            ready, _ = await next_message(ours)
            assert isinstance(ready, Ready)
            assert ready.pool is not None
            assert ready.pool.id != first_pool
            assert ready.pool.id == store.id
            assert store.live_bytes == 0
            mapping = await asyncio.to_thread(map_served_pool, str(tmp_path / "w0.pool"), store.id, store.capacity)
            mapping.close()
            await ours.send(pack(Cancel("none")))
            await ours.send(pack(Stop()))
            await asyncio.wait_for(serve, HANG_S)
        finally:
            serve.cancel()


async def test_a_resync_keeps_only_what_the_orchestrator_holds_and_heartbeats_report_the_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with direct_worker(tmp_path, monkeypatch) as (worker, _env, theirs, ours):
        store = worker.store
        assert store is not None
        serve = asyncio.create_task(worker._serve(theirs))
        try:
            await ours.send(pack(assign("g1", 2)))
            msg, _ = await next_message(ours)
            assert isinstance(msg, Records)
            kept = store.span("g1-1")
            await ours.send(pack(Release([], keep=["g1-1"])))  # re-admitted: the orchestrator holds g1-1 only
            async with asyncio.timeout(HANG_S):
                while True:  # heartbeats come every HEARTBEAT_S; one after the release shows its effect
                    beat = decode_worker_message(await ours.recv())
                    if isinstance(beat, Heartbeat) and store.span("g1-0") is None:
                        break
            assert store.span("g1-1") == kept
            assert kept is not None
            assert store.live_bytes == kept.nbytes
            assert beat.pool_free is not None
            assert 0 < beat.pool_free <= store.capacity - kept.nbytes
            await ours.send(pack(Stop()))
            await asyncio.wait_for(serve, HANG_S)
        finally:
            serve.cancel()


async def test_the_worker_runs_the_token_filters_on_the_tokens_the_orchestrator_will_not_see(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    filters = [TokenFilter(1, "gibberish", {"vocab_size": 2, "token_id_threshold": 500}),
               TokenFilter(2, "repetition", {"window": 3, "prob_threshold": 0.5})]
    async with direct_worker(tmp_path, monkeypatch) as (worker, _env, theirs, ours):
        worker.setup = msgspec.structs.replace(worker.setup, token_filters=filters)
        await worker._run_group(theirs, assign("g1", 4))
        msg, _ = await next_message(ours)
        assert isinstance(msg, Records)
    for slot, h in enumerate(msg.records):
        sample = build_sample(nodes_for(slot), TokenVersions(0))  # what the orchestrator would read in through mode
        mask = sample.loss_mask.astype(bool)
        ids, logprobs = sample.token_ids[mask], sample.logprobs[mask]
        expect = [i for i, hit in ((1, is_gibberish(ids, logprobs, vocab_size=2, token_id_threshold=500)),
                                   (2, is_repetition(logprobs, window=3, prob_threshold=0.5))) if hit]
        assert h.filters == expect, slot
    assert [h.filters for h in msg.records] == [[2], [], [], [1]]  # slot 0 loops at p > 0.5; slot 3 is gibberish


async def test_a_worker_given_a_span_address_serves_its_spans_to_other_hosts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with direct_worker(tmp_path, monkeypatch, span_address="tcp://127.0.0.1:0") as (worker, _env, theirs, ours):
        assert worker.store is not None
        assert worker.span_address is not None
        assert not worker.span_address.endswith(":0")  # the port it got
        ready = worker._ready()
        assert ready.pool is not None
        assert ready.pool.address == worker.span_address  # announced: manifests name it for remote readers
        await worker._run_group(theirs, assign("g1", 2))
        msg, frames = await next_message(ours)
        assert isinstance(msg, Records)
        spans = [r.header.span for r in split_records(msg, frames)]
        pairs = [(s.offset, s.nbytes) for s in spans if s is not None]
        got = await asyncio.to_thread(fetch_spans, worker.span_address, worker.store.id, pairs, HANG_S)
        pool = worker.store.buffer()
        assert [bytes(b) for b in got] == [bytes(pool[o:o + n]) for o, n in pairs]
        # a trainer on another host reads the step through the manifest's pool entry, which names the server
        records = split_records(msg, frames)
        manifest = build_manifest("run", 0, [(r, 1.0) for r in records], {"w0": ready.pool})
        maps = PoolMaps(host="trainer-node")
        batch = (await asyncio.to_thread(maps.view, manifest)).gather()
        assert maps.remote_fetches == 1
        maps.close()
        want = [build_sample(nodes_for(slot), TokenVersions(0)) for slot in range(2)]
        np.testing.assert_array_equal(batch.columns["token_ids"], np.concatenate([w.token_ids for w in want]))
        np.testing.assert_array_equal(batch.columns["logprobs"], np.concatenate([w.logprobs for w in want]))
        np.testing.assert_array_equal(batch.columns["versions"], np.concatenate([w.versions for w in want]))


async def test_a_worker_with_keys_serves_its_spans_with_curve_to_the_trainers_the_setup_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = make_key_set(tmp_path / "keys", clients=("worker", "trainer"))
    worker_keys, trainer = keys.client("worker"), keys.client("trainer")
    ctx = zmq.asyncio.Context()
    ours, theirs = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    ours.bind("inproc://curve-worker")
    theirs.connect("inproc://curve-worker")
    worker = Worker("inproc://unused", "w0", worker_keys, span_address="tcp://127.0.0.1:0")
    worker.envs["e"] = LoadedEnv("e", TraceEnv())
    monkeypatch.setattr(worker, "_model_context", lambda server, sampling: None)
    try:
        async with contextlib.AsyncExitStack() as stack:
            worker.setup = msgspec.structs.replace(setup(tmp_path), span_clients=[trainer.keys.public.decode()])
            await worker.open_store(stack, worker.setup)
            ready = worker._ready()
            assert ready.pool is not None
            assert ready.pool.public_key == worker_keys.keys.public.decode()  # the trainer connects to this key
            await worker._run_group(theirs, assign("g1", 1))
            msg, frames = await next_message(ours)
            manifest = build_manifest("run", 0, [(r, 1.0) for r in split_records(msg, frames)], {"w0": ready.pool})
            maps = PoolMaps(host="trainer-node", keys=trainer.keys)
            view = await asyncio.to_thread(maps.view, manifest)
            want = build_sample(nodes_for(0), TokenVersions(0))
            np.testing.assert_array_equal(view.gather().columns["token_ids"], want.token_ids)
            maps.close()
            intruder = PoolMaps(host="trainer-node", fetch_timeout_s=1.0, keys=keys.client("intruder").keys)
            with pytest.raises(PoolsLost, match="no answer"):  # a key pair the setup does not name
                await asyncio.to_thread(intruder.view, manifest)
            intruder.close()
    finally:
        ours.close()
        theirs.close()
        ctx.term()


async def test_a_span_address_that_other_hosts_could_reach_is_refused_without_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TransportError, match="a non-loopback address needs CURVE keys"):
        async with direct_worker(tmp_path, monkeypatch, span_address="tcp://0.0.0.0:0"):
            pass
