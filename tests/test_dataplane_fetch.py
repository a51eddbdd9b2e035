"""Across nodes, the building block: an env worker's span server and the trainer library's fetch, over loopback
TCP, with and without CURVE keys (dataplane/fetch.py)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.dataplane.fetch import SpanServer, fetch_spans
from orchestrator.dataplane.store import ColumnStore
from orchestrator.errors import WireError
from orchestrator.security import ServerKeys
from orchestrator.testing.keys import make_key_set

sys.path.insert(0, str(Path(__file__).parent))
from dataplane_peer import record

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
