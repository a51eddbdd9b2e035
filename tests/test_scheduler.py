from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import JobConfig, load_config
from orchestrator.engines import job_scheduler
from orchestrator.inference.pool import InferencePool
from orchestrator.rollouts.scheduler import EVAL_PREFIX, CheckpointSource, Scheduler, SchedulingError
from orchestrator.testing.clock import virtual_time
from orchestrator.testing.procs import wait_until
from orchestrator.testing.workers import FakeWorkerHub, Outcome


def config(tmp_path: Path, scheduler: str = "batch_size = 8\nmax_inflight = 8", envs: str | None = None,
           pipeline: str = "gates = []", stall_warn_s: float = 30.0) -> JobConfig:
    """A job config; no gates unless ``pipeline`` names some (the fake worker's rewards are all equal)."""
    envs = envs or '[[env]]\nname = "a"\ntaskset = "x"\ngroup_size = 4\n'
    path = tmp_path / "job.toml"
    path.write_text(f'[inference]\nservers = ["http://127.0.0.1:9/v1"]\n[scheduler]\n{scheduler}\n'
                    f'[pipeline]\n{pipeline}\n[monitor]\nstall_warn_s = {stall_warn_s}\n{envs}')
    return load_config(path)


@contextlib.asynccontextmanager
async def running(cfg: JobConfig, outcome: Callable[[str, str], Outcome] = lambda e, r: 1.0,
                  delay_s: float = 0.0, policy: int = 0, checkpoints: CheckpointSource | None = None
                  ) -> AsyncIterator[tuple[Scheduler, FakeWorkerHub]]:
    evals = cfg.eval.env if cfg.eval is not None else ()
    hub = FakeWorkerHub({**{e.label: 50 for e in cfg.env}, **{EVAL_PREFIX + e.label: 50 for e in evals}}, outcome,
                        delay_s)
    async with InferencePool.open(cfg.inference) as pool, asyncio.TaskGroup() as tg:
        sched = job_scheduler(cfg, pool, hub, policy, checkpoints=checkpoints)
        task = tg.create_task(sched.run())
        try:
            yield sched, hub
        finally:
            task.cancel()
            hub.close()


async def test_whole_groups_fill_a_step(tmp_path: Path) -> None:
    async with running(config(tmp_path)) as (sched, hub):
        groups = await asyncio.wait_for(sched.next_step(0), 5)
    assert sum(len(g.survivors) for g in groups) == 8
    assert all(g.size == 4 for g in groups)
    assert hub.assigned[0].server == "http://127.0.0.1:9/v1"


async def test_partial_group_trains_its_survivors(tmp_path: Path) -> None:
    async with running(config(tmp_path), lambda e, rid: "env_error: bad" if rid.endswith("-0") else 0.5) as (sched, _):
        groups = await asyncio.wait_for(sched.next_step(0), 5)
        counts = sched.take_counts()
    assert all(len(g.survivors) == 3 for g in groups)
    assert all(len(g.records) == 4 for g in groups)
    assert counts["failed:env_error"] >= len(groups)  # groups that finished after the step count too


async def test_all_failed_group_is_dropped_and_counted_and_its_line_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def outcome(env: str, rid: str) -> Outcome:
        return "env_error: broken" if rid.startswith("g1-") else 1.0

    async with running(config(tmp_path), outcome) as (sched, _):
        groups = await asyncio.wait_for(sched.next_step(0), 5)
        counts = sched.take_counts()
    assert "g1" not in [g.gid for g in groups]
    assert counts["dropped_groups"] == 1
    assert "group g1 (a) dropped: 4 of 4 rollouts failed: env_error x4 (broken)" in caplog.messages


