"""Steps take finished groups: ``next_step`` fills a step, ``refill`` makes a sent one whole again.

A step is ``batch_size`` rollouts or ``token_budget`` tokens: whole groups from the buffer in completion order
until the count is reached (a step may exceed it by less than one group). A step ``s`` takes only groups with
``policy >= s - max_async_level``; older ones are discarded as stale (counted, released). While the servers'
policy is older than that the step asks the checkpoint source for a newer one, at once and with every stall
line (stall.py), one per ``monitor.stall_warn_s`` without progress. A step that sees ``max_rejected_batches``
batches' worth of gate rejections without filling stops the run with SchedulingError naming the gates.

The direct data plane: a step being taken gives back the rollouts of a pool that is gone
(``lose_pool``), and fills on from other groups; ``lose_taken`` does the same for a sent step the trainer
could not read whole, and ``refill`` takes the groups that make it whole, ahead of the step being taken.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.errors import OrchestratorError
from orchestrator.rollouts.groups import Buffer, Group, lose_columns

if TYPE_CHECKING:
    from orchestrator.contracts.protocol import RolloutRecord
    from orchestrator.rollouts.admission import Admission
    from orchestrator.rollouts.completion import Completion
    from orchestrator.rollouts.config import SchedulerConfig
    from orchestrator.rollouts.links import CheckpointSource
    from orchestrator.rollouts.stall import StallLine


class SchedulingError(OrchestratorError):
    """The scheduler cannot fill steps (e.g. gates reject nearly everything); the message says why."""


@dataclass
class _Filling:
    """The groups a step being taken (or refilled) holds so far, and what they count in the step's unit."""

    groups: list[Group]
    count: int
    refill: bool
    progress: float = 0.0  # when it last took a rollout (stale ones are not progress)
    warned: float = 0.0  # when it last took a rollout or warned
    asked: bool = False  # whether it asked for a checkpoint (at once, then with every warning)


