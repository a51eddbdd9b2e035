"""The rollout scheduler: continuous batching of groups, partial groups, off-policy bounds.

``run()`` owns two loops: admission consumes room (in-flight and buffer capacity) and produces group
assignments to env workers, waking when a group finishes or a step takes rollouts; intake consumes the
worker hub's events (finished rollouts, lost workers) and completes groups. ``next_step(step)`` waits for,
and takes, the groups of one step.

Rules, with every bound from the config:

- A group is ``group_size`` rollouts of one task, on one inference server (the pool's least-loaded,
  leased until the group finishes). A group opens only when all of it fits under ``max_inflight`` and
  in-flight + buffered + the group stays within ``max_buffered_rollouts``: a full buffer pauses generation.
- A group completes when every rollout has come back (success or failure) or ``group_timeout_s`` passed
  (missing rollouts fail with ``group_timeout``). Survivors train; an all-failed group, or a
  ``group_scoring`` group with any failure, is dropped and counted. Each failure is logged once.
- Off-policy (``policy`` = the weight version servers had when the group was assigned, the oldest policy
  that sampled any of its tokens): a step ``s`` takes only groups with ``policy >= s - max_async_level``;
  older finished groups are discarded as stale. When the policy becomes ``p``, in-flight groups with
  ``policy < p - max_off_policy_steps`` are cancelled. Example, max_async_level = 1: step 5 accepts
  rollouts sampled with weights 4 or 5, never 3.
- No work that cannot train: a group opened with policy ``p`` can join steps up to ``p + max_async_level``, so
  none opens while the step being filled is later than that (the servers wait for newer weights), nor (with
  ``batch_size``) while the rollouts in flight, buffered and taken that can join those steps already fill
  them. On-policy (max_async_level = 0) this samples exactly one batch per policy, whatever the timing.
- Environments are mixed by ``weight`` with a seeded RNG; each env walks its tasks in a seeded shuffled
  order and reshuffles when an epoch wraps.
- A step is ``batch_size`` rollouts or ``token_budget`` tokens: whole groups in completion order until the
  count is reached (a step may exceed it by less than one group).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from orchestrator.config import JobConfig
from orchestrator.errors import Failure
from orchestrator.inference.pool import InferencePool, Server
from orchestrator.worker.hub import HubEvent, RecordsIn
from orchestrator.worker.protocol import Assign, AssignedRollout, RolloutHeader, RolloutRecord

log = logging.getLogger(__name__)

STALL_WARN_S = 60.0  # a step that has not grown for this long gets a warning saying why, and again after as long


class WorkerLink(Protocol):
    """What the scheduler uses of the env workers (``WorkerHub``; ``testing.workers.FakeWorkerHub``)."""

    events: asyncio.Queue[HubEvent]
    tasks_per_env: dict[str, int]

    def has_ready(self) -> bool: ...
    def assign(self, msg: Assign) -> str: ...  # returns the worker's name
    def cancel(self, group: str, rids: list[str]) -> None: ...
    def worker_stats(self) -> dict[str, tuple[int, float | None]]: ...  # name -> (completed, RSS MB)


@dataclass
class Group:
    gid: str
    env: str
    task: int
    policy: int
    size: int
    server: Server
    worker: str = ""
    started: float = field(default_factory=time.monotonic)
    records: list[RolloutRecord] = field(default_factory=list)
    missing: set[str] = field(default_factory=set)

    @property
    def survivors(self) -> list[RolloutRecord]:
        return [r for r in self.records if r.ok]


class TaskOrder:
    """Seeded shuffled task order per environment; a new shuffle each epoch."""

    def __init__(self, n: int, rng: np.random.Generator, cursor: int = 0) -> None:
        self.n, self.rng, self.cursor = n, rng, 0
        self._order = rng.permutation(n)
        for _ in range(cursor):
            self.next()

    def next(self) -> int:
        i = self.cursor % self.n
        if i == 0 and self.cursor:
            self._order = self.rng.permutation(self.n)
        self.cursor += 1
        return int(self._order[i])


class Scheduler:
    def __init__(self, cfg: JobConfig, pool: InferencePool, hub: WorkerLink, policy: int = 0,
                 cursors: dict[str, int] | None = None, first_step: int | None = None) -> None:
        self.cfg = cfg
        self.s = cfg.scheduler
        self.pool = pool
        self.hub = hub
        self.policy = policy
        self.rng = np.random.default_rng(cfg.run.seed)
        self.envs = {e.label: e for e in cfg.env}
        weights = np.array([e.weight for e in cfg.env])
        self.env_p = weights / weights.sum()
        self.orders = {name: TaskOrder(hub.tasks_per_env[name], np.random.default_rng([cfg.run.seed, i]),
                                       (cursors or {}).get(name, 0)) for i, name in enumerate(self.envs)}
        self.inflight: dict[str, Group] = {}
        self.by_rid: dict[str, Group] = {}
        self.done: deque[Group] = deque()
        self.buffered = 0  # rollouts in finished groups not yet taken by a step
        self.filling = policy if first_step is None else first_step  # the step next_step fills now or next
        self._taken = 0  # rollouts the step being filled has taken so far
        self._wake = asyncio.Event()
        self._group_done = asyncio.Event()
        self._counter = 0
        self.counts: Counter[str] = Counter()  # per step: completed, failed:<reason>, dropped, cancelled...
        self._worker_seen: dict[str, int] = {}  # worker -> rollouts completed at the last take_counts
        self._rates_t = time.monotonic()

    @property
    def inflight_rollouts(self) -> int:
        return sum(len(g.missing) for g in self.inflight.values())

    def _room(self, size: int) -> bool:
        used = self.inflight_rollouts
        return (used + size <= self.s.max_inflight and used + self.buffered + size <= self.s.max_buffered_rollouts
                and self._wanted())

    def _wanted(self) -> bool:
        """Whether a group opened now could train (module docstring: no work that cannot train)."""
        last = self.policy + self.s.max_async_level  # the last step a group sampled now can join
        if last < self.filling:
            return False
        if not self.s.batch_size:  # a token budget: what is enough cannot be counted ahead
            return True
        oldest = self.filling - self.s.max_async_level
        have = (self._taken + sum(g.size for g in self.inflight.values() if g.policy >= oldest)
                + sum(len(g.survivors) for g in self.done if g.policy >= oldest))
        return have < (last - self.filling + 1) * self.s.batch_size

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
            else:
                self.on_lost(event.worker, event.rids, event.why)

    async def _admit(self) -> None:
        """Open groups while there is room; check group timeouts."""
        while True:
            await self._expire()
            env = self.cfg.env[int(self.rng.choice(len(self.cfg.env), p=self.env_p))]
            while True:
                while not (self._room(env.group_size) and self.hub.has_ready()):
                    self._wake.clear()
                    try:
                        async with asyncio.timeout(1.0):  # not wait_for: on 3.11 it can swallow a cancel
                            await self._wake.wait()
                    except TimeoutError:
                        await self._expire()
                server = await self.pool.acquire(env.group_size)  # may wait for a server to rejoin rotation
                if self.hub.has_ready():
                    break
                self.pool.release(server, env.group_size)  # the last worker left meanwhile
            self._open(env.label, env.group_size, server)
            await asyncio.sleep(0)  # let records in before the next group, even when every await above was ready

    def _open(self, env_name: str, size: int, server: Server) -> None:
        env = self.envs[env_name]
        self._counter += 1
        gid = f"g{self._counter}"
        group = Group(gid, env_name, self.orders[env_name].next(), self.policy, size, server)
        rids = [f"{gid}-{i}" for i in range(size)]
        group.missing = set(rids)
        self.inflight[gid] = group
        for rid in rids:
            self.by_rid[rid] = group
        # cache_salt: KV cached under older weights is never reused for this policy (verifiers sends it top-level)
        sampling = {**env.sampling.params(), "cache_salt": str(self.policy)}
        group.worker = self.hub.assign(Assign(gid, env_name, group.task, rids, server.url, sampling, self.policy))

    def on_record(self, record: RolloutRecord) -> None:
        h = record.header
        group = self.by_rid.pop(h.rid, None)
        if group is None or h.rid not in group.missing:
            self.counts["late"] += 1  # a cancelled or timed-out group's straggler
            return
        h.env, h.task, h.policy_step = group.env, group.task, group.policy  # ours, whatever the worker said
        group.missing.discard(h.rid)
        group.records.append(record)
        if record.ok:
            self.counts["completed"] += 1
            self.pool.report_success(group.server)
        else:
            kind = h.failure or Failure.ENV
            if kind.server_fault:  # env workers call the server directly: its failures feed the pool's health
                self.pool.report_failure(group.server, kind, h.error or "")
            self.counts[f"failed:{kind}"] += 1
            log.warning("rollout %s (%s) failed: %s: %s", h.rid, group.env, kind, h.error)
        if not group.missing:
            self._finish(group)

    def on_lost(self, worker: str, rids: list[str], why: str) -> None:
        for rid in rids:
            group = self.by_rid.get(rid)
            if group is not None:
                self._fail(group, rid, Failure.WORKER_DIED, f"env worker {worker}: {why}")

    def _fail(self, group: Group, rid: str, kind: Failure, why: str) -> None:
        base = AssignedRollout(rid, group.gid, group.env, group.task, group.policy, group.worker, group.server.url)
        self.on_record(RolloutRecord(RolloutHeader.failed(base, kind, why), []))

    def _finish(self, group: Group) -> None:
        del self.inflight[group.gid]
        for rid in group.missing:
            self.by_rid.pop(rid, None)
        self.pool.release(group.server, group.size)
        survivors = group.survivors
        env = self.envs[group.env]
        if not survivors or (env.group_scoring and len(survivors) < group.size):
            self.counts["dropped_groups"] += 1
            log.warning("group %s (%s) dropped: %d of %d rollouts failed", group.gid, group.env,
                        group.size - len(survivors), group.size)
        else:
            self.done.append(group)
            self.buffered += len(survivors)
            self._group_done.set()
        self._wake.set()

    async def _expire(self) -> None:
        now = time.monotonic()
        limit = self.policy - self.s.max_off_policy_steps
        for group in list(self.inflight.values()):
            if group.policy < limit:
                kind, why = Failure.STALE, f"sampled with policy {group.policy}, now {self.policy}"
                self.counts["cancelled"] += len(group.missing)
            elif now - group.started > self.s.group_timeout_s:
                kind, why = Failure.GROUP_TIMEOUT, f"running for more than {self.s.group_timeout_s:g} s"
                self.pool.report_failure(group.server, Failure.TIMEOUT, f"group {group.gid} {why}")  # a hung server
            else:
                continue
            self.hub.cancel(group.gid, sorted(group.missing))
            for rid in sorted(group.missing):
                self._fail(group, rid, kind, why)

    async def set_policy(self, step: int) -> None:
        """The servers now sample with weights ``step``: cancel in-flight groups that became too old."""
        self.policy = step
        self._wake.set()  # groups sampled now may be wanted again
        await self._expire()

    async def next_step(self, step: int) -> list[Group]:
        """Wait for, and take, the groups of step ``step`` (see the module docstring for the rules)."""
        oldest = step - self.s.max_async_level
        taken: list[Group] = []
        count = 0
        self.filling, self._taken = step, 0
        target = self.s.batch_size or self.s.token_budget or 0
        waiting_since = time.monotonic()
        while count < target:
            while not self.done:
                self._group_done.clear()
                try:
                    async with asyncio.timeout(STALL_WARN_S):
                        await self._group_done.wait()
                except TimeoutError:
                    self._warn_stall(step, count, target, time.monotonic() - waiting_since)
            group = self.done.popleft()
            self.buffered -= len(group.survivors)
            self._wake.set()
            if group.policy < oldest:
                self.counts["stale_rollouts"] += len(group.survivors)
                continue
            taken.append(group)
            self._taken += len(group.survivors)
            count += len(group.survivors) if self.s.batch_size else sum(r.tokens for r in group.survivors)
        self.filling, self._taken = step + 1, 0
        return taken

    def _warn_stall(self, step: int, count: int, target: int, waited_s: float) -> None:
        """Say why a step is not filling: e.g. an environment whose every rollout fails never fills one."""
        failed = {k.removeprefix("failed:"): v for k, v in self.counts.items() if k.startswith("failed:")}
        log.warning("step %d has %d of %d after %.0f s: %d rollouts in flight, %d groups dropped, failures %s",
                    step, count, target, waited_s, self.inflight_rollouts, self.counts["dropped_groups"],
                    failed or "none")

    def take_counts(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counts)
        out.update(inflight=self.inflight_rollouts, buffered=self.buffered, workers=self._worker_rates())
        self.counts.clear()
        return out

    def _worker_rates(self) -> dict[str, dict[str, float | None]]:
        """Per worker, since the last call: rollouts completed and rollouts/s; and its RSS in MB."""
        now = time.monotonic()
        elapsed = max(now - self._rates_t, 1e-9)
        self._rates_t = now
        out: dict[str, dict[str, float | None]] = {}
        for name, (completed, rss) in self.hub.worker_stats().items():
            n = completed - self._worker_seen.get(name, 0)
            self._worker_seen[name] = completed
            out[name] = {"rollouts": n, "rollouts_per_s": round(n / elapsed, 2), "rss_mb": rss}
        return out

    def cursors(self) -> dict[str, int]:
        return {name: order.cursor for name, order in self.orders.items()}
