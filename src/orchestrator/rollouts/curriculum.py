"""A difficulty curriculum for one environment: tasks in pools by their recent pass rate, drawn by pool weight.

``[env.curriculum]`` turns it on. Every task starts *unseen*; unseen tasks are drawn in a seeded shuffled
order. A drawn task is *in flight* (not drawn again) until its group completes; then its pass rate (the
share of the group's rollouts with a reward above ``pass_threshold``, averaged over its last ``window``
groups) puts it in the first pool whose ``max_pass_rate`` it does not exceed, e.g. hard (<= 0.25), normal
(<= 0.75), easy (<= 1.0). Each draw first picks a pool (unseen included) with probability proportional to
its weight among the pools that have tasks, then a task of that pool uniformly; a pool of weight 0 is never
drawn. Tasks move between pools as they are learned. Only when every task is in flight is an in-flight task
drawn again.

The same seed and the same completed groups give the same draws; ``state()`` holds everything that decides
them (pass rates of seen tasks, the in-flight set, the unseen cursor, the generator). Metrics: pool sizes
and draws per pool since the last ``take_metrics``.
"""

from __future__ import annotations

import copy
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from orchestrator.configbase import Source, opt

UNSEEN, IN_FLIGHT = "unseen", "in_flight"


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    name: str = opt(doc="pool name in metrics")
    max_pass_rate: float = opt(ge=0, le=1, doc="tasks whose recent pass rate is at most this (and above the "
                                               "previous pool's) are in this pool")
    weight: float = opt(ge=0, doc="relative chance that a draw comes from this pool (0: never)")


DEFAULT_POOLS = (PoolConfig(name="hard", max_pass_rate=0.25, weight=0.2),
                 PoolConfig(name="normal", max_pass_rate=0.75, weight=1.0),
                 PoolConfig(name="easy", max_pass_rate=1.0, weight=0.2))


@dataclass(frozen=True, kw_only=True)
class CurriculumConfig:
    pools: tuple[PoolConfig, ...] = opt(DEFAULT_POOLS, doc="[[env.curriculum.pools]] tables, by max_pass_rate")
    unseen_weight: float = opt(1.0, ge=0, doc="relative chance of drawing a task never drawn before")
    pass_threshold: float = opt(0.5, doc="a rollout passes when its reward is above this")
    window: int = opt(1, ge=1, doc="a task's pass rate is the mean over its last this many groups")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        rates = [p.max_pass_rate for p in self.pools]
        if not self.pools or rates != sorted(rates) or len(set(rates)) != len(rates) or rates[-1] != 1.0:
            yield (f"{source(key)}: {key}.pools: max_pass_rate must increase strictly from pool to pool and the "
                   f"last must be 1.0 (every pass rate falls in a pool), got {rates}")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names) or {UNSEEN, IN_FLIGHT} & set(names):
            yield f"{source(key)}: {key}.pools: names must be distinct and not {UNSEEN!r} or {IN_FLIGHT!r}, got {names}"
        if self.unseen_weight == 0 and all(p.weight == 0 for p in self.pools):
            yield f"{source(key)}: {key}: every weight is 0, so nothing could be drawn"