async def test_dropped_groups_wait_for_the_next_step_to_write_their_rows(tmp_path: Path) -> None:
    def outcome(env: str, rid: str) -> Outcome:
        return "env_error: broken" if rid.startswith("g1-") else 1.0

    async with running(config(tmp_path), outcome) as (sched, _):
        groups = await asyncio.wait_for(sched.next_step(0), 5)  # g1's records came before the step filled
        dropped = sched.take_dropped()
        assert sched.take_dropped() == []  # taken once
    assert "g1" not in [g.gid for g in groups]
    assert [g.gid for g in dropped] == ["g1"]
    assert len(dropped[0].records) == 4
    assert not dropped[0].survivors


async def test_dropped_groups_kept_for_rows_are_bounded(tmp_path: Path) -> None:
    """Every group fails, so no step ever fills: only the newest max_buffered_rollouts rollouts' worth of
    dropped groups wait for a step, the rest are counted as unwritten."""
    cfg = config(tmp_path, scheduler="batch_size = 4\nmax_inflight = 4\nmax_buffered_rollouts = 8")
    async with running(cfg, lambda e, r: "env_error: broken") as (sched, _):
        await wait_until(lambda: sched.counts["dropped_rows_unwritten"] >= 8, 5, "dropped groups beyond the bound")
        kept = sched.take_dropped()
        counts = sched.take_counts()
    assert 1 <= len(kept) <= 2
    assert sum(len(g.records) for g in kept) <= 8
    assert counts["dropped_groups"] * 4 >= counts["dropped_rows_unwritten"] + 4 * len(kept)
    assert [int(g.gid[1:]) for g in kept] == sorted(int(g.gid[1:]) for g in kept)  # the newest, in order


async def test_group_scoring_env_drops_on_any_failure(tmp_path: Path) -> None:
    envs = '[[env]]\nname = "a"\ntaskset = "x"\ngroup_size = 4\ngroup_scoring = true\n'

    def outcome(env: str, rid: str) -> Outcome:
        return "env_error: x" if rid == "g1-2" else 1.0

    async with running(config(tmp_path, envs=envs), outcome) as (sched, _):
        groups = await asyncio.wait_for(sched.next_step(0), 5)
        counts = sched.take_counts()
    assert "g1" not in [g.gid for g in groups]
    assert counts["dropped_groups"] == 1


async def test_async_level_discards_groups_sampled_too_long_ago(tmp_path: Path) -> None:
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 8\nmax_async_level = 1\nmax_off_policy_steps = 5")
    async with running(cfg) as (sched, _):
        await asyncio.wait_for(sched.next_step(0), 5)  # groups sampled with policy 0
        await sched.set_policy(2)
        groups = await asyncio.wait_for(sched.next_step(3), 5)  # needs policy >= 2
        counts = sched.take_counts()
    assert all(g.policy >= 2 for g in groups)
    assert counts["stale_rollouts"] > 0


async def test_boundary_of_async_level_is_inclusive(tmp_path: Path) -> None:
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 8\nmax_async_level = 2\nmax_off_policy_steps = 5")
    async with running(cfg, policy=1) as (sched, _):
        groups = await asyncio.wait_for(sched.next_step(3), 5)  # policy 1 == 3 - 2: accepted
        counts = sched.take_counts()
    assert {g.policy for g in groups} == {1}
    assert counts.get("stale_rollouts", 0) == 0


