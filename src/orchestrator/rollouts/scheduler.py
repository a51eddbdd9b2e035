"""The rollout scheduler: continuous batching of groups, partial groups, gates with refill, off-policy bounds.

``run()`` owns two loops: admission consumes room (in-flight and buffer capacity) and produces group
assignments to env workers, waking when a group finishes, a step takes rollouts, the policy changes or an
evaluation round starts; intake consumes the worker hub's events (finished rollouts, lost workers) and
completes groups. ``next_step(step)`` waits for, and takes, the groups of one step.

The ``Scheduler`` is the two loops and the face the app uses; its parts do the jobs: which group opens, when,
and on which server (admission.py: ``Admission``, ``Capacity``); a group's rollouts in, then advantages, gates
and drops (completion.py); finished groups waiting for a step (groups.py: ``Buffer``); steps taking them
(filling.py); the stall line (stall.py); the env workers and checkpoints it talks to (links.py).

Rules, with every bound from the config:

- What is sampled next is the sampler's (sampler.py, curriculum.py): env mixing by ``weight``, each env's
  seeded task order or its curriculum; resumable exactly (``state()``).
- A group is ``group_size`` rollouts of one task on one inference server (the pool's least-loaded,
  acquired until the group finishes). A group opens only when all of it fits under ``max_inflight`` and
  in-flight + buffered + the group stays within ``max_buffered_rollouts``: a full buffer pauses generation.
  Evaluation groups (evaluation.py) open first, within ``eval.max_inflight``.
- A group completes when every rollout has come back (success or failure) or ``group_timeout_s`` passed
  (groups.py). Survivors train; an all-failed group, or a ``group_scoring`` group with any failure, is
  dropped and counted (its line says why: faults and first error); the next step writes its rows
  (``take_dropped``; bounded). Each failure is logged once; a failure that is the server's feeds its health,
  and its line is a WARNING once per server event (faultlog.py), else DEBUG.
- Gates (gates.py) run when a training group completes, on its advantages: a rejected group does not count
  and the step keeps filling. A step that sees ``max_rejected_batches`` batches' worth of rejected
  rollouts without filling stops the run with SchedulingError naming the gates.
- Off-policy (``policy`` = the weight version servers had when the group was assigned): a step ``s`` takes
  only groups with ``policy >= s - max_async_level``; older finished groups are discarded as stale. While
  the servers' policy is older than that, no training group opens (each would be discarded): the step waits
  for a checkpoint, and asks the trainer link for it (``checkpoints.checkpoint_wanted``). When the policy
  becomes ``p``, in-flight training groups with ``policy < p - max_off_policy_steps`` are cancelled.
- No work that cannot train: a group opened with policy ``p`` can join steps up to ``p + max_async_level``;
  with ``batch_size``, no training group opens while the rollouts in flight, buffered and taken that can
  join those steps already fill them. On-policy (max_async_level = 0) this samples exactly one batch per
  policy, whatever the timing, instead of about two (the second discarded as stale).
- Liveness: a step that takes no rollout for ``monitor.stall_warn_s`` (stale discards and gate rejections
  are not progress) gets one warning saying what it waits for: a checkpoint (and where it comes from), env
  workers, inference servers, or the rollouts in flight and their failures; again every as long.
- A step is ``batch_size`` rollouts or ``token_budget`` tokens: whole groups in completion order until the
  count is reached (a step may exceed it by less than one group).
- The direct data plane: every rollout the scheduler drops while its columns are in a
  worker's pool (its group dropped, rejected by a gate, stale, a straggler) is released to that worker at once
  (``hub.release``); those of taken groups are the step's to release. When a worker's pool is gone
  (``PoolGone``), its buffered rollouts, and those a step being taken holds so far, fail with ``worker_died``
  (counted ``columns_lost``); a group left without survivors is dropped, and the step fills from other
  groups. A sent step the trainer could not read whole is refilled (``lose_taken`` fails its lost rollouts,
  ``refill`` takes groups to make it whole again, ahead of the step being taken).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from orchestrator.contracts.events import PoolGone, RecordsIn
from orchestrator.contracts.protocol import Assign, RolloutRecord
from orchestrator.inference.pool import InferencePool, Server
from orchestrator.rollouts.admission import EVAL_PREFIX, Admission, Capacity, Opening
from orchestrator.rollouts.completion import Completion, EvalRow
from orchestrator.rollouts.concurrency import ConcurrencyControl
from orchestrator.rollouts.config import EnvConfig, EvalConfig, SchedulerConfig, smallest_group
from orchestrator.rollouts.evaluation import Evaluator
from orchestrator.rollouts.filling import SchedulingError, StepFiller
from orchestrator.rollouts.groups import Buffer, Group, GroupTracker
from orchestrator.rollouts.links import CheckpointSource, WorkerLink
from orchestrator.rollouts.sampler import EnvDraws, TaskSampler
from orchestrator.rollouts.stall import StallLine
from orchestrator.scoring.config import PipelineConfig

__all__ = ["EVAL_PREFIX", "CheckpointSource", "Scheduler", "SchedulingError", "WorkerLink"]

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, limits: SchedulerConfig, envs: Sequence[EnvConfig], pool: InferencePool, hub: WorkerLink,
                 policy: int = 0, *, pipeline: PipelineConfig, evaluation: EvalConfig | None = None, seed: int = 0,
                 stall_warn_s: float = 30.0, state: dict[str, Any] | None = None,
                 train: bool = True,
                 checkpoints: CheckpointSource | None = None, first_step: int | None = None) -> None:
        """``limits``: ``[scheduler]``; ``envs``: the ``[[env]]`` tables; ``pipeline``: advantages and gates;
        ``evaluation``: ``[eval]``; ``seed``: ``run.seed`` (task order). ``train=False``: evaluation only
        (``orchestrator eval``); no training group ever opens. ``checkpoints``: asked for a checkpoint when a step
        waits for a newer policy. ``first_step``: the step ``next_step`` fills first (default ``policy``). Built
        in the running loop, whose clock its timing rules read (group timeouts, stall lines, rates)."""
        self.limits = limits
        self.pool = pool
        self.hub = hub
        self.clock = clock = asyncio.get_running_loop().time
        self.envs = {e.label: e for e in envs}
        state = state or {}
        self.sampler = TaskSampler([EnvDraws(e.label, hub.tasks_per_env[e.label], e.weight, e.curriculum)
                                    for e in envs], seed, state.get("sampler")) if train else None
        self.evaluator = None if evaluation is None else Evaluator(
            evaluation, self.limits.max_inflight,
            {e.label: hub.tasks_per_env[EVAL_PREFIX + e.label] for e in evaluation.env}, state.get("eval"))
        self.tracker = GroupTracker(self.limits.max_off_policy_steps, self.limits.group_timeout_s)
        self.buffer = Buffer()  # rollouts in accepted groups not yet taken by a step
        self.counts: Counter[str] = Counter()  # per step: dropped_groups, rejected_groups, stale_rollouts, ...
        self._wake = asyncio.Event()  # admission: room, a new policy or step, an evaluation round due
        group_done = asyncio.Event()  # a step: a group buffered or rejected, a refill ended
        # [scheduler.concurrency]: each server's cap follows its KV cache; a hard trim sheds groups there
        self.smallest_group = smallest_group(envs, evaluation)
        self.concurrency = None if not limits.concurrency.adaptive else ConcurrencyControl(
            limits.concurrency, pool, limits.max_inflight, self.smallest_group,
            lambda server, n: self.completion.shed(server, n), raised=self._wake.set)
        done = self.concurrency.done if self.concurrency is not None else (lambda _server, _size, _longest: None)
        capacity = Capacity(self.limits.max_inflight, pool, self.tracker, done)
        self.admission = Admission(self.limits, capacity, self.tracker, self.buffer, self.envs, self.sampler,
                                   self.evaluator, policy, policy if first_step is None else first_step)
        self.completion = Completion(limits, pipeline, stall_warn_s, pool, capacity, hub, self.tracker, self.buffer,
                                     envs=self.envs, sampler=self.sampler, evaluator=self.evaluator,
                                     counts=self.counts, clock=clock, room=self._wake, finished=group_done)
        self.stall = StallLine(self.admission, hub, pool, self.tracker, self.counts, checkpoints,
                               self.limits.max_rejected_batches, self.smallest_group)
        self.steps = StepFiller(self.limits, self.admission, self.completion, self.buffer, self.stall,
                                counts=self.counts, checkpoints=checkpoints, stall_warn_s=stall_warn_s,
                                clock=clock, room=self._wake, finished=group_done)
        self._worker_seen: dict[str, int] = {}  # worker -> rollouts completed at the last take_counts
        self._rates_t = clock()

    # ------------------------------------------------------------------------------------------ views

    @property
    def policy(self) -> int:
        """The weights the servers sample with."""
        return self.admission.policy

    @policy.setter
    def policy(self, step: int) -> None:
        self.admission.policy = step

    @property
    def syncing(self) -> bool:
        """A weight sync is under way: no evaluation round starts."""
        return self.admission.syncing

    @property
    def loading(self) -> str | None:
        """What the weight sync to a newer policy waits for while it runs, or why its checkpoint was refused."""
        return self.stall.loading

    @property
    def inflight(self) -> dict[str, Group]:
        return self.tracker.inflight

    @property
    def inflight_rollouts(self) -> int:
        return self.tracker.inflight_rollouts

    @property
    def done(self) -> deque[Group]:
        """Finished groups waiting for a step, oldest first."""
        return self.buffer.groups

    @property
    def buffered(self) -> int:
        """The rollouts in ``done`` (that a step may train on)."""
        return self.buffer.rollouts

    @property
    def eval_rows(self) -> asyncio.Queue[EvalRow]:
        """An evaluation round's row and groups, one per round."""
        return self.completion.eval_rows

    # ------------------------------------------------------------------------------------------ loops

    async def run(self) -> None:
        """Admission and intake (see the module docstring), until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._intake())
            if self.concurrency is not None:
                tg.create_task(self.concurrency.run())
            await self._admit()

    async def _intake(self) -> None:
        """Consumes the hub's events; produces completed groups (completion.py). Wakes on each event."""
        while True:
            event = await self.hub.events.get()
            if isinstance(event, RecordsIn):
                for record in event.records:
                    self.completion.on_record(record)
            elif isinstance(event, PoolGone):
                self.on_pool_gone(event.worker, event.pool, event.why)
            else:
                self.completion.on_lost(event.worker, event.rids, event.why)

    async def _admit(self) -> None:
        """Consumes room (admission.py says which group opens, and when); produces group assignments to env
        workers. Waits for ``_wake`` (a group finished, a step took rollouts, the policy changed, an evaluation
        round is due), at most a second: then checks group timeouts."""
        capacity = self.admission.capacity
        while True:
            self.completion.expire(self.policy)
            opening = self.admission.next() if self.hub.has_ready() else None
            if opening is None:
                self._wake.clear()
                try:
                    async with asyncio.timeout(1.0):  # not wait_for: on 3.11 it can swallow a cancel
                        await self._wake.wait()
                except TimeoutError:
                    pass
                continue
            server = capacity.take(opening.size)
            if server is None:  # no server in rotation: wait for one (warned), then look again
                await capacity.wait()
                continue
            self._open(opening, server)
            await asyncio.sleep(0)  # let records in before the next group, even when every await above was ready

    def _open(self, opening: Opening, server: Server) -> None:
        policy = self.policy
        if opening.evaluation:
            assert self.evaluator is not None
            label = opening.env.removeprefix(EVAL_PREFIX)
            round_step, gid = self.evaluator.opened(policy)
            sampling = self.evaluator.sampling[label]
            group = Group(gid, label, opening.task, policy, opening.size, server, self.clock(), eval_round=round_step)
        else:
            assert self.sampler is not None
            draw = self.sampler.take()
            gid = f"g{draw.number + 1}"
            sampling = self.envs[opening.env].sampling.params()
            group = Group(gid, opening.env, opening.task, policy, opening.size, server, self.clock())
        self.tracker.open(group)
        # cache_salt: KV cached under older weights is never reused for this policy (verifiers sends it top-level)
        sampling = {**sampling, "cache_salt": str(policy)}
        group.worker = self.hub.assign(Assign(gid, opening.env, opening.task, group.rids, server.url, sampling,
                                              policy, train=not opening.evaluation))

    # ----------------------------------------------------------------------------------------- policy

    async def set_policy(self, step: int) -> None:
        """The servers now sample with weights ``step``: cancel in-flight groups that became too old."""
        self.admission.policy = step
        self.admission.syncing = False
        self.stall.loading = None
        self._wake.set()
        self.completion.expire(step)

    def sync_waits(self, why: str) -> None:
        """A weight sync waits before it starts (e.g. for an evaluation round); ``why`` goes into stall lines."""
        self.stall.loading = why

    def sync_started(self, why: str) -> None:
        """A weight sync is under way: no evaluation round starts until ``set_policy`` or ``sync_refused``;
        ``why`` goes into stall lines."""
        self.admission.syncing = True
        self.stall.loading = why

    def sync_refused(self, why: str) -> None:
        """The weight sync's checkpoint was refused: the servers keep ``policy``; ``why`` goes into stall lines."""
        self.admission.syncing = False
        self.stall.loading = why
        self._wake.set()  # an evaluation round held by the sync may start

    def start_evaluation(self, step: int) -> None:
        """Start the evaluation round of ``step`` as soon as no weight sync is under way (its row arrives on
        ``eval_rows``)."""
        assert self.evaluator is not None
        self.admission.eval_due = step
        self.evaluator.idle.clear()  # pending counts as running: a held weight sync waits from now
        self._wake.set()

    # ------------------------------------------------------------------------------------------ steps

    async def next_step(self, step: int) -> list[Group]:
        """Wait for, and take, the groups of step ``step`` (see the module docstring for the rules); starts
        the evaluation round due at ``step``."""
        if self.evaluator is not None and (due := self.evaluator.due(step)) is not None:
            self.start_evaluation(due)
        return await self.steps.next_step(step)

    async def refill(self, step: int, kept: Sequence[Group]) -> list[Group]:
        """Step ``step`` is rebuilt (direct mode: the trainer could not read some of its columns) and keeps
        ``kept`` of its groups: wait for, and take, the groups that bring it back to its size, by next_step's
        rules (stale groups are discarded). It goes first: meanwhile groups open for step ``step``'s policy
        bound too, and a step being taken (a later one) takes nothing, so it neither waits for weights the
        trainer cannot make before it has step ``step`` nor discards as stale the groups the refill needs."""
        return await self.steps.refill(step, kept)

    def lose_taken(self, groups: Sequence[Group], pools: set[tuple[str, str]], why: str
                   ) -> tuple[list[Group], list[Group], list[RolloutRecord]]:
        """The columns in ``pools`` ((worker, pool id) pairs) of taken ``groups`` cannot be read: those rollouts
        fail with ``worker_died``; a group left without survivors (or a ``group_scoring`` one that lost any) is
        dropped (counted, its survivors released; its rows are the caller's to write). The groups kept, those
        dropped, and the records that were lost (as they were, with their spans, for release: the pool may still
        be its worker's)."""
        return self.steps.lose_taken(groups, pools, why)

    def on_pool_gone(self, worker: str, pool: str, why: str) -> None:
        """``worker``'s column pool is gone: its rollouts buffered here, in groups still in flight, or taken by a
        step not sent yet, fail."""
        lost = self.completion.lose_pool(worker, pool, why) + self.steps.lose_pool(worker, pool, why)
        if lost:
            self.counts["columns_lost"] += lost
            log.warning("%d buffered rollouts lost their columns with env worker %s's pool (%s)", lost, worker, why)
            self._wake.set()  # room in the buffer

    def take_dropped(self) -> list[Group]:
        """The groups dropped since the last call (their rows go to rollouts.jsonl, marked dropped)."""
        return self.completion.take_dropped()

    # ---------------------------------------------------------------------------------------- metrics

    def take_counts(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.tracker.take_counts(), **self.counts}
        out.update(inflight=self.inflight_rollouts, buffered=self.buffered, workers=self._worker_rates(),
                   gates=self.completion.gates.take_counts())
        if self.sampler is not None and (curricula := self.sampler.metrics()):
            out["curriculum"] = curricula
        if self.concurrency is not None:
            out["concurrency"] = self.concurrency.snapshot()
        self.counts.clear()
        return out

    def _worker_rates(self) -> dict[str, dict[str, float | None]]:
        """Per worker, since the last call: rollouts completed and rollouts/s; and its RSS in MB."""
        now = self.clock()
        elapsed = max(now - self._rates_t, 1e-9)
        self._rates_t = now
        out: dict[str, dict[str, float | None]] = {}
        for name, (completed, rss) in self.hub.worker_stats().items():
            seen = self._worker_seen.get(name, 0)
            n = completed - seen if completed >= seen else completed  # restarted or re-admitted: counts anew
            self._worker_seen[name] = completed
            out[name] = {"rollouts": n, "rollouts_per_s": round(n / elapsed, 2), "rss_mb": rss}
        return out

    def state(self) -> dict[str, Any]:
        """What decides what is sampled next (and the evaluation schedule), for an exact resume."""
        out: dict[str, Any] = {} if self.sampler is None else {"sampler": self.sampler.state()}
        if self.evaluator is not None:
            out["eval"] = self.evaluator.state()
        return out
