"""One step boundary: advantages, filters, rollout rows and the batch, from the step's finished groups.

``StepBuilder.build`` is blocking numpy work: the orchestrator calls it in a worker thread, never on the
event loop. Column bytes are copied exactly once, when each column is concatenated into the batch.
Rollout records come from env workers (see worker/protocol.py); a rollout's frames hold all its samples.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from orchestrator.config import JobConfig
from orchestrator.pipeline.advantage import AdvantageFn
from orchestrator.pipeline.filters import FilterSet
from orchestrator.transport.wire import ROUTED, TOKEN_COLUMNS, Batch
from orchestrator.worker.protocol import RolloutRecord

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    batch: Batch
    rows: list[dict[str, Any]]
    phase_s: dict[str, float]
    filter_counts: dict[str, dict[str, int]]


class StepBuilder:
    def __init__(self, cfg: JobConfig, vocab_size: int) -> None:
        self.run = cfg.run.name
        self.advantage = AdvantageFn(cfg.pipeline)
        self.vocab_size = vocab_size
        self.filters = FilterSet(cfg.pipeline.filters, vocab_size)

    def build(self, step: int, groups: Sequence[Any], dropped: Sequence[Any] = ()) -> StepResult:
        """All three phases in order, each timed in ``phase_s``; the rows of ``dropped`` groups (none of whose
        rollouts train) come after the step's own."""
        phase: dict[str, float] = {}
        t = time.perf_counter()
        advantages = self.advantages(groups)
        phase["advantage"] = time.perf_counter() - t

        t = time.perf_counter()
        rows, trained = self.filter(step, groups, advantages)
        rows += dropped_rows(step, dropped)
        phase["filter"] = time.perf_counter() - t

        t = time.perf_counter()
        batch = self.assemble(step, trained)
        phase["assemble"] = time.perf_counter() - t
        return StepResult(batch, rows, phase, self.filters.take_counts())

    # The phases of ``build``, public so replay (scripts/perf) can run and time them one at a time.

    def advantages(self, groups: Sequence[Any]) -> list[np.ndarray]:
        """Phase ``advantage``: one array per group, over its survivors (the scheduler's, computed when the
        group completed for its gates, when it has them)."""
        out = []
        for g in groups:
            adv = getattr(g, "advantages", None)
            out.append(adv if adv is not None else self.advantage(g.survivors))
        return out

    def filter(self, step: int, groups: Sequence[Any], advantages: Sequence[np.ndarray]
               ) -> tuple[list[dict[str, Any]], list[tuple[RolloutRecord, float]]]:
        """Phase ``filter``: every rollout's row (failed ones included) and the (record, advantage) pairs
        to train on. Filter counts accumulate until ``filters.take_counts()``."""
        rows: list[dict[str, Any]] = []
        trained: list[tuple[RolloutRecord, float]] = []
        for g, adv in zip(groups, advantages, strict=True):
            rows += [failed_row(step, g, r) for r in g.records if not r.ok]
            for rec, a in zip(g.survivors, adv.tolist(), strict=True):
                verdict = self.filters(rec, a)
                if not verdict.filtered:
                    trained.append((rec, a))
                rows.append(survivor_row(step, g, rec, a, list(verdict.matched), verdict.filtered))
        return rows, trained

    def assemble(self, step: int, trained: Sequence[tuple[RolloutRecord, float]]) -> Batch:
        """Phase ``assemble``: concatenate every trained rollout's column frames once; scalars per sample."""
        lengths: list[int] = []
        scalars: dict[str, list[Any]] = {"advantage": [], "reward": [], "env": [], "rollout": []}
        tails = {s[1:] for rec, _ in trained for s in rec.header.samples}
        with_routed = len(tails) == 1 and (0, 0) not in tails
        if len(tails) > 1:
            log.warning("step %d: routed-expert shapes differ across rollouts %s; the batch carries none",
                        step, sorted(tails))
        chunks: dict[str, list[np.ndarray]] = {name: [] for name in TOKEN_COLUMNS}
        if with_routed:
            chunks[ROUTED] = []
        for rec, adv in trained:
            shapes = rec.header.samples
            if not shapes:
                continue
            for name in TOKEN_COLUMNS:
                chunks[name].append(rec.column(name))
            if with_routed:
                chunks[ROUTED].append(rec.column(ROUTED).reshape(rec.tokens, *shapes[0][1:]))
            for s in shapes:
                lengths.append(s[0])
                scalars["advantage"].append(adv)
                scalars["reward"].append(rec.reward)
                scalars["env"].append(rec.env)
                scalars["rollout"].append(rec.rid)
        return Batch.from_columns(self.run, step, chunks, lengths, scalars)


def failed_row(step: int, g: Any, r: RolloutRecord, dropped: bool = False) -> dict[str, Any]:
    """The row of a failed rollout of group ``g``: why it failed (``failure``, ``error``), no reward."""
    h = r.header
    return {"step": step, "env": g.env, "task": g.task, "group": g.gid, "rollout": r.rid, "reward": 0.0,
            "advantage": None, "ok": False, "filters": [], "filtered": False, "dropped": dropped,
            "failure": h.failure, "error": h.error, "tokens": 0, "policy": g.policy, "off_policy": step - g.policy,
            "stop": h.stop, "wall_s": h.wall_s, "worker": h.worker}


def survivor_row(step: int, g: Any, rec: RolloutRecord, advantage: float | None, filters: list[str],
                 filtered: bool, dropped: bool = False) -> dict[str, Any]:
    """The row of a rollout that came back with a reward (``advantage`` None: its group was dropped)."""
    h = rec.header
    return {"step": step, "env": g.env, "task": g.task, "group": g.gid, "rollout": h.rid, "reward": rec.reward,
            "advantage": advantage, "ok": True, "filters": filters, "filtered": filtered, "dropped": dropped,
            "failure": None, "error": None, "tokens": h.tokens, "samples": len(h.samples), "turns": h.turns,
            "policy": g.policy, "off_policy": step - g.policy, "metrics": h.metrics, "stop": h.stop,
            "wall_s": h.wall_s, "worker": h.worker}


def dropped_rows(step: int, groups: Sequence[Any]) -> list[dict[str, Any]]:
    """Rows of dropped groups (all failed, or group scoring with a failure), ``"dropped": true``: nothing of
    them trains, their failures say why."""
    return [failed_row(step, g, r, dropped=True) if not r.ok
            else survivor_row(step, g, r, None, [], filtered=False, dropped=True)
            for g in groups for r in g.records]