async def test_stale_in_flight_groups_are_cancelled(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 8\nmax_async_level = 0\nmax_off_policy_steps = 1")
    async with running(cfg, lambda e, r: None) as (sched, hub):  # nothing ever returns
        await wait_until(lambda: sched.inflight_rollouts == 8, 10, "8 rollouts in flight", poll_s=0.01)
        await sched.set_policy(2)  # 0 < 2 - 1: every in-flight group is too old
        counts = sched.take_counts()
    assert counts["cancelled"] == 8
    assert sorted(hub.cancelled) == ["g1", "g2"]
    # the 200-step demo: every dropped group's line said "4 of 4 rollouts failed", none said stale
    assert "group g1 (a) dropped: 4 of 4 rollouts failed: stale x4 (sampled with policy 0, now 2)" in caplog.messages


async def test_no_group_opens_that_no_step_could_take(tmp_path: Path) -> None:
    """On-policy: one batch of groups per policy, though there is room for more; the next batch opens with the
    next weights, so nothing is sampled to be thrown away as stale."""
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 32\nmax_async_level = 0\nmax_off_policy_steps = 0")
    async with running(cfg) as (sched, hub):
        await asyncio.wait_for(sched.next_step(0), 5)
        for _ in range(50):
            await asyncio.sleep(0)  # admission runs: room for 24 rollouts, but step 1 needs policy 1
        assert [a.policy_step for a in hub.assigned] == [0, 0]
        await sched.set_policy(1)
        await wait_until(lambda: len(hub.assigned) == 4, 10, "the batch of policy 1", poll_s=0.01)
        groups = await asyncio.wait_for(sched.next_step(1), 5)
        counts = sched.take_counts()
    assert {g.policy for g in groups} == {1}
    assert [a.policy_step for a in hub.assigned] == [0, 0, 1, 1]
    assert counts.get("stale_rollouts", 0) == counts.get("cancelled", 0) == 0


async def test_async_level_lets_one_batch_ahead_open(tmp_path: Path) -> None:
    """max_async_level = 1: groups sampled with policy 0 can still train in step 1, so two batches open."""
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 32\nmax_async_level = 1\nmax_off_policy_steps = 1")
    async with running(cfg) as (_, hub):
        await wait_until(lambda: len(hub.assigned) == 4, 10, "two batches", poll_s=0.01)
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(hub.assigned) == 4


class AskedCheckpoints:
    """A CheckpointSource that records what it was asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def checkpoint_wanted(self, policy: int) -> str:
        self.asked.append(policy)
        return "the trainer was asked"


@virtual_time
async def test_a_step_waiting_for_weights_opens_no_group_asks_for_them_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Step 3 takes policy >= 2 (max_async_level 1) and the servers have 0: every group opened now would be
    discarded as stale, and the step would wait in silence while the workers spin (issue #21, item 1). On a
    virtual clock, with the default bound: a line every 30 s."""
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 8\nmax_async_level = 1")
    source = AskedCheckpoints()
    loop = asyncio.get_running_loop()

    def stalls() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 3 has 0 of 8")]

    async with running(cfg, delay_s=0.01, checkpoints=source) as (sched, hub):
        await asyncio.wait_for(sched.next_step(0), 10)
        step3 = asyncio.ensure_future(sched.next_step(3))
        asked_at = loop.time()
        await wait_until(lambda: len(stalls()) >= 1, 100, "a first stall line", poll_s=0.01)
        assert loop.time() - asked_at == pytest.approx(cfg.monitor.stall_warn_s, abs=0.05)
        opened = len(hub.assigned)
        await wait_until(lambda: len(stalls()) >= 2, 100, "a second stall line", poll_s=0.01)
        assert loop.time() - asked_at == pytest.approx(2 * cfg.monitor.stall_warn_s, abs=0.05)
        assert len(hub.assigned) == opened  # nothing opened between the two lines: training groups wait
        assert not step3.done()
        await sched.set_policy(2)  # the checkpoint arrives
        groups = await asyncio.wait_for(step3, 10)
    assert {g.policy for g in groups} == {2}
    assert source.asked[0] == 2  # asked at once, then with every line
    assert len(source.asked) >= 3
    assert "without progress: waits for a checkpoint of policy >= 2 (the servers have policy 0; no training " \
           "group opens until then): the trainer was asked" in stalls()[0]


@virtual_time
async def test_group_timeout_fails_missing_rollouts(tmp_path: Path) -> None:
    cfg = config(tmp_path, "batch_size = 4\nmax_inflight = 4")  # group_timeout_s: 600 s by default

    def outcome(env: str, rid: str) -> Outcome:
        return None if rid == "g1-3" else 1.0  # one rollout hangs

    loop = asyncio.get_running_loop()
    async with running(cfg, outcome) as (sched, _):
        t0 = loop.time()
        groups = await asyncio.wait_for(sched.next_step(0), 3600)
        assert cfg.scheduler.group_timeout_s <= loop.time() - t0 < cfg.scheduler.group_timeout_s + 5
        counts = sched.take_counts()
    assert groups[0].gid == "g1"
    assert len(groups[0].survivors) == 3
    assert counts["failed:group_timeout"] == 1


async def test_buffer_bound_pauses_generation(tmp_path: Path) -> None:
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 16\nmax_buffered_rollouts = 12")
    async with running(cfg) as (sched, hub):
        # nobody takes a step: the buffer fills up to the bound and admission stops there
        await wait_until(lambda: sched.buffered == 12, 10, "a full buffer", poll_s=0.01)
        assert len(hub.assigned) == 3
        assert not sched.admission.room(4)
        await asyncio.wait_for(sched.next_step(0), 5)
        await wait_until(lambda: len(hub.assigned) > 3, 10, "taking a step made room", poll_s=0.01)


async def test_mixing_ratio_follows_weights(tmp_path: Path) -> None:
    envs = ('[[env]]\nname = "a"\ntaskset = "x"\ngroup_size = 2\nweight = 3.0\n'
            '[[env]]\nname = "b"\ntaskset = "x"\ngroup_size = 2\nweight = 1.0\n')
    cfg = config(tmp_path, "batch_size = 40\nmax_inflight = 8", envs)
    async with running(cfg) as (sched, hub):
        for step in range(10):
            await sched.set_policy(step)  # as weight sync after each trainer step would
            await asyncio.wait_for(sched.next_step(step), 5)
        share = Counter(m.env for m in hub.assigned)
    ratio = share["a"] / (share["a"] + share["b"])
    assert 0.65 <= ratio <= 0.85, share


async def test_task_order_is_deterministic_under_seed(tmp_path: Path) -> None:
    orders = []
    for _ in range(2):
        async with running(config(tmp_path)) as (sched, hub):
            await asyncio.wait_for(sched.next_step(0), 5)
            orders.append([m.task for m in hub.assigned[:2]])
    assert orders[0] == orders[1]


async def test_lost_worker_fails_its_rollouts(tmp_path: Path) -> None:
    async with running(config(tmp_path, "batch_size = 4\nmax_inflight = 4"), lambda e, r: None) as (sched, hub):
        await wait_until(lambda: sched.inflight_rollouts == 4, 10, "4 rollouts in flight", poll_s=0.01)
        hub.lose(["g1-0", "g1-1", "g1-2", "g1-3"])
        await wait_until(lambda: "g1" not in sched.inflight, 10, "the lost rollouts failed", poll_s=0.01)
        counts: dict[str, Any] = sched.take_counts()
    assert counts["failed:worker_died"] == 4
    assert counts["dropped_groups"] == 1


@pytest.mark.parametrize("bad", ["max_inflight = 2", "max_buffered_rollouts = 4"])
def test_impossible_bounds_are_config_errors(tmp_path: Path, bad: str) -> None:
    from orchestrator.errors import ConfigError

    with pytest.raises(ConfigError):
        config(tmp_path, f"batch_size = 8\n{bad}")


async def test_provider_failures_reach_the_pool(tmp_path: Path) -> None:
    cfg = config(tmp_path, "batch_size = 4\nmax_inflight = 4")
    async with running(cfg, lambda e, r: "provider_error: refused") as (sched, _):
        pool = sched.pool
        # the first group's 4 failures evict the only server (failures_to_evict = 3): no second group opens
        await wait_until(lambda: not pool.servers[0].in_rotation and not sched.inflight, 10, "the server evicted",
                         poll_s=0.01)
    assert pool.metrics["failed:provider_error"] == 4


@virtual_time
async def test_a_step_that_cannot_fill_says_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(tmp_path)
    async with running(cfg, lambda e, r: "provider_error: down", delay_s=0.01) as (sched, _):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(3.5 * cfg.monitor.stall_warn_s):
                await sched.next_step(0)
    stalls = [r.getMessage() for r in caplog.records if "step 0 has 0 of 8" in r.getMessage()]
    assert len(stalls) == 3, [r.getMessage() for r in caplog.records]  # one per stall_warn_s, on a virtual clock
    assert "provider_error" in stalls[-1]
    assert "groups dropped" in stalls[-1]


def varied(env: str, rid: str) -> Outcome:
    """One rollout of each group gets 1, the others 0: every group has signal."""
    return 1.0 if rid.endswith("-0") else 0.0


async def test_gates_reject_groups_without_signal_and_the_step_refills(tmp_path: Path) -> None:
    def outcome(env: str, rid: str) -> Outcome:  # g1 and g3: equal non-binary rewards (advantages ~1e-17)
        return 0.3 if rid.split("-")[0] in ("g1", "g3") else varied(env, rid)

    async with running(config(tmp_path, pipeline=""), outcome) as (sched, _):  # default gates: zero_advantage
        groups = await asyncio.wait_for(sched.next_step(0), 60)
        counts = sched.take_counts()
    assert sum(len(g.survivors) for g in groups) == 8  # not a short step
    assert {g.gid for g in groups}.isdisjoint({"g1", "g3"})
    assert counts["gates"] == {"zero_advantage": {"a": 2}}
    assert counts["rejected_groups"] == 2


async def test_a_run_whose_gates_reject_everything_stops_past_the_bound(tmp_path: Path) -> None:
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 8\nmax_rejected_batches = 2", pipeline="")
    async with running(cfg, lambda e, r: 1.0) as (sched, hub):
        with pytest.raises(SchedulingError) as e:
            await asyncio.wait_for(sched.next_step(0), 60)
    assert "zero_advantage" in str(e.value)
    assert "step 0 has 0 of 8" in str(e.value)
    assert len(hub.assigned) >= 4  # 2 steps' worth of 4-rollout groups were tried before giving up


EVAL = """[eval]
interval = 2
num_examples = 3
group_size = 4
max_inflight = 4
[[eval.env]]
name = "a"
taskset = "x"
"""


async def test_evaluation_rounds_run_beside_training_at_their_steps(tmp_path: Path) -> None:
    cfg = config(tmp_path, "batch_size = 8\nmax_inflight = 12", envs='[[env]]\nname = "a"\ntaskset = "x"\n'
                 'group_size = 4\n' + EVAL)
    async with running(cfg, varied) as (sched, hub):
        rows = []
        for step in range(4):
            trained = await asyncio.wait_for(sched.next_step(step), 60)
            assert all(g.eval_round is None for g in trained)
            await sched.set_policy(step + 1)
            if step in (0, 2):
                rows.append(await asyncio.wait_for(sched.eval_rows.get(), 60))
    evals = [m for m in hub.assigned if m.env.startswith(EVAL_PREFIX)]
    assert [(m.task, m.train) for m in evals] == [(t, False) for t in (0, 1, 2)] * 2  # the first 3 tasks, twice
    assert [row["step"] for row, _ in rows] == [0, 2]
    for row, groups in rows:
        assert [len(g.records) for g in groups] == [4, 4, 4]
        m = row["envs"]["a"]  # one of 4 rollouts passes in every task
        assert (m["pass@1"], m["pass@2"], m["pass@4"], m["pass^2"]) == (0.25, 0.5, 1.0, 0.0)
    assert sched.evaluator is not None
    assert sched.evaluator.state() == {"next_step": 4, "in_progress": None}
