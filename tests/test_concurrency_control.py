"""Polling each server's /metrics into its cap (``ConcurrencyControl``), over in-memory servers and a real pool:
caps follow each server's KV cache, a hard trim asks for cancellations, an unreadable server keeps the static cap
(said once), a server out of rotation or not answering keeps its cap, ``take`` obeys the caps, and the stall line
names caps that hold a step back."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import pytest

from orchestrator.config import InferenceConfig
from orchestrator.errors import InferenceError
from orchestrator.inference.pool import InferencePool, Server
from orchestrator.inference.server import HttpStatusError
from orchestrator.rollouts.admission import Admission, Capacity
from orchestrator.rollouts.concurrency import ConcurrencyControl
from orchestrator.rollouts.config import ConcurrencyConfig, SchedulerConfig
from orchestrator.rollouts.groups import Buffer, GroupTracker
from orchestrator.rollouts.stall import StallLine
from orchestrator.sim.kv import KVLoad
from orchestrator.sim.metrics import exposition
from orchestrator.testing.clock import virtual_time
from orchestrator.testing.fake_server import FakeInferenceServer
from orchestrator.testing.procs import wait_until
from orchestrator.testing.workers import FakeWorkerHub

CFG = ConcurrencyConfig(adaptive=True, start_per_server=8)


def metrics(usage: float, *, waiting: int = 0, preemptions: int = 0) -> str:
    """A vLLM 0.31 /metrics text, as the simulator writes it."""
    return exposition("m", KVLoad(usage=usage, running=0, waiting=waiting, preemptions=preemptions), 0.0)


def setup(n: int = 2) -> tuple[list[FakeInferenceServer], InferencePool, list[tuple[str, int]]]:
    fakes = [FakeInferenceServer(f"http://s{i}.invalid/v1") for i in range(n)]
    pool = InferencePool(InferenceConfig(servers=tuple(f.url for f in fakes)), fakes)
    return fakes, pool, []


def control(pool: InferencePool, cancels: list[tuple[str, int]], ceiling: int = 32) -> ConcurrencyControl:
    return ConcurrencyControl(CFG, pool, ceiling, 1, lambda server, n: cancels.append((server.url, n)))


async def test_each_server_gets_its_own_cap_from_its_own_cache() -> None:
    fakes, pool, cancels = setup()
    ctl = control(pool, cancels)
    assert [s.cap for s in pool.servers] == [8, 8]
    pool.servers[0].inflight, pool.servers[1].inflight = 8, 6
    fakes[0].metrics_text = metrics(0.3)
    fakes[1].metrics_text = metrics(0.85)
    await ctl.poll()
    ctl.done(pool.servers[0], 8)
    await ctl.poll()
    assert [s.cap for s in pool.servers] == [9, 8]  # grew (8 completions: a group a poll); the other held
    snap = ctl.snapshot()
    assert snap[fakes[0].url]["rule"] == "grow"
    assert snap[fakes[1].url] == {"cap": 8, "rule": "trim", "cancel_asked": 0, "kv_usage": 0.85, "waiting": 0,
                                  "preemptions": 0, "rollout_tokens": None}
    assert cancels == []


async def test_a_hard_trim_asks_for_the_excess_to_be_cancelled() -> None:
    fakes, pool, cancels = setup(1)
    ctl = ConcurrencyControl(ConcurrencyConfig(adaptive=True, start_per_server=8, cancel_polls=1), pool, 32, 1,
                             lambda server, n: cancels.append((server.url, n)))
    pool.servers[0].inflight = 8
    fakes[0].metrics_text = metrics(0.5, preemptions=2)
    await ctl.poll()  # learns the counter
    fakes[0].metrics_text = metrics(0.95, preemptions=3)  # full, and preempting
    await ctl.poll()
    assert cancels == [(fakes[0].url, 3)]  # floor(8 x 0.7 / 0.95) = 5 kept
    assert pool.servers[0].cap == 5


async def test_the_first_cap_comes_from_the_kv_capacity_and_the_first_rollouts_length(
        caplog: pytest.LogCaptureFixture) -> None:
    fakes, pool, cancels = setup(1)
    ctl = ConcurrencyControl(ConcurrencyConfig(adaptive=True), pool, 64, 4, lambda server, n: cancels.append(
        (server.url, n)))
    server = pool.servers[0]
    assert server.cap == 4  # one group until the first poll
    fakes[0].metrics_text = exposition("m", KVLoad(0.1, 4, 0, 0, blocks=512, block_tokens=16), 0.0)  # 8192
    await ctl.poll()
    assert server.cap == 4  # no rollout has finished: its length is not known
    ctl.done(server, 4, longest=300)
    ctl.done(server, 4, longest=480)
    assert ctl.rollout_tokens(server) == 480
    with caplog.at_level(logging.INFO):
        await ctl.poll()
    assert (server.cap, ctl.snapshot()[server.url]["rule"]) == (17, "start")  # 8192 // 480
    assert ctl.snapshot()[server.url]["rollout_tokens"] == 480
    assert any("first cap 17 rollouts: its KV cache of 8192 tokens over 480 tokens" in r.getMessage()
               for r in caplog.records)
    assert cancels == []
    fixed = ConcurrencyControl(ConcurrencyConfig(adaptive=True, rollout_tokens=1024), pool, 64, 4, lambda s, n: None)
    await fixed.poll()
    assert server.cap == 8  # the set length, before anything finished


async def test_an_unreadable_server_keeps_the_static_cap_said_once(caplog: pytest.LogCaptureFixture) -> None:
    fakes, pool, cancels = setup(1)
    ctl = control(pool, cancels, ceiling=32)
    with caplog.at_level(logging.INFO):
        await ctl.poll()  # no /metrics: 404
        fakes[0].metrics_text = "# no vLLM families here\nfoo 1\n"
        await ctl.poll()
        assert pool.servers[0].cap == 32
        fakes[0].metrics_text = metrics(0.5)
        await ctl.poll()
    said = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(said) == 1
    assert "HTTP 404" in said[0]
    assert "static cap of 32" in said[0]
    assert any("can be read again" in r.getMessage() for r in caplog.records)


async def test_a_server_out_of_rotation_or_not_answering_keeps_its_cap() -> None:
    fakes, pool, cancels = setup(2)
    ctl = control(pool, cancels)
    for f in fakes:
        f.metrics_text = metrics(0.99)
    pool.servers[0].in_rotation = False
    fakes[1].fail_with = InferenceError("connection refused")
    await ctl.poll()
    assert [s.cap for s in pool.servers] == [8, 8]
    assert cancels == []
    assert not [c for c in fakes[0].calls if c[1] == "/metrics"]  # out of rotation: not even asked


async def test_a_server_leaving_rotation_mid_poll_changes_nothing() -> None:
    fakes, pool, cancels = setup(1)
    ctl = control(pool, cancels)
    fakes[0].metrics_text = metrics(0.99)
    fakes[0].hang_paths.add("/metrics")
    poll = asyncio.create_task(ctl.poll())
    await wait_until(lambda: any(c[1] == "/metrics" for c in fakes[0].calls), 30, "the poll's request",
                     poll_s=0.001)  # the request is out, hanging
    pool.servers[0].in_rotation = False
    fakes[0].release()  # the connection is cut as the server goes
    await asyncio.wait_for(poll, 5)
    assert pool.servers[0].cap == 8
    assert cancels == []


async def test_take_obeys_the_caps_and_a_release_wakes_a_wait() -> None:
    _, pool, _ = setup(2)
    a, b = pool.servers
    pool.set_cap(a, 4)
    pool.set_cap(b, 2)
    first, second = pool.take(4), pool.take(2)
    assert {first, second} == {a, b}
    assert pool.take(2) is None  # both at their caps
    assert pool.capped_out(2)
    assert "at its cap" in pool.capped(2)
    waiting = asyncio.create_task(pool.wait_room())
    await asyncio.sleep(0)
    assert not waiting.done()
    pool.release(a, 4)
    await asyncio.wait_for(waiting, 5)  # woken by the release, not its timeout
    server: Server | None = pool.take(2)
    assert server is a


async def test_a_cap_that_does_not_fit_another_group_is_named_as_holding_work_back() -> None:
    _, pool, _ = setup(1)
    pool.set_cap(pool.servers[0], 21)
    for _ in range(2):
        assert pool.take(8) is not None
    assert pool.take(8) is None  # 16 in flight: a third group of 8 does not fit under 21
    assert pool.capped(8) == f"{pool.servers[0].url} at its cap of 21"


async def test_an_idle_server_takes_a_group_larger_than_its_cap() -> None:
    _, pool, _ = setup(1)
    pool.set_cap(pool.servers[0], 1)
    assert pool.take(8) is pool.servers[0]


async def test_a_busy_server_answering_503_keeps_its_cap() -> None:
    fakes, pool, cancels = setup(1)
    ctl = control(pool, cancels)
    fakes[0].fail_paths["/metrics"] = HttpStatusError("GET /metrics: HTTP 503", 503, b"")
    await ctl.poll()
    assert pool.servers[0].cap == 8  # not the static ceiling: a busy server is no reason to open up


async def test_the_stall_line_names_the_caps_that_hold_a_step_back() -> None:
    _, pool, _ = setup(1)  # the pool's timing rules read the running loop's clock
    tracker = GroupTracker(max_off_policy_steps=2, group_timeout_s=600)
    limits = SchedulerConfig(batch_size=8)
    admission = Admission(limits, Capacity(limits.max_inflight, pool, tracker), tracker, Buffer(), {}, None, None, 0, 0)
    stall = StallLine(admission, FakeWorkerHub({"a": 10}), pool, tracker, Counter(), None, 50, smallest_group=4)
    assert stall.cause(0) == "rollouts"
    pool.set_cap(pool.servers[0], 6)
    assert pool.take(4) is not None  # 4 in flight: another group of 4 does not fit under 6
    assert stall.cause(0) == f"room under the servers' caps ([scheduler.concurrency]: {pool.servers[0].url} at its " \
                             "cap of 6)"


@virtual_time
async def test_the_poller_reads_every_poll_s_and_a_read_without_an_answer_ends_at_poll_s() -> None:
    """On a virtual clock, with the default poll_s: a server whose /metrics never answers holds a poll for poll_s at
    most (its cap unchanged), and the other server's cap still follows its cache at every poll."""
    fakes, pool, cancels = setup(2)
    cfg = ConcurrencyConfig(adaptive=True, start_per_server=8)
    ctl = ConcurrencyControl(cfg, pool, 32, 1, lambda server, n: cancels.append((server.url, n)))
    fakes[0].metrics_text = fakes[1].metrics_text = metrics(0.3)
    fakes[0].hang_paths.add("/metrics")
    pool.servers[0].inflight = pool.servers[1].inflight = 8
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def reads() -> int:
        return sum(c[1] == "/metrics" for c in fakes[1].calls)

    async def read(n: int) -> None:
        await wait_until(lambda: reads() >= n, 60, f"poll {n}", poll_s=0.001)  # virtual seconds: a hang guard

    async with asyncio.TaskGroup() as tg:
        polling = tg.create_task(ctl.run())
        for turnover in range(1, 4):  # a turnover on each server before each poll: a binding cap may grow each time
            ctl.done(pool.servers[0], 16)
            ctl.done(pool.servers[1], 16)
            await read(turnover)
            pool.servers[1].inflight = pool.servers[1].cap or 0
        polling.cancel()
    assert reads() == 3
    # the first poll is at once; the hung read holds each poll poll_s, then poll_s of sleep: the third at 4 x poll_s
    assert loop.time() - t0 == pytest.approx(4 * cfg.poll_s, abs=0.01)
    assert pool.servers[0].cap == 8  # no answer: nothing to decide on
    assert pool.servers[1].cap is not None
    assert pool.servers[1].cap > 8  # it grew
    assert cancels == []
    fakes[0].release()
