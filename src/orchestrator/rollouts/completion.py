"""Completion: rollouts come back, groups complete, and a completed group goes through advantages and gates.

``Completion`` consumes what the scheduler's intake hands it (finished rollouts, lost workers, lost column
pools) and the ends ``expire`` decides (too far off-policy, past ``group_timeout_s``), and produces completed
groups: a training group that trains goes into the ``Buffer`` (groups.py) for a step; an evaluation group to
its round (a round's row onto ``eval_rows``). It never waits; it sets ``room`` when rollouts leave flight or the
buffer, and ``finished`` when a step may find something new (a group buffered, or rejected by a gate).

- Each failure is logged once; a failure that is the server's feeds its health, and its line is a WARNING once
  per server event (faultlog.py), else DEBUG.
- Survivors train; an all-failed group, or a ``group_scoring`` group with any failure, is dropped and counted
  (its line says why: faults and first error); the next step writes its rows (``take_dropped``: at most
  ``max_buffered_rollouts`` rollouts' worth are kept, the oldest beyond go unwritten, counted).
- Gates (gates.py) run on a training group's advantages: a rejected group does not count, and ``rejected``
  adds what it would have added to a step (the step's rejection bound, filling.py).
- The direct data plane: every rollout dropped here while its columns are in a worker's pool
  (its group dropped, rejected by a gate, a straggler) is released to that worker at once (``hub.release``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from orchestrator.errors import Failure
from orchestrator.rollouts.concurrency import context_tokens
from orchestrator.rollouts.faultlog import ServerFaultLines
from orchestrator.rollouts.groups import Buffer, Expired, Group, GroupTracker, failure_summary, lose_columns
from orchestrator.scoring.advantage import AdvantageFn
from orchestrator.scoring.gates import Gates, GroupView

if TYPE_CHECKING:
    from orchestrator.contracts.protocol import RolloutRecord
    from orchestrator.inference.pool import InferencePool, Server
    from orchestrator.rollouts.admission import Capacity
    from orchestrator.rollouts.config import EnvConfig, SchedulerConfig
    from orchestrator.rollouts.evaluation import Evaluator
    from orchestrator.rollouts.links import WorkerLink
    from orchestrator.rollouts.sampler import TaskSampler
    from orchestrator.scoring.config import PipelineConfig

log = logging.getLogger(__name__)

EvalRow = tuple[dict[str, Any], list[Group]]


class Completion:
    def __init__(self, limits: SchedulerConfig, pipeline: PipelineConfig, stall_warn_s: float, pool: InferencePool,
                 capacity: Capacity, hub: WorkerLink, tracker: GroupTracker, buffer: Buffer, *,
                 envs: Mapping[str, EnvConfig], sampler: TaskSampler | None, evaluator: Evaluator | None,
                 counts: Counter[str], clock: Callable[[], float], room: asyncio.Event,
                 finished: asyncio.Event) -> None:
        """``counts``: the scheduler's per-step counts (dropped_groups, rejected_groups, columns_lost, ...).
        ``room`` is set when rollouts leave flight or the buffer (admission re-checks), ``finished`` when a group
        is buffered or rejected (a waiting step looks)."""
        self.pool = pool  # its servers' health: what their rollouts' failures say
        self.capacity = capacity
        self.hub = hub
        self.tracker = tracker
        self.buffer = buffer
        self.envs = envs
        self.sampler = sampler
        self.evaluator = evaluator
        self.counts = counts
        self.clock = clock
        self.size_step = step_size(limits.batch_size)
        self.max_dropped = limits.max_buffered_rollouts
        self.fault_lines = ServerFaultLines(stall_warn_s)  # server-fault failures: a line per event
        self.advantage = AdvantageFn(pipeline)
        self.gates = Gates(pipeline.gates)
        self.dropped: deque[Group] = deque()  # dropped groups whose rows the next step writes (keep_dropped)
        self.eval_rows: asyncio.Queue[EvalRow] = asyncio.Queue()  # one per round
        self.rejected = 0  # rollouts (or tokens) rejected by gates while the current step waits
        self.room = room
        self.finished = finished

    # ------------------------------------------------------------------------------------------- intake

    def on_record(self, record: RolloutRecord) -> None:
        group, complete = self.tracker.record(record)
        if group is None:  # a straggler of a group that ended
            self.release([record])
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

    def expire(self, policy: int) -> None:
        """End the in-flight groups that must end now (groups.py: ``expire``), cancelling them at the workers."""
        for ended in self.tracker.expire(self.clock(), policy):
            if ended.kind is Failure.GROUP_TIMEOUT:  # a hung server
                self.pool.report_failure(ended.group.server, Failure.TIMEOUT, f"group {ended.group.gid} {ended.why}")
            self._end(ended)

    def shed(self, server: Server, n: int) -> None:
        """``server``'s KV cache is nearly full: cancel groups there for at least ``n`` rollouts (groups.py:
        ``shed``: whole groups not yet half done, youngest first). Their finished rollouts go on as any partial
        group's do (completion's rules: trained if enough survive, else dropped and written as dropped rows); the
        cancelled ones fail as ``kv_pressure``. One line per shedding."""
        shed = self.tracker.shed(server.url, n, f"its inference server's KV cache was nearly full ({server.url})")
        if shed:
            log.warning("inference server %s: KV cache nearly full; cancelled %d group(s), %d rollouts, youngest "
                        "first", server.url, len(shed), sum(len(e.group.missing) for e in shed))
        for ended in shed:
            self.counts["kv_shed_groups"] += 1
            self._end(ended)

    def _end(self, ended: Expired) -> None:
        group = ended.group
        self.hub.cancel(group.gid, sorted(group.missing))
        for rid in sorted(group.missing):
            self._settle(self.tracker.fail(group, rid, ended.kind, ended.why))

    def lose_pool(self, worker: str, pool: str, why: str) -> int:
        """``worker``'s column pool is gone: its rollouts in groups in flight or buffered fail (a buffered group
        left without survivors is dropped); how many."""
        lost = sum(lose_columns(group, worker, pool, why) for group in self.tracker.inflight.values())
        for group in list(self.buffer.groups):
            n, dropped = self.lose(group, worker, pool, why)
            lost += n
            self.buffer.rollouts -= n
            if dropped:
                self.buffer.remove(group)
        return lost

    def _settle(self, outcome: tuple[Group | None, bool]) -> None:
        group, complete = outcome
        if group is not None and complete:
            self._finish(group)

    # --------------------------------------------------------------------------------------- completed

    def _finish(self, group: Group) -> None:
        self.capacity.release(group.server, group.size, max(map(context_tokens, group.records), default=0))
        self.room.set()
        if group.eval_round is not None:
            assert self.evaluator is not None
            self.release(group.records)  # evaluation rollouts build no samples: nothing to release, normally
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
            self.release(group.records)
            self.keep_dropped(group)
            log.warning("group %s (%s) dropped: %d of %d rollouts failed: %s", group.gid, group.env,
                        group.size - len(survivors), group.size, failure_summary(group.records))
            return
        self._score(group, rewards)

    def _score(self, group: Group, rewards: np.ndarray) -> None:
        """Advantages, then gates: the group is buffered for a step, or rejected."""
        group.advantages = self.advantage(group.survivors)
        group.gate = self.gates(GroupView(group.env, group.task, group.policy, rewards.tolist(),
                                          group.advantages.tolist()))
        if group.gate is not None:
            self.counts["rejected_groups"] += 1
            self.release(group.records)
            self.rejected += self.size_step(group)
            self.finished.set()  # a waiting step checks its rejection bound now
            return
        self.buffer.put(group)
        self.finished.set()

    # ------------------------------------------------------------------------------------------ dropped

    def lose(self, group: Group, worker: str, pool: str, why: str) -> tuple[int, bool]:
        """``lose_columns`` on a finished group; one left without survivors (or a ``group_scoring`` one that lost
        any) is dropped: counted, its survivors released, kept for its rows. Rollouts lost, and whether it was
        dropped (the caller removes it from where it was)."""
        n = lose_columns(group, worker, pool, why)
        dropped = bool(n) and (not group.survivors or self.envs[group.env].group_scoring)
        if dropped:
            self.release(group.records)
            self.counts["dropped_groups"] += 1
            self.keep_dropped(group)
        return n, dropped

    def release(self, records: Sequence[RolloutRecord]) -> None:
        """Records that will never train: their columns (direct mode) may be reused by their workers."""
        spans = [r for r in records if r.header.span is not None]
        if spans:
            self.hub.release(spans)

    def keep_dropped(self, group: Group) -> None:
        """At most ``max_buffered_rollouts`` rollouts' worth of dropped groups wait for a step to write their rows
        (when no step comes for long, e.g. every group fails, the oldest go unwritten, counted)."""
        self.dropped.append(group)
        kept = sum(len(g.records) for g in self.dropped)
        while kept > self.max_dropped:
            oldest = self.dropped.popleft()
            kept -= len(oldest.records)
            self.counts["dropped_rows_unwritten"] += len(oldest.records)

    def take_dropped(self) -> list[Group]:
        """The groups dropped since the last call (their rows go to rollouts.jsonl, marked dropped)."""
        out = list(self.dropped)
        self.dropped.clear()
        return out


def step_size(batch_size: int | None) -> Callable[[Group], int]:
    """What a group adds to a step, in the step's unit: rollouts with ``batch_size``, else tokens."""
    if batch_size:
        return lambda group: len(group.survivors)
    return lambda group: sum(r.tokens for r in group.survivors)
