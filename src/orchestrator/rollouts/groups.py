"""Groups in flight: records in, completed groups out. Synchronous, no I/O, time passed in: testable as is.

A group is ``size`` rollouts of one task on one inference server, sampled with policy ``policy`` (the weight
version the servers had when it opened). It completes when every rollout has come back, success or failure.
``expire(now, policy)`` says which in-flight groups must end now: too far off-policy
(``max_off_policy_steps``) or running longer than ``group_timeout_s``; their missing rollouts fail with
``stale`` / ``group_timeout`` (the caller cancels them at the workers). Counts per outcome accumulate in
``counts`` (``completed``, ``late``, ``cancelled``) and ``failed`` (by ``Failure`` kind) until the caller takes
them (``take_counts``: ``failed:<kind>`` keys, as metrics name them). Completed training groups that passed the
gates wait in a ``Buffer`` until a step takes them.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from orchestrator.contracts.protocol import AssignedRollout, RolloutHeader, RolloutRecord
from orchestrator.errors import Failure

if TYPE_CHECKING:
    from orchestrator.inference.pool import Server


@dataclass(eq=False)
class Group:
    gid: str
    env: str
    task: int
    policy: int
    size: int
    server: Server
    started: float
    worker: str = ""
    eval_round: int | None = None  # set: an evaluation group (never trained on)
    records: list[RolloutRecord] = field(default_factory=list)
    missing: set[str] = field(default_factory=set)
    advantages: np.ndarray | None = None  # over survivors, set when it completes (training groups)
    gate: str | None = None  # the gate that rejected it, if one did

    @property
    def rids(self) -> list[str]:
        return [f"{self.gid}-{i}" for i in range(self.size)]

    @property
    def survivors(self) -> list[RolloutRecord]:
        return [r for r in self.records if r.ok]

    def rewards(self) -> list[float]:
        return [r.reward for r in self.survivors]


def failure_summary(records: list[RolloutRecord]) -> str:
    """Why the failed ``records`` failed, in a clause: each kind and its count, most common first, and the
    first error of that kind, e.g. ``stale x4 (sampled with policy 3, now 6)``."""
    failed = [r.header for r in records if not r.ok]
    kinds = Counter(h.failure or Failure.ENV for h in failed).most_common()
    if not kinds:
        return "none failed"
    first = next((h.error for h in failed if (h.failure or Failure.ENV) == kinds[0][0] and h.error), None)
    text = ", ".join(f"{kind} x{n}" for kind, n in kinds)
    return text if first is None else f"{text} ({first[:200]})"


def lose_columns(group: Any, worker: str, pool: str, why: str) -> int:
    """The columns of ``group``'s records in ``worker``'s pool ``pool`` are gone (a ``Group``, or any group with
    ``records`` and ``survivors``, e.g. a dump's): those rollouts fail with ``worker_died``. Advantages already
    computed keep their values for the other survivors (the lost reward stays in their baseline, as a filtered
    rollout's does). The number of rollouts lost."""
    survivor = {id(r): i for i, r in enumerate(group.survivors)}
    keep = np.ones(len(survivor), dtype=bool)
    for i, r in enumerate(group.records):
        h = r.header
        if h.span is None or h.worker != worker or h.span.pool != pool:
            continue
        if id(r) in survivor:
            keep[survivor[id(r)]] = False
        failed = RolloutHeader.failed(h, Failure.WORKER_DIED, f"env worker {worker}: {why}", wall_s=h.wall_s)
        group.records[i] = RolloutRecord(failed, [])
    lost = int(np.sum(~keep))
    if lost and getattr(group, "advantages", None) is not None:
        group.advantages = group.advantages[keep]
    return lost


@dataclass(frozen=True)
class Expired:
    group: Group
    kind: Failure
    why: str


class GroupTracker:
    def __init__(self, max_off_policy_steps: int, group_timeout_s: float) -> None:
        self.max_off_policy_steps, self.group_timeout_s = max_off_policy_steps, group_timeout_s
        self.inflight: dict[str, Group] = {}
        self.by_rid: dict[str, Group] = {}
        self.counts: Counter[str] = Counter()
        self.failed: Counter[Failure] = Counter()  # a rollout without a kind counts as env_error

    @property
    def inflight_rollouts(self) -> int:
        return sum(len(g.missing) for g in self.inflight.values())

    def open(self, group: Group) -> None:
        group.missing = set(group.rids)
        self.inflight[group.gid] = group
        for rid in group.rids:
            self.by_rid[rid] = group

    def record(self, record: RolloutRecord) -> tuple[Group | None, bool]:
        """Take one finished rollout: (its group, whether the group is now complete); (None, False) for a
        straggler of a group that ended already (counted ``late``)."""
        h = record.header
        group = self.by_rid.pop(h.rid, None)
        if group is None or h.rid not in group.missing:
            self.counts["late"] += 1
            return None, False
        h.env, h.task, h.policy_step = group.env, group.task, group.policy  # ours, whatever the worker said
        # every token it has was sampled after its assignment (policy_step) and before now: no newer weights than
        # a sync begun on its server by now (the upper bound of its bounded versions: columns/versions.py)
        h.policy_max = max(group.policy, group.server.ceiling)
        group.missing.discard(h.rid)
        group.records.append(record)
        if record.ok:
            self.counts["completed"] += 1
        else:
            self.failed[h.failure or Failure.ENV] += 1
        if group.missing:
            return group, False
        del self.inflight[group.gid]
        return group, True

    def fail(self, group: Group, rid: str, kind: Failure, why: str) -> tuple[Group | None, bool]:
        """Fail one missing rollout of ``group`` (lost worker, cancellation)."""
        base = AssignedRollout(rid, group.gid, group.env, group.task, group.policy, group.worker, group.server.url)
        return self.record(RolloutRecord(RolloutHeader.failed(base, kind, why), []))

    def expire(self, now: float, policy: int) -> list[Expired]:
        """In-flight groups that must end now (their missing rollouts are not failed yet: ``fail`` them)."""
        limit = policy - self.max_off_policy_steps
        out = []
        for group in self.inflight.values():
            if group.policy < limit and group.eval_round is None:  # an evaluation keeps its policy: see eval
                out.append(Expired(group, Failure.STALE, f"sampled with policy {group.policy}, now {policy}"))
                self.counts["cancelled"] += len(group.missing)
            elif now - group.started > self.group_timeout_s:
                out.append(Expired(group, Failure.GROUP_TIMEOUT, f"running for more than {self.group_timeout_s:g} s"))
        return out

    def shed(self, server: str, n: int, why: str) -> list[Expired]:
        """In-flight groups on ``server`` to cancel for at least ``n`` of their rollouts: whole groups, those not
        yet half done, youngest first (their missing rollouts are not failed yet: ``fail`` them). Fewer when not
        enough such groups run there: a group half done is let finish, and so is the server's oldest group (one
        group always runs: cancelling the last would only open another)."""
        here = sorted((g for g in self.inflight.values() if g.server.url == server), key=lambda g: g.started)
        young = [g for g in reversed(here[1:]) if len(g.records) * 2 < g.size]
        out: list[Expired] = []
        for group in young:
            if n <= 0:
                break
            out.append(Expired(group, Failure.KV_PRESSURE, why))
            self.counts["cancelled"] += len(group.missing)
            n -= group.size  # the server holds whole groups: cancelling one frees all of its slots
        return out

    def take_counts(self) -> dict[str, Any]:
        """The counts since the last call, as metrics.jsonl names them: failures as ``failed:<kind>``."""
        out: dict[str, Any] = {**self.counts, **{f"failed:{kind}": n for kind, n in self.failed.items()}}
        self.counts.clear()
        self.failed.clear()
        return out


class Buffer:
    """Finished training groups that passed the gates, in completion order, until a step takes them. Bounded by
    admission (admission.py): no training group opens while in flight + ``rollouts`` + the group would exceed
    ``scheduler.max_buffered_rollouts``, so a buffer no step empties pauses generation."""

    def __init__(self) -> None:
        self.groups: deque[Group] = deque()
        self.rollouts = 0  # the survivors of ``groups``

    def __bool__(self) -> bool:
        return bool(self.groups)

    def put(self, group: Group) -> None:
        self.groups.append(group)
        self.rollouts += len(group.survivors)

    def take(self) -> Group:
        """The oldest group (there must be one)."""
        group = self.groups.popleft()
        self.rollouts -= len(group.survivors)
        return group

    def remove(self, group: Group) -> None:
        """Take ``group`` out without a step (dropped: it lost its columns)."""
        self.groups.remove(group)
        self.rollouts -= len(group.survivors)