class _Pool:
    """A set of task ids that can be drawn from uniformly in O(1) (a list plus each id's index)."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self.index: dict[int, int] = {}

    def add(self, task: int) -> None:
        self.index[task] = len(self.items)
        self.items.append(task)

    def remove(self, task: int) -> None:
        i = self.index.pop(task)
        last = self.items.pop()
        if last != task:
            self.items[i] = last
            self.index[last] = i


class Curriculum:
    def __init__(self, cfg: CurriculumConfig, tasks: int, seed: Sequence[int],
                 state: Mapping[str, Any] | None = None) -> None:
        self.cfg, self.tasks = cfg, tasks
        self._rng = np.random.default_rng([*seed, 1])
        self._unseen_order = np.random.default_rng([*seed, 2]).permutation(tasks)
        self.unseen_cursor = 0  # unseen tasks are ``returned`` then _unseen_order[unseen_cursor:]
        self.returned: list[int] = []  # drawn but never completed (their run died): unseen again, drawn first
        self.rates: dict[int, deque[float]] = {}  # seen tasks' last ``window`` pass rates
        self.in_flight: set[int] = set()
        self.pools = {p.name: _Pool() for p in cfg.pools}
        self._where: dict[int, str] = {}  # seen, not in flight: task -> its pool
        self._draws: Counter[str] = Counter()
        self._pending: tuple[int, str] | None = None
        self._before_pending: dict[str, Any] | None = None
        if state:
            self._restore(state)

    # ------------------------------------------------------------------------------------------- drawing

    def peek(self) -> tuple[int, str]:
        """The next (task, pool it comes from); the same until ``take``."""
        if self._pending is None:
            self._before_pending = dict(copy.deepcopy(self._rng.bit_generator.state))
            self._pending = self._choose()
        return self._pending

    def _choose(self) -> tuple[int, str]:
        names = [UNSEEN, *self.pools]
        weights = np.array([self.cfg.unseen_weight, *(p.weight for p in self.cfg.pools)], dtype=np.float64)
        sizes = np.array([self._unseen(), *(len(p.items) for p in self.pools.values())])
        weights[sizes == 0] = 0.0
        if weights.sum() == 0:  # every drawable task is in flight (or only zero-weight pools have tasks)
            drawable = sorted(self.in_flight) or list(range(self.tasks))
            return drawable[int(self._rng.integers(len(drawable)))], IN_FLIGHT
        pool = names[int(self._rng.choice(len(names), p=weights / weights.sum()))]
        if pool == UNSEEN:
            return (self.returned[0] if self.returned else int(self._unseen_order[self.unseen_cursor])), UNSEEN
        items = self.pools[pool].items
        return items[int(self._rng.integers(len(items)))], pool

    def take(self) -> tuple[int, str]:
        task, pool = self.peek()
        if pool == UNSEEN:
            if self.returned:
                self.returned.pop(0)
            else:
                self.unseen_cursor += 1
        elif task in self._where:  # (an in-flight task drawn again may have completed since its peek)
            self.pools[self._where.pop(task)].remove(task)
        self.in_flight.add(task)
        self._draws[pool] += 1
        self._pending = self._before_pending = None
        return task, pool

    def record(self, task: int, pass_rate: float) -> None:
        """``task``'s group completed with ``pass_rate``: it joins the pool its recent pass rate says."""
        self.in_flight.discard(task)
        rates = self.rates.setdefault(task, deque(maxlen=self.cfg.window))
        rates.append(float(pass_rate))
        self._place(task)

    def _place(self, task: int) -> None:
        if task in self.in_flight:
            return
        old = self._where.pop(task, None)
        if old is not None:
            self.pools[old].remove(task)
        rate = sum(self.rates[task]) / len(self.rates[task])
        pool = next(p.name for p in self.cfg.pools if rate <= p.max_pass_rate)
        self.pools[pool].add(task)
        self._where[task] = pool

    def _unseen(self) -> int:
        return len(self.returned) + self.tasks - self.unseen_cursor

    # ------------------------------------------------------------------------------------ state, metrics

    def state(self) -> dict[str, Any]:
        rng = self._before_pending if self._pending is not None else self._rng.bit_generator.state
        return {"rng": copy.deepcopy(rng), "unseen_cursor": self.unseen_cursor, "returned": list(self.returned),
                "in_flight": sorted(self.in_flight), "rates": {str(t): list(r) for t, r in self.rates.items()}}

    def _restore(self, state: Mapping[str, Any]) -> None:
        """Groups in flight when the state was saved died with their run: their tasks are drawable again (in
        their pool when seen before, else unseen, first in line)."""
        self._rng.bit_generator.state = state["rng"]
        self.unseen_cursor = int(state["unseen_cursor"])
        self.rates = {int(t): deque(r, maxlen=self.cfg.window) for t, r in state["rates"].items()}
        for task in sorted(self.rates):
            self._place(task)
        self.returned = [int(t) for t in state["returned"]]
        self.returned += [int(t) for t in state["in_flight"] if int(t) not in self.rates]

    def take_metrics(self) -> dict[str, Any]:
        sizes = {UNSEEN: self._unseen(), IN_FLIGHT: len(self.in_flight),
                 **{name: len(p.items) for name, p in self.pools.items()}}
        draws, self._draws = dict(self._draws), Counter()
        return {"pool_sizes": sizes, "draws": draws}
