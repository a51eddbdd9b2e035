"""The rollout scheduler: continuous batching of groups, partial groups, gates with refill, off-policy bounds.

``run()`` owns two loops: admission consumes room (in-flight and buffer capacity) and produces group
assignments to env workers, waking when a group finishes, a step takes rollouts, the policy changes or an
evaluation round starts; intake consumes the worker hub's events (finished rollouts, lost workers) and
completes groups. ``next_step(step)`` waits for, and takes, the groups of one step.

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
- Data plane (``data_plane = "direct"``): every rollout the scheduler drops while its columns are in a
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
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from orchestrator.config import JobConfig
from orchestrator.errors import Failure, OrchestratorError
from orchestrator.inference.pool import InferencePool, Server
from orchestrator.rollouts.evaluation import Evaluator
from orchestrator.rollouts.faultlog import ServerFaultLines
from orchestrator.rollouts.groups import Group, GroupTracker, failure_summary, lose_columns
from orchestrator.rollouts.sampler import EnvDraws, TaskSampler
from orchestrator.scoring.advantage import AdvantageFn
from orchestrator.scoring.gates import Gates, GroupView
from orchestrator.workers.events import HubEvent, PoolGone, RecordsIn
from orchestrator.workers.protocol import Assign, RolloutRecord

log = logging.getLogger(__name__)

EVAL_PREFIX = "eval/"  # env workers load evaluation environments under this prefix


class SchedulingError(OrchestratorError):
    """The scheduler cannot fill steps (e.g. gates reject nearly everything); the message says why."""


class WorkerLink(Protocol):
    """What the scheduler uses of the env workers (``WorkerHub``; ``testing.workers.FakeWorkerHub``)."""

    events: asyncio.Queue[HubEvent]
    tasks_per_env: dict[str, int]

    def has_ready(self) -> bool: ...
    def assign(self, msg: Assign) -> str: ...  # returns the worker's name
    def cancel(self, group: str, rids: list[str]) -> None: ...
    def release(self, records: Sequence[RolloutRecord]) -> None: ...  # their columns will never be read
    def worker_stats(self) -> dict[str, tuple[int, float | None]]: ...  # name -> (completed, RSS MB)


class CheckpointSource(Protocol):
    """Where checkpoints come from (the batch sender): asked when a step waits for one."""

    def checkpoint_wanted(self, policy: int) -> str: ...  # ask for weights >= policy; a clause for the log line


@dataclass
class _Filling:
    """The groups a step being taken (or refilled) holds so far, and what they count in the step's unit."""

    groups: list[Group]
    count: int
    refill: bool


