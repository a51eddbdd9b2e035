"""The scheduler's synchronous parts, each on its own: task sampling, the curriculum, gates, eval metrics."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from orchestrator.errors import ConfigError
from orchestrator.rollouts.curriculum import IN_FLIGHT, UNSEEN, Curriculum, CurriculumConfig, PoolConfig
from orchestrator.rollouts.evaluation import metrics, pass_at_k, pass_hat_k
from orchestrator.rollouts.sampler import EnvDraws, TaskOrder, TaskSampler
from orchestrator.scoring.advantage import AdvantageFn
from orchestrator.scoring.config import PipelineConfig
from orchestrator.scoring.gates import GateConfig, Gates, GroupView, build_gate

# ------------------------------------------------------------------------------------------------ sampling


def test_task_order_walks_every_task_once_per_epoch_and_reshuffles() -> None:
    order = TaskOrder(5, (1, 0))
    epochs = [[order.take() for _ in range(5)] for _ in range(4)]
    assert all(sorted(e) == list(range(5)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # 4 epochs of 120 orders: all equal only by a (seeded) accident


@pytest.mark.parametrize("cursor", [0, 3, 5, 12])
def test_task_order_restored_from_its_cursor_continues_the_same_sequence(cursor: int) -> None:
    a = TaskOrder(5, (9, 1))
    for _ in range(cursor):
        a.take()
    b = TaskOrder(5, (9, 1), cursor)
    assert [b.take() for _ in range(17)] == [a.take() for _ in range(17)]


def test_sampler_state_taken_mid_run_redraws_exactly_with_a_curriculum() -> None:
    envs = [EnvDraws("a", 6, 1.0), EnvDraws("b", 9, 3.0, CurriculumConfig())]
    one = TaskSampler(envs, seed=5)
    for i in range(14):
        d = one.take()
        if i % 3 == 0:  # some groups completed, others still in flight
            one.record(d.env, d.task, (i % 4) / 4)
    two = TaskSampler(envs, seed=5, state=one.state())
    # ``one``'s in-flight tasks are still in flight; in ``two`` they died with the run and are drawable again,
    # so compare against a sampler whose in-flight tasks were returned the same way
    three = TaskSampler(envs, seed=5, state=one.state())
    assert [two.take() for _ in range(30)] == [three.take() for _ in range(30)]
    assert two.draws == three.draws == 44


def test_sampler_without_curriculum_continues_exactly_as_the_uninterrupted_run() -> None:
    envs = [EnvDraws("a", 4, 1.0), EnvDraws("b", 7, 1.0)]
    run = TaskSampler(envs, seed=11)
    straight = [run.take() for _ in range(40)]
    first = TaskSampler(envs, seed=11)
    head = [first.take() for _ in range(13)]
    resumed = TaskSampler(envs, seed=11, state=first.state())
    assert head + [resumed.take() for _ in range(27)] == straight


def test_mixing_follows_the_weights() -> None:
    sampler = TaskSampler([EnvDraws("a", 3, 1.0), EnvDraws("b", 3, 3.0)], seed=0)
    counts = Counter(sampler.take().env for _ in range(4000))
    assert 0.7 < counts["b"] / 4000 < 0.8


# ---------------------------------------------------------------------------------------------- curriculum

POOLS = (PoolConfig(name="hard", max_pass_rate=0.25, weight=1.0),
         PoolConfig(name="normal", max_pass_rate=0.75, weight=1.0),
         PoolConfig(name="easy", max_pass_rate=1.0, weight=0.0))


def test_tasks_move_between_pools_as_they_are_learned() -> None:
    cur = Curriculum(CurriculumConfig(pools=POOLS, window=2), tasks=4, seed=(0,))
    drawn = [cur.take()[0] for _ in range(4)]
    assert sorted(drawn) == [0, 1, 2, 3]  # every task unseen once, in a shuffled order
    assert cur.take_metrics()["pool_sizes"] == {UNSEEN: 0, IN_FLIGHT: 4, "hard": 0, "normal": 0, "easy": 0}
    for task in range(4):
        cur.record(task, 0.0)
    assert cur.take_metrics()["pool_sizes"]["hard"] == 4
    cur.record(2, 1.0)  # window 2: mean of 0.0 and 1.0 = 0.5 -> normal
    cur.record(3, 1.0)
    cur.record(3, 1.0)  # mean of the last two = 1.0 -> easy
    sizes = cur.take_metrics()["pool_sizes"]
    assert (sizes["hard"], sizes["normal"], sizes["easy"]) == (2, 1, 1)
    drawn_pools = Counter(cur.take()[1] for _ in range(3))
    assert drawn_pools["easy"] == 0  # weight 0: never drawn while other pools have tasks


def test_curriculum_draws_each_pool_by_its_weight() -> None:
    pools = (PoolConfig(name="hard", max_pass_rate=0.5, weight=1.0), PoolConfig(name="easy", max_pass_rate=1.0,
                                                                                  weight=4.0))
    cur = Curriculum(CurriculumConfig(pools=pools), tasks=20, seed=(3,))
    for task in [cur.take()[0] for _ in range(20)]:  # every task in flight, then every group completes
        cur.record(task, 0.0 if task < 10 else 1.0)
    assert cur.take_metrics()["pool_sizes"] == {UNSEEN: 0, IN_FLIGHT: 0, "hard": 10, "easy": 10}
    pools_drawn: Counter[str] = Counter()
    for _ in range(2000):
        task, pool = cur.take()
        pools_drawn[pool] += 1
        cur.record(task, 0.0 if task < 10 else 1.0)
    assert 0.75 < pools_drawn["easy"] / 2000 < 0.85


def test_curriculum_state_returns_in_flight_tasks_and_redraws_the_same() -> None:
    cfg = CurriculumConfig(pools=POOLS)
    cur = Curriculum(cfg, tasks=6, seed=(2,))
    for _ in range(4):
        cur.take()
    cur.record(next(iter(sorted(cur.in_flight))), 0.5)
    state = cur.state()
    back = Curriculum(cfg, tasks=6, seed=(2,), state=state)
    assert back.in_flight == set()  # groups in flight died with the run ...
    assert sorted(back.returned) == sorted(state["in_flight"])  # ... their tasks are drawn again, first
    again = Curriculum(cfg, tasks=6, seed=(2,), state=state)
    assert [back.take() for _ in range(10)] == [again.take() for _ in range(10)]


@pytest.mark.parametrize(("pools", "why"), [
    ((PoolConfig(name="a", max_pass_rate=0.5, weight=1.0),), "the last must be 1.0"),
    ((PoolConfig(name="a", max_pass_rate=0.8, weight=1.0), PoolConfig(name="b", max_pass_rate=0.2, weight=1.0)),
     "increase strictly"),
    ((PoolConfig(name=UNSEEN, max_pass_rate=1.0, weight=1.0),), "names must be distinct"),
])
def test_bad_pools_are_named(pools: tuple[PoolConfig, ...], why: str) -> None:
    problems = list(CurriculumConfig(pools=pools).problems("env[0].curriculum", lambda key: "job.toml"))
    assert any(why in p and p.startswith("job.toml: env[0].curriculum") for p in problems), problems


# --------------------------------------------------------------------------------------------------- gates


def view(rewards: list[float], advantages: list[float] | None = None, env: str = "a") -> GroupView:
    if advantages is None:
        records = [SimpleNamespace(reward=r) for r in rewards]
        advantages = AdvantageFn(PipelineConfig())(records).tolist()
    return GroupView(env, 0, 0, rewards, advantages)


def test_zero_advantage_gate_rejects_equal_non_binary_rewards_whose_advantages_are_not_exactly_zero() -> None:
    equal = view([0.1, 0.1, 0.1])
    assert equal.advantages != [0.0, 0.0, 0.0]  # float rounding: about 1e-17, the case `adv == 0.0` missed
    assert max(abs(a) for a in equal.advantages) < 1e-12
    gates = Gates([GateConfig(name="zero_advantage")])
    assert gates(equal) == "zero_advantage"
    assert gates(view([0.0, 1.0, 1.0])) is None
    assert gates.take_counts() == {"zero_advantage": {"a": 1}}
    assert gates.take_counts() == {}


def test_zero_advantage_spares_the_groups_of_envs_that_distil() -> None:
    """A distilling env's group trains on the teacher's term whatever its rewards: no gate of zero advantage."""
    gates = Gates([GateConfig(name="zero_advantage"), GateConfig(name="reward_range", args={"max": 0.5})],
                  distilling=["opd"])
    assert gates(view([0.0, 0.0, 0.0], env="opd")) is None
    assert gates(view([1.0, 1.0, 1.0], env="opd")) == "reward_range"  # only zero_advantage spares it
    assert gates(view([0.0, 0.0, 0.0], env="a")) == "zero_advantage"


def test_range_gates_and_env_scoping() -> None:
    gates = Gates([GateConfig(name="reward_range", args={"min": 0.2, "max": 0.8}, envs=("a",)),
                   GateConfig(name="advantage_range", args={"min": -0.1, "max": 0.1})])
    assert gates(view([1.0, 1.0, 0.0])) is None  # mean 0.67
    assert gates(view([1.0, 1.0, 1.0, 0.0])) is None  # mean 0.75
    assert gates(view([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])) == "reward_range"  # mean 0.83
    assert gates(view([1.0, 1.0, 1.0, 1.0, 1.0, 0.0], env="b")) is None  # reward_range is a's only
    assert gates(view([0.5, 0.5], [0.05, -0.05])) == "advantage_range"


def keep_even_tasks(group: GroupView, modulus: int) -> bool:
    return group.task % modulus == 0


def test_module_function_gate_gets_its_args() -> None:
    gates = Gates([GateConfig(name=f"{__name__}:keep_even_tasks", args={"modulus": 2})])
    assert gates(GroupView("a", 4, 0, [1.0], [0.5])) is None
    assert gates(GroupView("a", 3, 0, [1.0], [0.5])) == f"{__name__}:keep_even_tasks"


@pytest.mark.parametrize(("cfg", "why"), [
    (GateConfig(name="zero_advantage", args={"tol": 1}), "unexpected arguments ['tol']"),
    (GateConfig(name="reward_range", args={"min": 1, "max": 0}), "min 1.0 > max 0.0"),
    (GateConfig(name="no_such_module_xyz:gate"), "no_such_module_xyz"),
])
def test_bad_gates_name_their_key(cfg: GateConfig, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_gate(cfg, "pipeline.gates[1]")
    assert any(p.startswith("pipeline.gates[1]") and why in p for p in e.value.problems), e.value.problems


# --------------------------------------------------------------------------------------------- eval metrics


@pytest.mark.parametrize(("n", "c", "k", "at", "hat"), [
    (4, 0, 1, 0.0, 0.0), (4, 1, 1, 0.25, 0.25), (4, 1, 2, 0.5, 0.0), (4, 3, 2, 1.0, 0.5),
    (4, 2, 2, 5 / 6, 1 / 6), (4, 4, 4, 1.0, 1.0), (4, 3, 4, 1.0, 0.0), (8, 1, 4, 0.5, 0.0),
])
def test_pass_at_k_and_pass_hat_k_by_hand(n: int, c: int, k: int, at: float, hat: float) -> None:
    # e.g. n=4, c=2, k=2: pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6; pass^2 = C(2,2)/C(4,2) = 1/6
    assert pass_at_k(n, c, k) == pytest.approx(at)
    assert pass_hat_k(n, c, k) == pytest.approx(hat)


def group(rewards: list[float | None], tokens: int = 3) -> Any:
    """A completed group as metrics() reads it (None: a failed rollout)."""
    records = [SimpleNamespace(reward=r, tokens=tokens) for r in rewards]
    return SimpleNamespace(records=records, survivors=[r for r in records if r.reward is not None])


def test_eval_metrics_of_hand_worked_groups() -> None:
    groups = [group([1.0, 0.0, 0.0, 0.0]), group([1.0, 1.0, 1.0, 1.0]), group([0.0, 0.0, None, 0.0])]
    m = metrics(groups, 4, threshold=0.5, wall_s=2.0)
    # passes per task: 1, 4, 0 of n = 4 (the failed rollout does not pass)
    assert m["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert m["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert m["pass@4"] == pytest.approx((1 + 1 + 0) / 3)
    assert m["pass^2"] == pytest.approx((0 + 1 + 0) / 3)
    assert m["pass^4"] == pytest.approx(1 / 3)
    assert m["avg@4"] == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    assert m["mean_reward"] == pytest.approx(5 / 11)
    assert (m["solve_none"], m["solve_all"]) == (pytest.approx(1 / 3), pytest.approx(1 / 3))
    assert (m["examples"], m["rollouts"], m["errors"], m["tokens"]) == (3, 12, 1, 33)
    assert "pass@8" not in m


def test_advantages_fn_is_what_gates_see() -> None:
    records = [SimpleNamespace(reward=r) for r in (0.0, 1.0)]
    assert np.allclose(AdvantageFn(PipelineConfig())(records), [-0.5, 0.5])
