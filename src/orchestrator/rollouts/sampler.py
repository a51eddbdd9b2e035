"""What is sampled next: environment mixing and each environment's task order (or its curriculum).

``TaskSampler.peek()`` is the next (env, task) draw; ``take()`` commits it when its group opens. Draws are
deterministic under the seed: env mixing uses one generator (``weight`` per env), each env walks its tasks
in a seeded shuffled order (a new shuffle every epoch) unless it has a curriculum (curriculum.py), which
draws from pools by each task's recent pass rate.

``state()`` is everything that decides the draws after the last committed one (the mixing generator's
state, each env's cursor or curriculum state, the number of draws); a sampler built with ``state=`` from it
draws exactly what the original would have drawn next, so a resumed run samples what an uninterrupted run
samples. A peeked but untaken draw is not in the state: it is drawn again.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from orchestrator.rollouts.curriculum import Curriculum, CurriculumConfig


@dataclass(frozen=True)
class Draw:
    number: int  # draws committed before this one: the group's id is g<number + 1>
    env: str
    task: int
    pool: str | None = None  # the curriculum pool it came from


class TaskOrder:
    """Seeded shuffled task order of one environment; a new shuffle each epoch. Restored from its cursor by
    re-drawing the shuffles of the epochs before it (one permutation per epoch)."""

    def __init__(self, n: int, seed: Sequence[int], cursor: int = 0) -> None:
        self.n, self.cursor = n, cursor
        self._rng = np.random.default_rng(list(seed))
        self._order = self._rng.permutation(n)
        for _ in range(cursor // n if n else 0):
            self._order = self._rng.permutation(n)

    def peek(self) -> int:
        return int(self._order[self.cursor % self.n])

    def take(self) -> int:
        task = self.peek()
        self.cursor += 1
        if self.cursor % self.n == 0:
            self._order = self._rng.permutation(self.n)
        return task


@dataclass(frozen=True)
class EnvDraws:
    """One environment as the sampler sees it."""

    name: str
    tasks: int
    weight: float
    curriculum: CurriculumConfig | None = None


class TaskSampler:
    def __init__(self, envs: Sequence[EnvDraws], seed: int, state: Mapping[str, Any] | None = None) -> None:
        if not envs or any(e.tasks < 1 for e in envs):
            raise ValueError(f"every environment needs at least one task: {[(e.name, e.tasks) for e in envs]}")
        self.envs = list(envs)
        weights = np.array([e.weight for e in envs], dtype=np.float64)
        self._p = weights / weights.sum()
        self._rng = np.random.default_rng(seed)
        self.draws = 0
        self.orders: dict[str, TaskOrder] = {}
        self.curricula: dict[str, Curriculum] = {}
        saved = dict(state or {})
        for i, e in enumerate(envs):
            env_state = saved.get("envs", {}).get(e.name, {})
            if e.curriculum is not None:
                self.curricula[e.name] = Curriculum(e.curriculum, e.tasks, (seed, i), env_state.get("curriculum"))
            else:
                self.orders[e.name] = TaskOrder(e.tasks, (seed, i), int(env_state.get("cursor", 0)))
        if saved:
            self._rng.bit_generator.state = saved["rng"]
            self.draws = int(saved["draws"])
        self._pending: Draw | None = None
        self._before_pending: dict[str, Any] | None = None

    def peek(self) -> Draw:
        """The next draw (the same until ``take``)."""
        if self._pending is None:
            self._before_pending = dict(copy.deepcopy(self._rng.bit_generator.state))
            env = self.envs[int(self._rng.choice(len(self.envs), p=self._p))]
            if env.name in self.curricula:
                task, pool = self.curricula[env.name].peek()
            else:
                task, pool = self.orders[env.name].peek(), None
            self._pending = Draw(self.draws, env.name, task, pool)
        return self._pending

    def take(self) -> Draw:
        """Commit the next draw (its group opens)."""
        draw = self.peek()
        if draw.env in self.curricula:
            self.curricula[draw.env].take()
        else:
            self.orders[draw.env].take()
        self.draws += 1
        self._pending = self._before_pending = None
        return draw

    def record(self, env: str, task: int, pass_rate: float) -> None:
        """A group of ``env``'s ``task`` completed with ``pass_rate`` (curricula learn from it)."""
        if env in self.curricula:
            self.curricula[env].record(task, pass_rate)

    def state(self) -> dict[str, Any]:
        """Everything that decides the draws after the last committed one (msgpack-able)."""
        rng = self._before_pending if self._pending is not None else self._rng.bit_generator.state
        envs: dict[str, Any] = {name: {"cursor": o.cursor} for name, o in self.orders.items()}
        envs.update({name: {"curriculum": c.state()} for name, c in self.curricula.items()})
        return {"rng": copy.deepcopy(rng), "draws": self.draws, "envs": envs}

    def metrics(self) -> dict[str, Any]:
        """Per env with a curriculum: pool sizes and draws per pool since the last call."""
        return {name: c.take_metrics() for name, c in self.curricula.items()}
