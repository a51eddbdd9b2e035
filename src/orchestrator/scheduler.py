"""The rollout scheduler: continuous batching of groups, partial groups, off-policy bounds.

``run()`` consumes room (in-flight and buffer capacity) and produces group assignments to env workers;
it wakes when a group finishes or a step takes rollouts. ``on_record`` consumes finished rollouts (from
the worker hub) and completes groups. ``next_step(step)`` waits for, and takes, the groups of one step.

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
from typing import Any

import numpy as np

from orchestrator.config import JobConfig
from orchestrator.inference.pool import InferencePool, Server
from orchestrator.worker.hub import WorkerHub
from orchestrator.worker.protocol import RolloutRecord

log = logging.getLogger(__name__)

STALL_WARN_S = 60.0  # a step that has not grown for this long gets a warning saying why, and again after as long


@dataclass
class Group:
    gid: str
    env: str
    task: int
    policy: int
    size: int
    server: Server
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
    def __init__(self, cfg: JobConfig, pool: InferencePool, hub: WorkerHub, policy: int = 0,
                 cursors: dict[str, int] | None = None) -> None:
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
        self._wake = asyncio.Event()
        self._group_done = asyncio.Event()
        self._counter = 0
        self.counts: Counter[str] = Counter()  # per step: completed, failed:<reason>, dropped, cancelled...
        self._worker_seen: dict[str, int] = {}  # worker -> rollouts completed at the last take_counts
        self._rates_t = time.monotonic()
        hub.on_record = self.on_record
        hub.on_lost = self.on_lost

    @property
    def inflight_rollouts(self) -> int:
        return sum(len(g.missing) for g in self.inflight.values())

    def _room(self, size: int) -> bool:
        used = self.inflight_rollouts
        return used + size <= self.s.max_inflight and used + self.buffered + size <= self.s.max_buffered_rollouts

    async def run(self) -> None:
        """Open groups while there is room; check group timeouts. Runs until cancelled."""
        while True:
            await self._expire()
            env = self.cfg.env[int(self.rng.choice(len(self.cfg.env), p=self.env_p))]
            while not (self._room(env.group_size) and self.hub.has_ready()):
                self._wake.clear()
                try:
                    async with asyncio.timeout(1.0):  # not wait_for: on 3.11 it can swallow a cancel
                        await self._wake.wait()
                except TimeoutError:
                    await self._expire()
            await self._open(env.label, env.group_size)
            await asyncio.sleep(0)  # let records in before the next group, even when every await above was ready

    async def _open(self, env_name: str, size: int) -> None:
        env = self.envs[env_name]
        server = await self.pool.acquire(size)
        self._counter += 1
        gid = f"g{self._counter}"
        group = Group(gid, env_name, self.orders[env_name].next(), self.policy, size, server)
        rids = [f"{gid}-{i}" for i in range(size)]
        group.missing = set(rids)
        self.inflight[gid] = group
        for rid in rids:
            self.by_rid[rid] = group
        sampling = {"max_tokens": env.sampling.max_tokens, "temperature": env.sampling.temperature,
                    "top_p": env.sampling.top_p}
        await self.hub.assign({"group": gid, "env": env_name, "task": group.task, "rids": rids,
                               "server": server.url, "sampling": sampling, "policy_step": self.policy})

    def on_record(self, record: RolloutRecord) -> None:
        rid = str(record.header.get("rid"))
        group = self.by_rid.pop(rid, None)
        if group is None or rid not in group.missing:
            self.counts["late"] += 1  # a cancelled or timed-out group's straggler
            return
        group.missing.discard(rid)
        group.records.append(record)
        if record.ok:
            self.counts["completed"] += 1
            self.pool.report_success(group.server)
        else:
            h = record.header
            if h.get("stop") == "provider_error" or h.get("is_timeout") or h.get("server_fault"):
                # env workers call the server directly: failures that are the server's feed the pool's health
                kind = "provider" if h.get("stop") == "provider_error" or h.get("is_timeout") else "malformed"
                self.pool.report_failure(group.server, f"{kind}: {h.get('error')}")
            reason = str(record.header.get("error") or "unknown").split(":")[0]
            self.counts[f"failed:{reason}"] += 1
            log.warning("rollout %s (%s) failed: %s", rid, group.env, record.header.get("error"))
        if not group.missing:
            self._finish(group)

    def on_lost(self, worker: str, rids: list[str]) -> None:
        for rid in rids:
            group = self.by_rid.get(rid)
            if group is not None:
                self.on_record(RolloutRecord({"rid": rid, "env": group.env, "ok": False,
                                              "error": f"worker_died: env worker {worker} died"}, []))

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
                reason = f"stale: sampled with policy {group.policy}, now {self.policy}"
                self.counts["cancelled"] += len(group.missing)
            elif now - group.started > self.s.group_timeout_s:
                reason = f"group_timeout: running for more than {self.s.group_timeout_s:g} s"
                self.pool.report_failure(group.server, f"timeout: group {group.gid} {reason}")  # a hung server
            else:
                continue
            await self.hub.cancel(group.gid, sorted(group.missing))
            for rid in sorted(group.missing):
                self.on_record(RolloutRecord({"rid": rid, "env": group.env, "ok": False, "error": reason}, []))

    async def set_policy(self, step: int) -> None:
        """The servers now sample with weights ``step``: cancel in-flight groups that became too old."""
        self.policy = step
        await self._expire()

    async def next_step(self, step: int) -> list[Group]:
        """Wait for, and take, the groups of step ``step`` (see the module docstring for the rules)."""
        oldest = step - self.s.max_async_level
        taken: list[Group] = []
        count = 0
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
            count += len(group.survivors) if self.s.batch_size else sum(int(r.header.get("tokens", 0))
                                                                         for r in group.survivors)
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

    def _worker_rates(self) -> dict[str, dict[str, float]]:
        """Per worker, since the last call: rollouts completed and rollouts/s."""
        now = time.monotonic()
        elapsed = max(now - self._rates_t, 1e-9)
        self._rates_t = now
        out = {}
        for w in self.hub.workers.values():
            n = w.completed - self._worker_seen.get(w.name, 0)
            self._worker_seen[w.name] = w.completed
            out[w.name] = {"rollouts": n, "rollouts_per_s": round(n / elapsed, 2)}
        return out

    def cursors(self) -> dict[str, int]:
        return {name: order.cursor for name, order in self.orders.items()}
