"""Online evaluation: rounds of ``[eval]``, and their metrics.

A round is due at step 0 (``at_start``) and every ``interval`` steps; it starts at the beginning of that step
(or, if the round before still runs, as soon as it ends, under its own step: ``due``) with the policy in
force, and runs the first ``num_examples`` tasks of every ``[[eval.env]]``, ``group_size``
rollouts each, beside training: the scheduler opens evaluation groups first, but never more than
``eval.max_inflight`` rollouts of them at once, so training keeps the rest. With ``hold_weights`` a weight
sync waits while a round runs (``idle``), so a round is one policy version; otherwise the round records every
version that sampled it. Evaluation groups are
never trained on, never stale, and their rollouts build no training samples.

Metrics per env (``metrics(...)``): mean reward, avg@k (mean of the tasks' mean rewards), pass@k and pass^k
for k = 1, 2, 4, ... <= group size with the unbiased estimators pass@k = 1 - C(n-c, k)/C(n, k) and pass^k =
C(c, k)/C(n, k) (n rollouts of a task, c of them with a reward above ``pass_threshold``; a failed rollout
counts as not passing), the shares of tasks solved by none / all of their rollouts, failed rollouts, tokens
and wall time.

State (``state()``): the next round's step, and the step of a round in progress, which a resumed run
redoes (a round cut by a crash is run again, under the resumed policy).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import comb
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.rollouts.config import EvalConfig
    from orchestrator.rollouts.groups import Group


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k rollouts drawn from the n (c passing) passes."""
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Chance that all of k rollouts drawn from the n (c passing) pass."""
    return comb(c, k) / comb(n, k)


def ks(group_size: int) -> list[int]:
    out, k = [], 1
    while k <= group_size:
        out.append(k)
        k *= 2
    return out


def metrics(groups: list[Group], group_size: int, threshold: float, wall_s: float) -> dict[str, Any]:
    """The metrics of one env's completed groups in a round (see the module docstring)."""
    rewards = [[r.reward for r in g.survivors] for g in groups]
    passes = [sum(x > threshold for x in rs) for rs in rewards]
    n = group_size
    out: dict[str, Any] = {
        "examples": len(groups), "rollouts": sum(len(g.records) for g in groups),
        "errors": sum(len(g.records) - len(g.survivors) for g in groups),
        "tokens": sum(r.tokens for g in groups for r in g.survivors),
        "mean_reward": _mean([x for rs in rewards for x in rs]),
        f"avg@{n}": _mean([_mean(rs) if rs else 0.0 for rs in rewards]),
        "solve_none": _mean([float(c == 0) for c in passes]),
        "solve_all": _mean([float(c == n) for c in passes]),
        "wall_s": round(wall_s, 3),
    }
    for k in ks(n):
        out[f"pass@{k}"] = _mean([pass_at_k(n, c, k) for c in passes])
        out[f"pass^{k}"] = _mean([pass_hat_k(n, c, k) for c in passes])
    return out


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


@dataclass
class Round:
    step: int
    policy: int
    queue: deque[tuple[str, int]]
    started: float = field(default_factory=time.monotonic)
    open_groups: int = 0
    groups: dict[str, list[Group]] = field(default_factory=dict)
    policies: set[int] = field(default_factory=set)


class Evaluator:
    def __init__(self, cfg: EvalConfig, max_inflight: int, tasks_per_env: Mapping[str, int],
                 state: Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.cap = cfg.max_inflight or max(max_inflight // 2, 1)
        self.envs = [e.label for e in cfg.env]
        self.tasks = {name: min(cfg.num_examples, tasks_per_env[name]) for name in self.envs}
        self.sampling = {e.label: e.sampling.params() for e in cfg.env}
        self._opened = 0
        self.next_step = 0 if cfg.at_start else cfg.interval
        if state:
            redo = state.get("in_progress")
            self.next_step = int(redo) if redo is not None else int(state["next_step"])
        self.round: Round | None = None
        self.idle = asyncio.Event()  # no round running: a held weight sync may go
        self.idle.set()

    @property
    def size(self) -> int:
        return self.cfg.group_size

    def due(self, step: int) -> int | None:
        """The round to start at training step ``step``, by its step (on the ``interval`` grid): None while a
        round runs or before the next is due. A round that could not start on time (the one before still
        ran) starts late under its own step; one that fell a whole interval behind is skipped."""
        if self.round is not None or step < self.next_step:
            return None
        return self.next_step + (step - self.next_step) // self.cfg.interval * self.cfg.interval

    def maybe_start(self, step: int, policy: int) -> bool:
        """Start the round of ``step`` (if it is due and none runs); True if it started."""
        if self.round is not None or step < self.next_step:
            return False
        queue = deque((env, task) for task in range(max(self.tasks.values())) for env in self.envs
                      if task < self.tasks[env])  # round robin over envs, task by task
        self.round = Round(step, policy, queue)
        self.idle.clear()
        return True

    def next_task(self, inflight_eval_rollouts: int) -> tuple[str, int] | None:
        """The next evaluation group to open, if its rollouts fit under the cap."""
        r = self.round
        if r is None or not r.queue or inflight_eval_rollouts + self.size > self.cap:
            return None
        return r.queue[0]

    def opened(self, policy: int) -> tuple[int, str]:
        """The group ``next_task`` named opened (with ``policy``); returns the round's step and the group's id."""
        assert self.round is not None
        self.round.queue.popleft()
        self.round.open_groups += 1
        self.round.policies.add(policy)
        self._opened += 1
        return self.round.step, f"e{self.round.step}-{self._opened}"

    def completed(self, group: Group) -> tuple[dict[str, Any], list[Group]] | None:
        """Take a completed evaluation group; the round's row and groups when it was the last one."""
        r = self.round
        if r is None or group.eval_round != r.step:
            return None  # a group of a round that ended (cannot happen: a round waits for its groups)
        r.open_groups -= 1
        r.groups.setdefault(group.env, []).append(group)
        if r.queue or r.open_groups:
            return None
        wall = time.monotonic() - r.started
        row = {"eval": True, "step": r.step, "policy": r.policy, "policies": sorted(r.policies),
               "wall_s": round(wall, 3),
               "envs": {env: metrics(r.groups.get(env, []), self.size, self.cfg.pass_threshold, wall)
                        for env in self.envs}}
        self.next_step = r.step + self.cfg.interval
        self.round = None
        self.idle.set()
        return row, [g for gs in r.groups.values() for g in gs]

    def state(self) -> dict[str, Any]:
        return {"next_step": self.next_step, "in_progress": None if self.round is None else self.round.step}