class Scheduler:
    def __init__(self, cfg: JobConfig, pool: InferencePool, hub: WorkerLink, policy: int = 0, *,
                 state: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic,
                 train: bool = True, checkpoints: CheckpointSource | None = None,
                 first_step: int | None = None) -> None:
        """``train=False``: evaluation only (``orchestrator eval``); no training group ever opens.
        ``checkpoints``: asked for a checkpoint when a step waits for a newer policy. ``first_step``: the step
        ``next_step`` fills first (default ``policy``)."""
        self.cfg = cfg
        self.s = cfg.scheduler
        self.pool = pool
        self.hub = hub
        self.policy = policy
        self.checkpoints = checkpoints
        self.stall_warn_s = cfg.monitor.stall_warn_s
        # training groups open only with policy >= this: what the step being filled (or next filled) takes
        self.min_policy = (policy if first_step is None else first_step) - self.s.max_async_level
        self._taken = 0  # rollouts the step being filled has taken so far
        self._filling: list[_Filling] = []  # the steps being taken now: next_step's and a refill's
        self.refilling: int | None = None  # the step being refilled (direct mode: the trainer lost it), meanwhile
        # what the weight sync to a newer policy waits for while it runs, or why its checkpoint was refused
        self.loading: str | None = None
        self.clock = clock
        self.fault_lines = ServerFaultLines(self.stall_warn_s)  # server-fault failures: a line per server event
        self.envs = {e.label: e for e in cfg.env}
        state = state or {}
        self.sampler = TaskSampler([EnvDraws(e.label, hub.tasks_per_env[e.label], e.weight, e.curriculum)
                                    for e in cfg.env], cfg.run.seed, state.get("sampler")) if train else None
        self.evaluator = None if cfg.eval is None else Evaluator(
            cfg.eval, self.s.max_inflight, {e.label: hub.tasks_per_env[EVAL_PREFIX + e.label] for e in cfg.eval.env},
            state.get("eval"))
        self.tracker = GroupTracker(self.s.max_off_policy_steps, self.s.group_timeout_s)
        self.advantage = AdvantageFn(cfg.pipeline)
        self.gates = Gates(cfg.pipeline.gates)
        self.done: deque[Group] = deque()
        self.dropped: deque[Group] = deque()  # dropped groups whose rows the next step writes (_keep_dropped)
        self.eval_rows: asyncio.Queue[tuple[dict[str, Any], list[Group]]] = asyncio.Queue()  # one per round
        self.buffered = 0  # rollouts in accepted groups not yet taken by a step
        self.syncing = False  # a weight sync is under way: no evaluation round starts
        self._eval_due: int | None = None  # the step whose evaluation round waits to start
        self._rejected = 0  # rollouts (or tokens) rejected by gates while the current step waits
        self._wake = asyncio.Event()
        self._group_done = asyncio.Event()
        self.counts: Counter[str] = Counter()  # per step: dropped_groups, rejected_groups, stale_rollouts
        self._worker_seen: dict[str, int] = {}  # worker -> rollouts completed at the last take_counts
        self._rates_t = clock()

    @property
    def inflight(self) -> dict[str, Group]:
        return self.tracker.inflight

    @property
    def inflight_rollouts(self) -> int:
        return self.tracker.inflight_rollouts

    def _inflight_eval(self) -> int:
        return sum(len(g.missing) for g in self.tracker.inflight.values() if g.eval_round is not None)

    def _room(self, size: int, evaluation: bool = False) -> bool:
        used = self.inflight_rollouts
        if evaluation:
            return used + size <= self.s.max_inflight
        training = used - self._inflight_eval()
        return (used + size <= self.s.max_inflight
                and training + self.buffered + size <= self.s.max_buffered_rollouts)

    async def run(self) -> None:
        """Admission and intake (see the module docstring), until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._intake())
            await self._admit()

    async def _intake(self) -> None:
        """Consumes the hub's events; produces completed groups. Wakes on each event."""
        while True:
            event = await self.hub.events.get()
            if isinstance(event, RecordsIn):
                for record in event.records:
                    self.on_record(record)
            elif isinstance(event, PoolGone):
                self.on_pool_gone(event.worker, event.pool, event.why)
            else:
                self.on_lost(event.worker, event.rids, event.why)

    # ------------------------------------------------------------------------------------------ admission

    def _next(self) -> tuple[str, int, int, bool] | None:
        """(env, task, size, evaluation) of the group to open next, if there is room for it now."""
        ev = self.evaluator
        if ev is not None and self._eval_due is not None and not self.syncing:
            if ev.maybe_start(self._eval_due, self.policy):
                log.info("evaluation round of step %d starts under policy %d", self._eval_due, self.policy)
            elif ev.round is None:  # not due after all: nothing pending holds weight syncs
                ev.idle.set()
            self._eval_due = None
        task = None if ev is None else ev.next_task(self._inflight_eval())
        if ev is not None and task is not None and self._room(ev.size, evaluation=True):
            return EVAL_PREFIX + task[0], task[1], ev.size, True
        floor = self.min_policy
        if self.refilling is not None:  # a refill of an earlier step takes older groups
            floor = min(floor, self.refilling - self.s.max_async_level)
        if self.sampler is None or self.policy < floor:
            return None  # no training; or every group opened now would be too old for the step: wait for weights
        draw = self.sampler.peek()
        size = self.envs[draw.env].group_size
        return (draw.env, draw.task, size, False) if self._room(size) and self._wanted() else None

    def _wanted(self) -> bool:
        """Whether a training group opened now could train (module docstring: no work that cannot train)."""
        if not self.s.batch_size or self.refilling is not None:  # a token budget: what is enough cannot be
            return True  # counted ahead; a refill needs groups beyond any count of the step being filled
        oldest = self.min_policy  # the policies the step being filled takes
        steps = self.policy - oldest + 1  # the steps a group opened now can join, from the one being filled
        have = (self._taken + sum(g.size for g in self.tracker.inflight.values()
                                  if g.eval_round is None and g.policy >= oldest)
                + sum(len(g.survivors) for g in self.done if g.policy >= oldest))
        return have < steps * self.s.batch_size

    async def _admit(self) -> None:
        """Open groups while there is room; check group timeouts."""
        while True:
            self._expire()
            nxt = self._next() if self.hub.has_ready() else None
            if nxt is None:
                self._wake.clear()
                try:
                    async with asyncio.timeout(1.0):  # not wait_for: on 3.11 it can swallow a cancel
                        await self._wake.wait()
                except TimeoutError:
                    pass
                continue
            server = await self.pool.acquire(nxt[2])  # may wait for a server to rejoin rotation
            if not self.hub.has_ready() or self._next() != nxt:  # the last worker left, or room changed
                self.pool.release(server, nxt[2])
                continue
            self._open(*nxt, server)
            await asyncio.sleep(0)  # let records in before the next group, even when every await above was ready

    def _open(self, env_name: str, task: int, size: int, evaluation: bool, server: Server) -> None:
        if evaluation:
            assert self.evaluator is not None
            label = env_name.removeprefix(EVAL_PREFIX)
            round_step, gid = self.evaluator.opened(self.policy)
            sampling = self.evaluator.sampling[label]
            group = Group(gid, label, task, self.policy, size, server, self.clock(), eval_round=round_step)
        else:
            assert self.sampler is not None
            draw = self.sampler.take()
            gid = f"g{draw.number + 1}"
            sampling = self.envs[env_name].sampling.params()
            group = Group(gid, env_name, task, self.policy, size, server, self.clock())
        self.tracker.open(group)
        # cache_salt: KV cached under older weights is never reused for this policy (verifiers sends it top-level)
        sampling = {**sampling, "cache_salt": str(self.policy)}
        group.worker = self.hub.assign(Assign(gid, env_name, task, group.rids, server.url, sampling, self.policy,
                                              train=not evaluation))

    # ------------------------------------------------------------------------------------------- intake

    def on_record(self, record: RolloutRecord) -> None:
        group, complete = self.tracker.record(record)
        if group is None:  # a straggler of a group that ended
            self._release([record])
            return
        h = record.header
        if record.ok:
            self.pool.report_success(group.server)
        else:
            kind = h.failure or Failure.ENV
            level, more = logging.WARNING, ""
            if kind.server_fault:  # env workers call the server directly: its failures feed the pool's health
                self.pool.report_failure(group.server, kind, h.error or "")
                level, more = self.fault_lines.level(group.server.url, self.clock())  # one per server event
            log.log(level, "rollout %s (%s) failed: %s: %s%s", h.rid, group.env, kind, h.error, more)
        if complete:
            self._finish(group)

    def on_lost(self, worker: str, rids: list[str], why: str) -> None:
        for rid in rids:
            group = self.tracker.by_rid.get(rid)
            if group is not None:
                self._settle(self.tracker.fail(group, rid, Failure.WORKER_DIED, f"env worker {worker}: {why}"))

    def on_pool_gone(self, worker: str, pool: str, why: str) -> None:
        """``worker``'s column pool is gone: its rollouts buffered here, or in groups still in flight, fail."""
        lost = 0
        for group in self.tracker.inflight.values():
            lost += lose_columns(group, worker, pool, why)
        for group in list(self.done):
            n, dropped = self._lose(group, worker, pool, why)
            lost += n
            self.buffered -= n
            if dropped:
                self.done.remove(group)
                self.buffered -= len(group.survivors)
        for fill in self._filling:  # taken, not yet in a step: the step counts them no more and fills on
            for group in list(fill.groups):
                size, survivors = self._size(group), len(group.survivors)
                n, dropped = self._lose(group, worker, pool, why)
                lost += n
                if dropped:
                    fill.groups.remove(group)
                if n:
                    fill.count -= size - (0 if dropped else self._size(group))
                    if not fill.refill:
                        self._taken -= survivors - (0 if dropped else len(group.survivors))
        if lost:
            self.counts["columns_lost"] += lost
            log.warning("%d buffered rollouts lost their columns with env worker %s's pool (%s)", lost, worker, why)
            self._wake.set()  # room in the buffer

    def _lose(self, group: Group, worker: str, pool: str, why: str) -> tuple[int, bool]:
        """``lose_columns`` on a finished group; one left without survivors (or a ``group_scoring`` one that lost
        any) is dropped: counted, its survivors released, kept for its rows. Rollouts lost, and whether it was
        dropped (the caller removes it from where it was)."""
        n = lose_columns(group, worker, pool, why)
        dropped = bool(n) and (not group.survivors or self.envs[group.env].group_scoring)
        if dropped:
            self._release(group.records)
            self.counts["dropped_groups"] += 1
            self._keep_dropped(group)
        return n, dropped

    def _release(self, records: Sequence[RolloutRecord]) -> None:
        """Records that will never train: their columns (direct mode) may be reused by their workers."""
        spans = [r for r in records if r.header.span is not None]
        if spans:
            self.hub.release(spans)

    def _settle(self, outcome: tuple[Group | None, bool]) -> None:
        group, complete = outcome
        if group is not None and complete:
            self._finish(group)

    def _finish(self, group: Group) -> None:
        self.pool.release(group.server, group.size)
        self._wake.set()
        if group.eval_round is not None:
            assert self.evaluator is not None
            self._release(group.records)  # evaluation rollouts build no samples: nothing to release, normally
            done = self.evaluator.completed(group)
            if done is not None:
                self.eval_rows.put_nowait(done)
            return
        survivors = group.survivors
        env = self.envs[group.env]
        rewards = np.array([r.reward for r in survivors], dtype=np.float64)
        if env.curriculum is not None and self.sampler is not None:  # a failed rollout does not pass
            self.sampler.record(group.env, group.task, float(np.sum(rewards > env.curriculum.pass_threshold))
                                / group.size)
        if not survivors or (env.group_scoring and len(survivors) < group.size):
            self.counts["dropped_groups"] += 1
            self._release(group.records)
            self._keep_dropped(group)
            log.warning("group %s (%s) dropped: %d of %d rollouts failed: %s", group.gid, group.env,
                        group.size - len(survivors), group.size, failure_summary(group.records))
            return
        group.advantages = self.advantage(survivors)
        group.gate = self.gates(GroupView(group.env, group.task, group.policy, rewards.tolist(),
                                          group.advantages.tolist()))
        if group.gate is not None:
            self.counts["rejected_groups"] += 1
            self._release(group.records)
            self._rejected += self._size(group)
            self._group_done.set()  # a waiting step checks its rejection bound now
            return
        self.done.append(group)
        self.buffered += len(survivors)
        self._group_done.set()

    def _expire(self) -> None:
        for ended in self.tracker.expire(self.clock(), self.policy):
            group = ended.group
            if ended.kind is Failure.GROUP_TIMEOUT:  # a hung server
                self.pool.report_failure(group.server, Failure.TIMEOUT, f"group {group.gid} {ended.why}")
            self.hub.cancel(group.gid, sorted(group.missing))
            for rid in sorted(group.missing):
                self._settle(self.tracker.fail(group, rid, ended.kind, ended.why))

    async def set_policy(self, step: int) -> None:
        """The servers now sample with weights ``step``: cancel in-flight groups that became too old."""
        self.policy = step
        self.syncing = False
        self.loading = None
        self._wake.set()
        self._expire()

    def sync_refused(self, why: str) -> None:
        """The weight sync's checkpoint was refused: the servers keep ``policy``; ``why`` goes into stall lines."""
        self.syncing = False
        self.loading = why
        self._wake.set()  # an evaluation round held by the sync may start

    # -------------------------------------------------------------------------------------------- steps

    def _size(self, group: Group) -> int:
        """What ``group`` adds to a step, in the step's unit (rollouts, or tokens with a token budget)."""
        return len(group.survivors) if self.s.batch_size else sum(r.tokens for r in group.survivors)

    async def next_step(self, step: int) -> list[Group]:
        """Wait for, and take, the groups of step ``step`` (see the module docstring for the rules); starts
        the evaluation round due at ``step``."""
        if self.evaluator is not None and (due := self.evaluator.due(step)) is not None:
            self.start_evaluation(due)
        oldest = step - self.s.max_async_level
        self.min_policy, self._taken = oldest, 0
        self._wake.set()  # admission re-checks: groups may have to wait for newer weights
        self._rejected = 0
        taken = await self._take(step, 0)
        self.min_policy, self._taken = oldest + 1, 0  # groups opened from now on are for the next step
        return taken

    async def refill(self, step: int, kept: Sequence[Group]) -> list[Group]:
        """Step ``step`` is rebuilt (direct mode: the trainer could not read some of its columns) and keeps
        ``kept`` of its groups: wait for, and take, the groups that bring it back to its size, by next_step's
        rules (stale groups are discarded). It goes first: meanwhile groups open for step ``step``'s policy
        bound too, and a step being taken (a later one) takes nothing, so it neither waits for weights the
        trainer cannot make before it has step ``step`` nor discards as stale the groups the refill needs."""
        assert self.refilling is None, "one refill at a time"
        self.refilling = step
        self._wake.set()  # admission re-checks with the refill's policy bound
        try:
            return await self._take(step, sum(self._size(g) for g in kept), refill=True)
        finally:
            self.refilling = None
            self._wake.set()
            self._group_done.set()  # a step waiting behind the refill takes groups again

    def lose_taken(self, groups: Sequence[Group], pools: set[tuple[str, str]], why: str
                   ) -> tuple[list[Group], list[Group], list[RolloutRecord]]:
        """The columns in ``pools`` ((worker, pool id) pairs) of taken ``groups`` cannot be read: those rollouts
        fail with ``worker_died``; a group left without survivors (or a ``group_scoring`` one that lost any) is
        dropped (counted, its survivors released; its rows are the caller's to write). The groups kept, those
        dropped, and the records that were lost (as they were, with their spans, for release: the pool may still
        be its worker's)."""
        kept: list[Group] = []
        dropped: list[Group] = []
        lost: list[RolloutRecord] = []
        for group in groups:
            before = list(group.records)
            n = sum(lose_columns(group, worker, pool, why) for worker, pool in sorted(pools))
            lost += [old for old, new in zip(before, group.records, strict=True) if old is not new]
            self.counts["columns_lost"] += n
            if not group.survivors or (n and self.envs[group.env].group_scoring):
                self.counts["dropped_groups"] += 1
                self._release(group.records)
                dropped.append(group)
            else:
                kept.append(group)
        return kept, dropped, lost

    async def _take(self, step: int, count: int, refill: bool = False) -> list[Group]:
        """Wait for, and take, finished groups for step ``step`` until ``count`` (what it has) reaches the
        step's size; discards stale groups; warns while no progress is made. Takes nothing while a refill
        (``refill`` marks it) is under way."""
        fill = _Filling([], count, refill)
        self._filling.append(fill)  # a pool gone meanwhile takes its rollouts back out (on_pool_gone)
        try:
            return await self._fill(step, fill)
        finally:
            self._filling.remove(fill)

    async def _fill(self, step: int, fill: _Filling) -> list[Group]:
        oldest = step - self.s.max_async_level
        target = self.s.batch_size or self.s.token_budget or 0
        progress = warned = self.clock()  # progress: the last rollout taken (stale ones are not progress)
        asked = False
        refill = fill.refill
        while fill.count < target:
            while not self.done or (self.refilling is not None and not refill):
                self._check_rejections(step, fill.count, target)
                if not asked and self.policy < oldest and self.checkpoints is not None:
                    asked = True  # at once, then with every warning
                    self.checkpoints.checkpoint_wanted(oldest)
                self._group_done.clear()
                try:  # a wake-up that brings no progress does not restart the count
                    async with asyncio.timeout(max(warned + self.stall_warn_s - self.clock(), 0.0)):
                        await self._group_done.wait()
                except TimeoutError:
                    warned = self.clock()
                    self._warn_stall(step, fill.count, target, warned - progress, oldest)
            group = self.done.popleft()
            self.buffered -= len(group.survivors)
            self._wake.set()
            if group.policy < oldest:
                self.counts["stale_rollouts"] += len(group.survivors)
                self._release(group.records)
                continue
            fill.groups.append(group)
            if not refill:  # a refill fills an earlier step, not the one _wanted counts for
                self._taken += len(group.survivors)
            fill.count += self._size(group)
            progress = warned = self.clock()
        return fill.groups

    def start_evaluation(self, step: int) -> None:
        """Start the evaluation round of ``step`` as soon as no weight sync is under way (its row arrives on
        ``eval_rows``)."""
        assert self.evaluator is not None
        self._eval_due = step
        self.evaluator.idle.clear()  # pending counts as running: a held weight sync waits from now
        self._wake.set()

    def _check_rejections(self, step: int, count: int, target: int) -> None:
        bound = self.s.max_rejected_batches * target
        if bound and self._rejected >= bound:
            raise SchedulingError(
                f"step {step} has {count} of {target} after gates rejected {self._rejected} "
                f"({self.s.max_rejected_batches} steps' worth): {self.gates.take_counts() or 'no gate counts'}; "
                "the policy gives these groups no signal (e.g. every reward equal): change pipeline.gates, the "
                "tasks, or scheduler.max_rejected_batches")

    def _warn_stall(self, step: int, count: int, target: int, waited_s: float, oldest: int) -> None:
        """Say, in one line, what a step that is not filling waits for (see the module docstring)."""
        if self.refilling is not None and self.refilling != step:
            cause = f"step {self.refilling} first: the trainer lost some of its columns and it is being refilled"
        elif self.policy < oldest:
            source = self.loading or (self.checkpoints.checkpoint_wanted(oldest) if self.checkpoints is not None
                                      else "no trainer link to ask")
            cause = (f"a checkpoint of policy >= {oldest} (the servers have policy {self.policy}; no training group "
                     f"opens until then): {source}")
        elif not self.hub.has_ready():
            cause = ("an env worker that can take a group: none is ready (starting, or restarting after a crash), "
                     "or (data_plane = direct) every ready one's column pool is full until the trainer acknowledges "
                     "steps")
        elif not any(s.in_rotation for s in self.pool.servers):
            cause = f"an inference server: none is in rotation ({self.pool.out_of_rotation()})"
        else:
            out = self.pool.out_of_rotation()
            cause = "rollouts" + (f" (servers out of rotation: {out})" if out else "")
        failed = {str(kind): n for kind, n in self.tracker.failed.items()}  # str: the log shows the kind's value
        log.warning("step %d has %d of %d after %.0f s without progress: waits for %s; %d rollouts in flight, %d "
                    "stale discarded, %d groups dropped, %d rejected by gates (%d of %d allowed), failures %s", step,
                    count, target, waited_s, cause, self.inflight_rollouts, self.counts["stale_rollouts"],
                    self.counts["dropped_groups"], self.counts["rejected_groups"], self._rejected,
                    self.s.max_rejected_batches * target, failed or "none")

    def _keep_dropped(self, group: Group) -> None:
        """At most ``max_buffered_rollouts`` rollouts' worth of dropped groups wait for a step to write their rows
        (when no step comes for long, e.g. every group fails, the oldest go unwritten, counted)."""
        self.dropped.append(group)
        kept = sum(len(g.records) for g in self.dropped)
        while kept > self.s.max_buffered_rollouts:
            oldest = self.dropped.popleft()
            kept -= len(oldest.records)
            self.counts["dropped_rows_unwritten"] += len(oldest.records)

    def take_dropped(self) -> list[Group]:
        """The groups dropped since the last call (their rows go to rollouts.jsonl, marked dropped)."""
        out = list(self.dropped)
        self.dropped.clear()
        return out

    def take_counts(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.tracker.take_counts(), **self.counts}
        out.update(inflight=self.inflight_rollouts, buffered=self.buffered, workers=self._worker_rates(),
                   gates=self.gates.take_counts())
        if self.sampler is not None and (curricula := self.sampler.metrics()):
            out["curriculum"] = curricula
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