class StepFiller:
    """Waits on ``finished`` (set by completion, or when a refill ends); sets ``room`` for each group it takes."""

    def __init__(self, cfg: SchedulerConfig, admission: Admission, completion: Completion, buffer: Buffer,
                 stall: StallLine, *, counts: Counter[str], checkpoints: CheckpointSource | None, stall_warn_s: float,
                 clock: Callable[[], float], room: asyncio.Event, finished: asyncio.Event) -> None:
        self.cfg = cfg
        self.admission = admission
        self.completion = completion
        self.buffer = buffer
        self.stall = stall
        self.counts = counts
        self.checkpoints = checkpoints
        self.stall_warn_s = stall_warn_s
        self.clock = clock
        self.room = room
        self.finished = finished
        self.size = completion.size_step
        self.target = cfg.batch_size or cfg.token_budget or 0
        self._filling: list[_Filling] = []  # the steps being taken now: next_step's and a refill's

    async def next_step(self, step: int) -> list[Group]:
        """Wait for, and take, the groups of step ``step``."""
        adm = self.admission
        oldest = step - self.cfg.max_async_level
        adm.min_policy, adm.taken = oldest, 0
        self.room.set()  # admission re-checks: groups may have to wait for newer weights
        self.completion.rejected = 0
        taken = await self._take(step, 0)
        adm.min_policy, adm.taken = oldest + 1, 0  # groups opened from now on are for the next step
        return taken

    async def refill(self, step: int, kept: Sequence[Group]) -> list[Group]:
        """Take the groups that bring step ``step``, which keeps ``kept``, back to its size (scheduler.py)."""
        adm = self.admission
        assert adm.refilling is None, "one refill at a time"
        adm.refilling = step
        self.room.set()  # admission re-checks with the refill's policy bound
        try:
            return await self._take(step, sum(self.size(g) for g in kept), refill=True)
        finally:
            adm.refilling = None
            self.room.set()
            self.finished.set()  # a step waiting behind the refill takes groups again

    def lose_taken(self, groups: Sequence[Group], pools: set[tuple[str, str]], why: str
                   ) -> tuple[list[Group], list[Group], list[RolloutRecord]]:
        """The columns in ``pools`` of taken ``groups`` cannot be read: the groups kept, those dropped, and the
        records that were lost (scheduler.py)."""
        kept: list[Group] = []
        dropped: list[Group] = []
        lost: list[RolloutRecord] = []
        for group in groups:
            before = list(group.records)
            n = sum(lose_columns(group, worker, pool, why) for worker, pool in sorted(pools))
            lost += [old for old, new in zip(before, group.records, strict=True) if old is not new]
            self.counts["columns_lost"] += n
            if not group.survivors or (n and self.completion.envs[group.env].group_scoring):
                self.counts["dropped_groups"] += 1
                self.completion.release(group.records)
                dropped.append(group)
            else:
                kept.append(group)
        return kept, dropped, lost

    def lose_pool(self, worker: str, pool: str, why: str) -> int:
        """``worker``'s column pool is gone: the groups taken so far, not yet in a step, give back its rollouts
        (the step counts them no more and fills on); how many were lost."""
        lost = 0
        for fill in self._filling:
            for group in list(fill.groups):
                size, survivors = self.size(group), len(group.survivors)
                n, dropped = self.completion.lose(group, worker, pool, why)
                lost += n
                if dropped:
                    fill.groups.remove(group)
                if n:
                    fill.count -= size - (0 if dropped else self.size(group))
                    if not fill.refill:
                        self.admission.taken -= survivors - (0 if dropped else len(group.survivors))
        return lost

    async def _take(self, step: int, count: int, refill: bool = False) -> list[Group]:
        """Wait for, and take, finished groups for step ``step`` until ``count`` (what it has) reaches the
        step's size; discards stale groups; warns while no progress is made. Takes nothing while a refill
        (``refill`` marks it) is under way."""
        fill = _Filling([], count, refill)
        self._filling.append(fill)  # a pool gone meanwhile takes its rollouts back out (lose_pool)
        try:
            return await self._fill(step, fill)
        finally:
            self._filling.remove(fill)

    async def _fill(self, step: int, fill: _Filling) -> list[Group]:
        oldest = step - self.cfg.max_async_level
        fill.progress = fill.warned = self.clock()
        while fill.count < self.target:
            await self._wait_for_group(step, fill)
            group = self.buffer.take()
            self.room.set()
            if group.policy < oldest:
                self.counts["stale_rollouts"] += len(group.survivors)
                self.completion.release(group.records)
                continue
            fill.groups.append(group)
            if not fill.refill:  # a refill fills an earlier step, not the one admission counts for
                self.admission.taken += len(group.survivors)
            fill.count += self.size(group)
            fill.progress = fill.warned = self.clock()
        return fill.groups

    async def _wait_for_group(self, step: int, fill: _Filling) -> None:
        """Until a group is buffered that this step may take (none while a refill it is not goes first); wakes
        on ``finished``; warns every ``stall_warn_s`` without progress."""
        oldest = step - self.cfg.max_async_level
        while not self.buffer or (self.admission.refilling is not None and not fill.refill):
            self._check_rejections(step, fill.count)
            if not fill.asked and self.admission.policy < oldest and self.checkpoints is not None:
                fill.asked = True  # at once, then with every warning
                self.checkpoints.checkpoint_wanted(oldest)
            self.finished.clear()
            try:  # a wake-up that brings no progress does not restart the count
                async with asyncio.timeout(max(fill.warned + self.stall_warn_s - self.clock(), 0.0)):
                    await self.finished.wait()
            except TimeoutError:
                fill.warned = self.clock()
                self.stall.warn(step, fill.count, self.target, fill.warned - fill.progress, self.completion.rejected)

    def _check_rejections(self, step: int, count: int) -> None:
        bound = self.cfg.max_rejected_batches * self.target
        rejected = self.completion.rejected
        if bound and rejected >= bound:
            gates = self.completion.gates.take_counts() or "no gate counts"
            raise SchedulingError(
                f"step {step} has {count} of {self.target} after gates rejected {rejected} "
                f"({self.cfg.max_rejected_batches} steps' worth): {gates}; "
                "the policy gives these groups no signal (e.g. every reward equal): change pipeline.gates, the "
                "tasks, or scheduler.max_rejected_batches")
