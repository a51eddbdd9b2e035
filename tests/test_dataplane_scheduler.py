"""Direct mode in the scheduler: every rollout it drops while its columns sit in a worker's pool is released to
that worker, and rollouts whose pool is gone do not train (FakeWorkerHub with ``pool``: records carry spans)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from orchestrator.config import JobConfig, load_config
from orchestrator.engines import job_scheduler
from orchestrator.inference.pool import InferencePool
from orchestrator.rollouts.groups import Group
from orchestrator.rollouts.scheduler import Scheduler
from orchestrator.testing.procs import wait_until
from orchestrator.testing.workers import FakeWorkerHub, Outcome

WAIT_S = 30.0  # a hang guard: every wait below ends on an event


def config(tmp_path: Path, scheduler: str = "batch_size = 8\nmax_inflight = 8", envs: str = "",
           pipeline: str = "gates = []") -> JobConfig:
    envs = envs or '[[env]]\nname = "a"\ntaskset = "x"\ngroup_size = 4\n'
    path = tmp_path / "job.toml"
    path.write_text(f'[inference]\nservers = ["http://127.0.0.1:9/v1"]\n[scheduler]\n{scheduler}\n'
                    f'[pipeline]\n{pipeline}\n{envs}')
    return load_config(path)


@contextlib.asynccontextmanager
async def running(cfg: JobConfig, outcome: Callable[[str, str], Outcome] = lambda e, r: 1.0
                  ) -> AsyncIterator[tuple[Scheduler, FakeWorkerHub]]:
    hub = FakeWorkerHub({e.label: 50 for e in cfg.env}, outcome, pool="pool-1")
    async with InferencePool.open(cfg.inference) as pool, asyncio.TaskGroup() as tg:
        sched = job_scheduler(cfg, pool, hub)
        task = tg.create_task(sched.run())
        try:
            yield sched, hub
        finally:
            task.cancel()
            hub.close()


def trained(groups: list[Group]) -> set[str]:
    return {r.rid for g in groups for r in g.survivors}


async def test_a_dropped_groups_survivors_are_released_and_taken_ones_are_not(tmp_path: Path) -> None:
    envs = '[[env]]\nname = "a"\ntaskset = "x"\ngroup_size = 4\ngroup_scoring = true\n'
    async with running(config(tmp_path, envs=envs), lambda e, rid: "env_error: x" if rid == "g1-2" else 1.0) as (
            sched, hub):
        groups = await asyncio.wait_for(sched.next_step(0), WAIT_S)
    assert {"g1-0", "g1-1", "g1-3"} <= set(hub.released)  # g1 was dropped: its survivors' spans are free
    assert "g1-2" not in hub.released  # failed: it has no span
    assert trained(groups).isdisjoint(hub.released)  # the step's rollouts are the step's to release


async def test_gate_rejected_groups_are_released(tmp_path: Path) -> None:
    def outcome(env: str, rid: str) -> Outcome:  # g1: equal rewards, no signal; the rest varied
        return 0.3 if rid.startswith("g1-") else float(int(rid.rsplit("-", 1)[1]) % 2)

    async with running(config(tmp_path, pipeline=""), outcome) as (sched, hub):  # default gate: zero_advantage
        groups = await asyncio.wait_for(sched.next_step(0), WAIT_S)
    assert {f"g1-{i}" for i in range(4)} <= set(hub.released)
    assert trained(groups).isdisjoint(hub.released)


async def test_stale_groups_are_released(tmp_path: Path) -> None:
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 8\nmax_async_level = 1\nmax_off_policy_steps = 5")
    async with running(cfg) as (sched, hub):
        first = await asyncio.wait_for(sched.next_step(0), WAIT_S)
        await sched.set_policy(2)
        groups = await asyncio.wait_for(sched.next_step(3), WAIT_S)  # groups of policy 0 are discarded
        counts = sched.take_counts()
    assert counts["stale_rollouts"] > 0
    assert len(hub.released) == counts["stale_rollouts"]  # each discarded survivor, once
    assert trained(first + groups).isdisjoint(hub.released)


async def test_a_gone_pool_fails_its_buffered_rollouts_and_the_step_fills_from_new_ones(tmp_path: Path) -> None:
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 8\nmax_buffered_rollouts = 16")
    async with running(cfg) as (sched, hub):
        await wait_until(lambda: sched.buffered >= 8, WAIT_S, "a buffer of a step's rollouts")
        hub.pool_gone("exited with status -9")
        hub.pool = "pool-2"  # the restarted worker's new pool
        await wait_until(lambda: sched.counts["columns_lost"] >= 8, WAIT_S, "the buffered rollouts failed")
        groups = await asyncio.wait_for(sched.next_step(0), WAIT_S)
        dropped = sched.take_dropped()
    spans = [r.header.span for g in groups for r in g.survivors]
    assert len(spans) >= 8
    assert all(s is not None and s.pool == "pool-2" for s in spans)
    assert all(not r.ok for g in dropped for r in g.records)  # every buffered group lost all: dropped, rows kept
    assert all(r.header.failure == "worker_died" for g in dropped for r in g.records)
    assert not hub.released  # nothing of a gone pool is released: the pool went with everything in it


async def test_a_gone_pool_takes_its_rollouts_back_out_of_the_step_being_taken(tmp_path: Path) -> None:
    """Step 0 has taken a group whose columns are in pool-1 and waits for another when that worker dies: the
    taken group's rollouts fail (it is dropped, its rows kept) and the step fills from the new pool's groups
    instead of training short."""
    order: list[str] = []

    def outcome(env: str, rid: str) -> Outcome:  # the second group hangs until its worker is lost
        group = rid.rsplit("-", 1)[0]
        if group not in order:
            order.append(group)
        return None if order.index(group) == 1 else 1.0

    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 4")  # one group at a time
    async with running(cfg, outcome) as (sched, hub):
        taking = asyncio.create_task(sched.next_step(0))
        try:
            # the second group is assigned once the first is back; the first is the step's once not buffered
            await wait_until(lambda: len(hub.assigned) >= 2 and not sched.done, WAIT_S,
                             "step 0 holding the first group, the second in flight")
            assert not taking.done()
            first = set(hub.assigned[0].rids)
            hub.pool_gone("exited with status -9")
            hub.lose(list(hub.assigned[1].rids), "exited with status -9")
            hub.pool = "pool-2"  # the restarted worker's new pool
            groups = await asyncio.wait_for(taking, WAIT_S)
        finally:
            taking.cancel()
        dropped = sched.take_dropped()
    spans = [r.header.span for g in groups for r in g.survivors]
    assert len(spans) == 8
    assert all(s is not None and s.pool == "pool-2" for s in spans)
    lost = [r for g in dropped for r in g.records if r.rid in first]
    assert len(lost) == 4  # the first group: dropped, its rows written with the step's
    assert all(r.header.failure == "worker_died" for r in lost)
    assert all(r.header.error == "env worker fake: exited with status -9" for r in lost)
    assert sched.counts["columns_lost"] == 4
    assert first.isdisjoint(hub.released)  # nothing of a gone pool is released


async def test_a_lost_steps_refill_goes_first_and_opens_groups_for_its_own_policy_bound(tmp_path: Path) -> None:
    """Step 0 was taken and its columns lost (the trainer could not map its pool); step 2 is being taken and
    needs policy >= 1, which the trainer cannot make before it has step 0. The refill of step 0 must open groups
    of policy 0 anyway, and step 2 must take none of them meanwhile (it would discard them as stale)."""
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 8\nmax_async_level = 1\nmax_off_policy_steps = 5")
    async with running(cfg) as (sched, hub):
        first = await asyncio.wait_for(sched.next_step(0), WAIT_S)
        later = asyncio.create_task(sched.next_step(2))
        await asyncio.sleep(0)  # a yield, not a wait: step 2 starts taking (and discards what is buffered: stale)
        sched.take_counts()  # from here on: what the refill, and step 2 meanwhile, do
        step0 = trained(first)
        try:
            kept, dropped, lost = sched.lose_taken(first, {("fake", "pool-1")}, "the trainer could not map it")
            hub.pool = "pool-2"  # what the refill takes is in another pool
            async with asyncio.timeout(WAIT_S):  # not wait_for: its task would let step 2 run first
                refilled = await sched.refill(0, kept)
            assert not later.done()  # it waits for policy 1, and took nothing while the refill ran
            counts = sched.take_counts()
            await sched.set_policy(1)
            after = await asyncio.wait_for(later, WAIT_S)
        finally:
            later.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await later
    assert kept == []  # every rollout of step 0 was in the lost pool: both groups dropped
    assert len(dropped) == len(first)
    assert {r.rid for r in lost} == step0  # as they were, spans included, for the caller to release
    assert all(r.header.span is not None and r.header.span.pool == "pool-1" for r in lost)
    assert counts["columns_lost"] == 8
    assert counts.get("stale_rollouts", 0) == 0  # step 2 discarded nothing the refill needed
    assert sum(len(g.survivors) for g in refilled) >= 8
    assert all(g.policy == 0 for g in refilled)
    assert trained(refilled).isdisjoint(trained(after))
    assert all(g.policy >= 1 for g in after)
