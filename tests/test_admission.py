"""Admission on its own: which group opens next, within max_inflight, the buffer and the off-policy window."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.config import JobConfig, load_config
from orchestrator.inference.pool import InferencePool
from orchestrator.rollouts.admission import Admission, Capacity, Opening
from orchestrator.rollouts.groups import Buffer, Group, GroupTracker
from orchestrator.rollouts.sampler import EnvDraws, TaskSampler


def config(tmp_path: Path, scheduler: str) -> JobConfig:
    path = tmp_path / "job.toml"
    path.write_text(f'[inference]\nservers = ["http://127.0.0.1:9/v1"]\n[scheduler]\n{scheduler}\n'
                    '[[env]]\nname = "a"\ntaskset = "x"\ngroup_size = 4\n')
    return load_config(path)


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[InferencePool]:
    async with InferencePool.open(config(tmp_path, "batch_size = 8").inference) as pool:
        yield pool


def admission(cfg: JobConfig, pool: InferencePool, policy: int = 0) -> Admission:
    tracker = GroupTracker(cfg.scheduler.max_off_policy_steps, cfg.scheduler.group_timeout_s)
    sampler = TaskSampler([EnvDraws(e.label, 50, e.weight) for e in cfg.env], cfg.run.seed)
    return Admission(cfg.scheduler, Capacity(cfg.scheduler.max_inflight, pool, tracker), tracker, Buffer(),
                     {e.label: e for e in cfg.env}, sampler, None, policy, policy)


async def open_next(adm: Admission) -> Opening:
    """Open the group admission says opens next, as the scheduler does."""
    opening = adm.next()
    assert opening is not None
    assert adm.sampler is not None
    draw = adm.sampler.take()
    server = adm.capacity.take(opening.size)
    assert server is not None
    adm.tracker.open(Group(f"g{draw.number + 1}", opening.env, opening.task, adm.policy, opening.size, server, 0.0))
    return opening


async def test_groups_open_whole_within_max_inflight(tmp_path: Path, pool: InferencePool) -> None:
    adm = admission(config(tmp_path, "batch_size = 64\nmax_inflight = 10"), pool)
    assert [(await open_next(adm)).size for _ in range(2)] == [4, 4]
    assert adm.next() is None  # 8 in flight: a third group of 4 does not fit under 10
    assert not adm.room(4)
    assert adm.room(2)
    assert pool.servers[0].inflight == 8  # each group holds its server until it finishes
    adm.capacity.release(pool.servers[0], 4)
    assert pool.servers[0].inflight == 4


async def test_a_full_buffer_pauses_training_groups(tmp_path: Path, pool: InferencePool) -> None:
    adm = admission(config(tmp_path, "batch_size = 8\nmax_buffered_rollouts = 8"), pool)
    await open_next(adm)
    await open_next(adm)
    assert adm.next() is None  # 8 in flight + 4 would pass the buffer's bound of 8


async def test_no_training_group_opens_for_a_step_it_cannot_join(tmp_path: Path, pool: InferencePool) -> None:
    adm = admission(config(tmp_path, "batch_size = 8\nmax_async_level = 0"), pool, policy=0)
    adm.min_policy = 1  # the step being filled takes policy >= 1; the servers have 0
    assert adm.next() is None
    adm.policy = 1
    opening = adm.next()
    assert opening is not None
    assert (opening.env, opening.size, opening.evaluation) == ("a", 4, False)


async def test_on_policy_opens_exactly_one_batch(tmp_path: Path, pool: InferencePool) -> None:
    adm = admission(config(tmp_path, "batch_size = 8\nmax_async_level = 0\nmax_inflight = 64"), pool)
    await open_next(adm)
    await open_next(adm)
    assert adm.next() is None  # the 8 in flight fill the one step they can join
    adm.refilling = 0  # a refill needs groups beyond any count of the step being filled
    assert adm.next() is not None
