"""Across nodes, the building block: an env worker's span server and the trainer library's fetch, over loopback
TCP, with and without CURVE keys (trainer/fetch.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from orchestrator.columns.store import ColumnStore
from orchestrator.contracts.manifest import StepManifest, build_manifest
from orchestrator.contracts.protocol import PoolInfo
from orchestrator.errors import WireError
from orchestrator.security import ServerKeys
from orchestrator.testing.keys import make_key_set
from orchestrator.trainer.fetch import SpanClient, SpanServer, _request, fetch_spans
from orchestrator.trainer.reader import PoolMaps, PoolsLost, StepView

sys.path.insert(0, str(Path(__file__).parent))
from dataplane_peer import WORKER, peer_samples, record

WAIT_S = 30.0  # a hang guard for fetches that must succeed
REFUSED_S = 1.0  # how long a fetch that gets no answer waits


@contextlib.asynccontextmanager
async def served(keys: ServerKeys | None = None) -> AsyncIterator[tuple[ColumnStore, SpanServer]]:
    store = ColumnStore(1 << 20)
    try:
        async with SpanServer.open(store, "tcp://127.0.0.1:0", keys) as server:
            yield store, server
    finally:
        store.close()


async def test_spans_arrive_as_they_are_in_the_pool() -> None:
    async with served() as (store, server):
        spans = []
        for i in range(3):
            span = record(store, i).header.span
            assert span is not None
            spans.append((span.offset, span.nbytes))
        got = await asyncio.to_thread(fetch_spans, server.address, store.id, spans, WAIT_S)
        pool = store.buffer()
        assert [bytes(b) for b in got] == [bytes(pool[o:o + n]) for o, n in spans]
        assert server.served == 1


async def test_a_wrong_pool_or_a_span_outside_it_is_refused_with_the_reason() -> None:
    async with served() as (store, server):
        with pytest.raises(WireError, match="is not served here"):
            await asyncio.to_thread(fetch_spans, server.address, "another-pool", [(0, 64)], WAIT_S)
        with pytest.raises(WireError, match="is not inside pool"):
            await asyncio.to_thread(fetch_spans, server.address, store.id, [(store.capacity - 8, 64)], WAIT_S)
        assert server.refused == 2
        assert server.served == 0


async def test_with_keys_only_an_authorized_trainer_gets_bytes(tmp_path: Path) -> None:
    keys = make_key_set(tmp_path)  # "intruder" has a key pair the server does not accept
    async with served(keys.server()) as (store, server):
        span = record(store, 0).header.span
        assert span is not None
        got = await asyncio.to_thread(fetch_spans, server.address, store.id, [(span.offset, span.nbytes)], WAIT_S,
                                      keys.client("trainer"))
        assert bytes(got[0]) == bytes(store.buffer()[span.offset:span.offset + span.nbytes])
        with pytest.raises(WireError, match="no answer"):
            await asyncio.to_thread(fetch_spans, server.address, store.id, [(span.offset, span.nbytes)], REFUSED_S,
                                    keys.client("intruder"))
        with pytest.raises(WireError, match="no answer"):  # plain text to a CURVE server: nothing either
            await asyncio.to_thread(fetch_spans, server.address, store.id, [(span.offset, span.nbytes)], REFUSED_S)
        assert server.served == 1


def remote_manifest(store: ColumnStore, address: str, rollouts: range) -> StepManifest:
    """A step of ``rollouts`` whose pool is on another host, served at ``address``."""
    pool = PoolInfo(id=store.id, size=store.capacity, host="worker-node", path=None)
    m = build_manifest("run", 0, [(record(store, i), 0.5) for i in rollouts], {WORKER: pool})
    return msgspec.structs.replace(m, pools=[msgspec.structs.replace(m.pools[0], address=address)])


async def test_the_reader_fetches_the_spans_of_a_pool_on_another_host() -> None:
    async with served() as (store, server):
        m = remote_manifest(store, server.address, range(3))
        maps = PoolMaps(host="trainer-node")
        view = await asyncio.to_thread(maps.view, m)
        assert isinstance(view, StepView)
        assert maps.remote_fetches == 1  # one request for the pool's three spans
        assert store.id not in maps  # nothing mapped
        batch = view.gather()
        for name in ("token_ids", "loss_mask", "logprobs", "routed_experts"):
            want = np.concatenate([getattr(s, name) for i in range(3) for s in peer_samples(i)])
            np.testing.assert_array_equal(batch.columns[name], want)
        maps.close()


async def test_a_pool_on_another_host_whose_server_is_gone_is_a_lost_step() -> None:
    async with served() as (store, server):
        address = server.address
        m = remote_manifest(store, address, range(1))
    maps = PoolMaps(host="trainer-node", fetch_timeout_s=REFUSED_S)  # the server (its worker) is gone now
    with pytest.raises(PoolsLost, match="no answer") as lost:
        await asyncio.to_thread(maps.view, m)
    assert lost.value.pools == [m.pools[0].id]
    maps.close()


async def test_the_reader_fetches_from_a_curve_span_server_with_its_own_key_pair(tmp_path: Path) -> None:
    keys = make_key_set(tmp_path)  # the server's pair plays the worker's; "trainer" is authorized
    async with served(keys.server()) as (store, server):
        m = remote_manifest(store, server.address, range(2))
        ref = msgspec.structs.replace(m.pools[0], public_key=keys.server().keys.public.decode())
        m = msgspec.structs.replace(m, pools=[ref])
        maps = PoolMaps(host="trainer-node", keys=keys.client("trainer").keys)
        view = await asyncio.to_thread(maps.view, m)
        want = np.concatenate([s.token_ids for i in range(2) for s in peer_samples(i)])
        np.testing.assert_array_equal(view.gather().columns["token_ids"], want)
        maps.close()
        with pytest.raises(PoolsLost, match="this trainer has no key pair"):
            await asyncio.to_thread(PoolMaps(host="trainer-node").view, m)
        intruder = PoolMaps(host="trainer-node", fetch_timeout_s=REFUSED_S, keys=keys.client("intruder").keys)
        with pytest.raises(PoolsLost, match="no answer"):  # a key pair the server does not accept
            await asyncio.to_thread(intruder.view, m)
        intruder.close()


async def test_a_client_keeps_one_connection_per_server_and_replaces_it_after_a_failure() -> None:
    async with served() as (store, server):
        m = remote_manifest(store, server.address, range(2))
        spans = [(s.offset, s.layout().nbytes) for s in m.spans]
        client = SpanClient()
        for _ in range(3):
            got = await asyncio.to_thread(client.fetch, server.address, store.id, spans, 5.0)
            assert [len(b) for b in got] == [n for _, n in spans]
            assert client.connections == 1  # the same one each time
        with pytest.raises(WireError, match="refused the fetch"):
            await asyncio.to_thread(client.fetch, server.address, "another-pool", spans, 5.0)
        assert client.connections == 0  # closed: a late reply could not answer a later request
        await asyncio.to_thread(client.fetch, server.address, store.id, spans, 5.0)
        assert client.connections == 1
        assert (server.served, server.refused) == (4, 1)
        client.close()


def test_a_request_with_no_connection_to_its_server_ends_within_its_timeout() -> None:
    """A DEALER with no pipe to its server (here IMMEDIATE and nothing listening; in a job, a refused handshake
    being retried) blocks a plain send for ever: the request's send is bounded by the fetch's timeout too."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"  # bound, never listening: connections are refused
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no pipe until a connection is made
        sock.connect(address)
        t0 = time.monotonic()
        try:
            with pytest.raises(WireError, match="no answer"):
                _request(sock, address, "pool", [(0, 64)], REFUSED_S)
        finally:
            sock.close()
    assert time.monotonic() - t0 < WAIT_S  # bounded (it used to block until the test's own timeout)
