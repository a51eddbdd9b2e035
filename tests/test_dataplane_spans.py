"""``SpanLedger``: what the orchestrator holds of each worker's pool, released once; pools replaced or gone; room.
``PoolKeeper``: the hub's use of it, with a fake send."""

from __future__ import annotations

import asyncio
from collections import Counter

from orchestrator.columns.layout import SpanLoc
from orchestrator.contracts.events import HubEvent, PoolGone
from orchestrator.contracts.protocol import PoolInfo, Release, RolloutHeader, RolloutRecord
from orchestrator.hub.pools import PoolKeeper
from orchestrator.hub.spans import SpanLedger

P1 = PoolInfo(id="p1", size=1 << 20, host="h")
P2 = PoolInfo(id="p2", size=1 << 20, host="h")


def rec(rid: str, pool: str = "p1", nbytes: int = 256, worker: str = "w") -> RolloutHeader:
    return RolloutHeader(rid=rid, group="g", env="e", task=0, policy_step=0, worker=worker, server="s", ok=True,
                         reward=1.0, span=SpanLoc(pool, 0, nbytes))


def test_held_spans_are_released_once_by_worker() -> None:
    ledger = SpanLedger()
    ledger.announce("w", P1)
    ledger.announce("v", P2)
    heads = [rec("a"), rec("b"), rec("c", "p2", worker="v")]
    for h in heads:
        ledger.hold(h)
    assert ledger.release(heads) == {"w": ["a", "b"], "v": ["c"]}
    assert ledger.release(heads) == {}
    assert ledger.released == 3


def test_spans_of_another_pool_or_never_held_are_not_released() -> None:
    ledger = SpanLedger()
    ledger.announce("w", P1)
    ledger.hold(rec("old", "p0"))  # a pool the worker no longer has: not held
    no_span = RolloutHeader(rid="n", group="g", env="e", task=0, policy_step=0, worker="w", server="s", ok=False)
    ledger.hold(no_span)
    assert ledger.release([rec("old", "p0"), no_span, rec("never")]) == {}


def test_the_same_pool_again_keeps_what_is_held_a_new_one_replaces_it() -> None:
    ledger = SpanLedger()
    assert ledger.announce("w", P1) is None
    ledger.hold(rec("b"))
    ledger.hold(rec("a"))
    assert ledger.announce("w", P1) is None
    assert ledger.keep("w") == ["a", "b"]
    assert ledger.announce("w", P2) == P1  # gone, with what it held
    assert ledger.keep("w") == []
    assert ledger.pools() == {"w": P2}
    assert ledger.release([rec("a")]) == {}


def test_a_forgotten_worker_has_no_pool() -> None:
    ledger = SpanLedger()
    ledger.announce("w", P1)
    assert ledger.forget("w") == P1
    assert ledger.forget("w") is None
    assert ledger.pool("w") is None


def test_room_is_the_largest_free_range_against_the_largest_rollout_stored() -> None:
    ledger = SpanLedger()
    ledger.announce("w", P1)
    assert ledger.has_room("w")  # nothing reported yet
    ledger.report("w", 0)
    assert not ledger.has_room("w")  # full
    ledger.hold(rec("a", nbytes=4096))
    ledger.report("w", 1024)
    assert not ledger.has_room("w")  # its largest rollout would not fit
    ledger.report("w", 4096)
    assert ledger.has_room("w")
    assert ledger.has_room("unknown")  # a worker without a pool (through mode) always has room


async def test_a_release_the_workers_queue_refused_goes_again_with_its_next_heartbeat() -> None:
    sent: list[tuple[bytes, Release]] = []
    accept = [False]

    def send(ident: bytes, msg: Release) -> bool:
        if accept[0]:
            sent.append((ident, msg))
        return accept[0]

    events: asyncio.Queue[HubEvent] = asyncio.Queue()
    keeper = PoolKeeper(send, events, Counter())
    keeper.ready("w", b"w", P1)
    keeper.passed_on(rec("a"))
    keeper.release([RolloutRecord(rec("a"), [])], {"w": b"w"})  # its queue is full: nothing went
    assert sent == []
    accept[0] = True
    keeper.heartbeat("w", b"w", 1 << 20)
    assert sent == [(b"w", Release(["a"]))]
    keeper.heartbeat("w", b"w", 1 << 20)
    assert len(sent) == 1  # once
    assert keeper.metrics["released"] == 1


async def test_a_replaced_or_gone_pool_is_reported_once_and_announcements_are_news() -> None:
    events: asyncio.Queue[HubEvent] = asyncio.Queue()
    keeper = PoolKeeper(lambda ident, msg: True, events, Counter())
    keeper.ready("w", b"w", P1)
    keeper.ready("w", b"w", P2)  # renewed
    keeper.gone("w", "exited")
    keeper.gone("w", "exited")  # already gone: nothing more
    assert [events.get_nowait() for _ in range(events.qsize())] == [
        PoolGone("w", "p1", "replaced by pool p2"), PoolGone("w", "p2", "exited")]
    assert [keeper.news.get_nowait() for _ in range(keeper.news.qsize())] == [("w", P1), ("w", P2)]
    assert keeper.metrics["pools_gone"] == 2
