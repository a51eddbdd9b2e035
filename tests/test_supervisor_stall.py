"""The supervisor's timing rules, on a virtual clock (orchestrator.testing.clock) with the package's defaults.

It does not count its own event loop's stalls against the workers: while the loop is held, what the workers send
waits unread in the socket, so a worker was not silent for that time. A worker silent while the loop runs is still
lost at the bound. Waiting for workers to be ready names what it waits for every ``monitor.stall_warn_s`` and
gives up, naming it, at its timeout. (Frozen, stopped and killed worker processes: test_supervision.py.)"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from orchestrator.contracts.events import HubEvent
from orchestrator.contracts.protocol import HEARTBEAT_S
from orchestrator.errors import WorkerError
from orchestrator.hub.local import LocalWorkers
from orchestrator.hub.pools import PoolKeeper
from orchestrator.hub.roster import Roster, WorkerState
from orchestrator.hub.supervision import Supervisor
from orchestrator.testing.clock import VirtualClockLoop, virtual_time
from orchestrator.testing.procs import wait_until

SILENCE_S = 10.0  # scheduler.worker_silence_s's default
HANG_GUARD_S = 600.0  # virtual seconds


def supervisor() -> tuple[Supervisor, WorkerState]:
    events: asyncio.Queue[HubEvent] = asyncio.Queue()
    metrics: Counter[str] = Counter()
    roster = Roster(lambda *_: True, events, metrics, PoolKeeper(lambda *_: True, events, metrics),
                    LocalWorkers("ipc://unused", {}, nice=0))
    worker = WorkerState(b"remote-0", "remote-0", ready=True)  # not local: no process to look at
    roster.workers[worker.ident] = worker
    return Supervisor(roster, silence_s=SILENCE_S, ready=asyncio.Event(), address="ipc://unused", remote=1), worker


@virtual_time
async def test_a_stall_of_the_loop_is_not_the_workers_silence_but_silence_after_it_is() -> None:
    """The loop's clock is virtual (orchestrator.testing.clock); ``advance`` moves it as a blocking call holding
    the loop would: timers become overdue, and nothing runs meanwhile."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualClockLoop)
    sup, worker = supervisor()
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(sup.run())
        await asyncio.sleep(0.1)
        worker.last_seen = loop.time()
        loop.advance(SILENCE_S + 1.5)  # the loop held past the bound, as a blocking call would
        await asyncio.sleep(0.05)  # the supervisor's overdue tick runs first, before any message could be read
        assert sup.roster.metrics["lost"] == 0  # without the credit: silent for 11.5 s, lost on that tick
        credited_at = loop.time()
        await wait_until(lambda: sup.roster.metrics["lost"] == 1, HANG_GUARD_S, "the silent worker lost")
        # silent for the bound after the stall (the ticks are HEARTBEAT_S apart), not the stall plus the bound again
        assert SILENCE_S - HEARTBEAT_S <= loop.time() - credited_at <= SILENCE_S + 2 * HEARTBEAT_S
        task.cancel()


@virtual_time
async def test_waiting_for_workers_names_what_it_waits_for_every_warn_s_then_gives_up_naming_it(
        caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    sup, worker = supervisor()
    worker.ready = False  # connected, loading its environments
    sup.remote = 2  # and another remote one expected, not connected
    warn_s, timeout_s = 30.0, 300.0  # monitor.stall_warn_s's default; engines.WORKER_READY_TIMEOUT_S's order
    t0 = loop.time()
    with pytest.raises(WorkerError) as gave_up:
        await sup.wait_ready(2, timeout_s, warn_s)
    assert loop.time() - t0 == pytest.approx(timeout_s)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("env workers: ")]
    assert lines == [f"env workers: 0 of 2 ready after {k * warn_s:.0f} s; waiting for 2 remote at ipc://unused "
                     "(1 connected, 0 ready)" for k in range(1, int(timeout_s / warn_s))]
    assert str(gave_up.value) == ("0 of 2 env workers ready after 300 s at ipc://unused (0 local restarts); waiting "
                                  "for 2 remote at ipc://unused (1 connected, 0 ready); see the env workers' logs")


@virtual_time
async def test_waiting_for_workers_ends_when_they_are_ready() -> None:
    loop = asyncio.get_running_loop()
    sup, worker = supervisor()
    worker.ready = False

    async def ready_later() -> None:
        await asyncio.sleep(45)
        worker.ready = True
        sup.ready.set()

    t0 = loop.time()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(ready_later())
        await sup.wait_ready(1, 300.0, 30.0)
    assert loop.time() - t0 == pytest.approx(45)
