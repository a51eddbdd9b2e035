"""Admission: which group opens next, when, and on which inference server.

The scheduler's admission loop (scheduler.py) asks ``Admission.next()`` for the group to open now, then
``Capacity.take`` for the server it runs on (``Capacity.wait`` while no server is in rotation); ``None`` means no
group may open now, and the loop waits for a wake-up (a group finished, a step took rollouts, the policy changed,
an evaluation round is due, a server's cap rose) to ask again.

- ``Capacity`` is how many rollouts may be in flight, and on which server: all of a group must fit under
  ``max_inflight`` (counting every rollout not back yet) and under its server's own cap where
  ``[scheduler.concurrency]`` keeps one (concurrency.py), and it runs on the least-loaded server in rotation with
  room, held until the group finishes.
- Evaluation groups (evaluation.py) open first, within ``eval.max_inflight``; a due evaluation round starts only
  while no weight sync is under way (``syncing``).
- A training group opens only when in flight + buffered + the group stays within ``max_buffered_rollouts`` (a
  full buffer pauses generation), and only with the servers' ``policy >= min_policy`` (the oldest policy the
  step being filled takes; a refill's older bound meanwhile): every group opened earlier would be discarded as
  stale, so the step waits for weights instead.
- No work that cannot train: a group opened with policy ``p`` can join steps up to ``p + max_async_level``;
  with ``batch_size``, no training group opens while the rollouts in flight, buffered and taken that can join
  those steps already fill them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.inference.pool import InferencePool, Server
    from orchestrator.rollouts.config import EnvConfig, SchedulerConfig
    from orchestrator.rollouts.evaluation import Evaluator
    from orchestrator.rollouts.groups import Buffer, GroupTracker
    from orchestrator.rollouts.sampler import TaskSampler

log = logging.getLogger(__name__)

EVAL_PREFIX = "eval/"  # env workers load evaluation environments under this prefix


@dataclass(frozen=True)
class Opening:
    """A group to open: ``size`` rollouts of task ``task`` of ``env`` (as the env workers name it: an evaluation
    environment under EVAL_PREFIX)."""

    env: str
    task: int
    size: int
    evaluation: bool


class Capacity:
    """How many rollouts may be in flight, and on which inference server. Admission asks ``fits(size)`` before a
    group opens (all of it at once), the admission loop ``take(size)`` for its server (``wait`` when none is in
    rotation), and completion ``release(server, size)`` when it finishes: ``max_inflight`` in
    all, and each server's own cap where ``[scheduler.concurrency]`` keeps one (concurrency.py; ``done`` paces it
    by the groups each server finishes)."""

    def __init__(self, max_inflight: int, pool: InferencePool, tracker: GroupTracker,
                 done: Callable[[Server, int, int], None] = lambda _server, _size, _longest: None) -> None:
        self.max_inflight = max_inflight
        self.pool = pool
        self.tracker = tracker
        self.done = done

    def fits(self, size: int) -> bool:
        """Whether ``size`` more rollouts fit in flight now: in all, and not every server in rotation at its cap
        (with none in rotation the group waits for one in ``take``'s caller, which says so)."""
        return self.tracker.inflight_rollouts + size <= self.max_inflight and not self.pool.capped_out(size)

    def take(self, size: int) -> Server | None:
        """The server a group of ``size`` rollouts runs on, held for it until ``release``; None when no server is
        in rotation (or none has room): then ``wait``."""
        return self.pool.take(size)

    async def wait(self) -> None:
        """Until a server may have room (bounded; see ``InferencePool.wait_room``)."""
        await self.pool.wait_room()

    def release(self, server: Server, size: int, longest: int = 0) -> None:
        """The group of ``size`` rollouts on ``server`` finished; its longest rollout ended with ``longest``
        tokens (0: not known)."""
        self.pool.release(server, size)
        self.done(server, size, longest)


class Admission:
    """Which group opens next (module docstring). The scheduler keeps its window current: ``policy`` (the
    servers' weights), ``min_policy`` and ``taken`` (the step being filled), ``refilling``, ``syncing``."""

    def __init__(self, cfg: SchedulerConfig, capacity: Capacity, tracker: GroupTracker, buffer: Buffer,
                 envs: Mapping[str, EnvConfig], sampler: TaskSampler | None, evaluator: Evaluator | None,
                 policy: int, first_step: int) -> None:
        self.cfg = cfg
        self.capacity = capacity
        self.tracker = tracker
        self.buffer = buffer
        self.envs = envs
        self.sampler = sampler  # None: evaluation only, no training group ever opens
        self.evaluator = evaluator
        self.policy = policy  # the weights the servers sample with
        # training groups open only with policy >= this: what the step being filled (or next filled) takes
        self.min_policy = first_step - cfg.max_async_level
        self.taken = 0  # rollouts the step being filled has taken so far
        self.refilling: int | None = None  # the step being refilled (direct mode: the trainer lost it), meanwhile
        self.syncing = False  # a weight sync is under way: no evaluation round starts
        self.eval_due: int | None = None  # the step whose evaluation round waits to start

    def inflight_eval(self) -> int:
        return sum(len(g.missing) for g in self.tracker.inflight.values() if g.eval_round is not None)

    def room(self, size: int, evaluation: bool = False) -> bool:
        """Whether a group of ``size`` fits now: in flight, and (training) in flight + buffered."""
        if evaluation:
            return self.capacity.fits(size)
        training = self.tracker.inflight_rollouts - self.inflight_eval()
        return self.capacity.fits(size) and training + self.buffer.rollouts + size <= self.cfg.max_buffered_rollouts

    def next(self) -> Opening | None:
        """The group to open next, if there is room for it now; starts the evaluation round that is due."""
        self._start_due_round()
        ev = self.evaluator
        task = None if ev is None else ev.next_task(self.inflight_eval())
        if ev is not None and task is not None and self.room(ev.size, evaluation=True):
            return Opening(EVAL_PREFIX + task[0], task[1], ev.size, True)
        floor = self.min_policy
        if self.refilling is not None:  # a refill of an earlier step takes older groups
            floor = min(floor, self.refilling - self.cfg.max_async_level)
        if self.sampler is None or self.policy < floor:
            return None  # no training; or every group opened now would be too old for the step: wait for weights
        draw = self.sampler.peek()
        size = self.envs[draw.env].group_size
        return Opening(draw.env, draw.task, size, False) if self.room(size) and self._wanted() else None

    def _start_due_round(self) -> None:
        ev = self.evaluator
        if ev is None or self.eval_due is None or self.syncing:
            return
        if ev.maybe_start(self.eval_due, self.policy):
            log.info("evaluation round of step %d starts under policy %d", self.eval_due, self.policy)
        elif ev.round is None:  # not due after all: nothing pending holds weight syncs
            ev.idle.set()
        self.eval_due = None

    def _wanted(self) -> bool:
        """Whether a training group opened now could train (module docstring: no work that cannot train)."""
        if not self.cfg.batch_size or self.refilling is not None:  # a token budget: what is enough cannot be
            return True  # counted ahead; a refill needs groups beyond any count of the step being filled
        oldest = self.min_policy  # the policies the step being filled takes
        steps = self.policy - oldest + 1  # the steps a group opened now can join, from the one being filled
        have = (self.taken + sum(g.size for g in self.tracker.inflight.values()
                                 if g.eval_round is None and g.policy >= oldest)
                + sum(len(g.survivors) for g in self.buffer.groups if g.policy >= oldest))
        return have < steps * self.cfg.batch_size
