"""One step boundary: advantages, filters, rollout rows and the batch, from the step's finished groups.

``StepBuilder.build`` is blocking numpy work: the orchestrator calls it in a worker thread, never on the
event loop. Column bytes are copied exactly once, when each column is concatenated into the batch.
Rollout records come from env workers (see contracts/protocol.py); a rollout's frames hold all its samples.

The direct data plane builds a manifest instead of the batch, with the same ``rows`` and ``result``
(dataplane/direct.py). ``trained`` lists the rollouts a step names; ``untrained`` the survivors it leaves out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
from msgspec import UNSET, UnsetType

from orchestrator.columns.layout import ROUTED, column_names, shared_optional
from orchestrator.columns.versions import mask_older
from orchestrator.contracts.manifest import StepManifest
from orchestrator.contracts.protocol import RolloutRecord
from orchestrator.contracts.rows import RolloutRow, dropped_rows
from orchestrator.contracts.wire import Batch, LogprobsMode
from orchestrator.rollouts.config import EnvConfig
from orchestrator.scoring.advantage import AdvantageFn
from orchestrator.scoring.config import PipelineConfig
from orchestrator.scoring.filters import FilterSet
from orchestrator.scoring.token_lag import LAG_FILTER, TokenLag

log = logging.getLogger(__name__)

B = TypeVar("B", Batch, StepManifest)


@dataclass
class StepResult(Generic[B]):
    batch: B  # what the sender sends: a Batch, or a StepManifest (dataplane/direct.py)
    rows: list[RolloutRow]
    phase_s: dict[str, float]
    filter_counts: dict[str, dict[str, int]]
    untrained: list[RolloutRecord] = field(default_factory=list)  # survivors left out: never read
    trained: list[RolloutRecord] = field(default_factory=list)  # the rollouts the step carries
    versions: dict[str, Any] = field(default_factory=dict)  # its tokens' versions (scoring/token_lag.py stats)

    @property
    def num_samples(self) -> int:
        return self.batch.num_samples if isinstance(self.batch, Batch) else len(self.batch.samples)


class StepBuilder:
    def __init__(self, pipeline: PipelineConfig, envs: Sequence[EnvConfig], run: str, vocab_size: int,
                 logprobs_mode: LogprobsMode | None = None) -> None:
        self.run = run
        # what every batch tells the trainer: which logprobs it holds (settled by preflight), and each sample's
        # sampling temperature (its env's), which a trainer recomputing processed logprobs needs
        self.logprobs_mode = logprobs_mode
        self.temperatures = {e.label: e.sampling.temperature for e in envs}
        self.advantage = AdvantageFn(pipeline)
        self.vocab_size = vocab_size
        self.filter_configs = pipeline.filters
        self.filters = FilterSet(pipeline.filters, vocab_size)
        self.lag = TokenLag({e.label: e.max_token_lag for e in envs})

    def build(self, step: int, groups: Sequence[Any], dropped: Sequence[Any] = ()) -> StepResult[Batch]:
        """All three phases in order, each timed in ``phase_s``; the rows of ``dropped`` groups (none of whose
        rollouts train) come after the step's own."""
        rows, trained, phase = self.rows(step, groups, dropped)
        t = time.perf_counter()
        batch = self.assemble(step, trained)
        phase["assemble"] = time.perf_counter() - t
        return self.result(batch, rows, phase, groups, trained)

    def rows(self, step: int, groups: Sequence[Any], dropped: Sequence[Any], filters: FilterSet | None = None
             ) -> tuple[list[RolloutRow], list[tuple[RolloutRecord, float]], dict[str, float]]:
        """Phases ``advantage`` and ``filter`` (``filters``, or the configured ones), timed: every rollout's row
        (the ``dropped`` groups' after the step's own), the (record, advantage) pairs to train on."""
        phase: dict[str, float] = {}
        t = time.perf_counter()
        advantages = self.advantages(groups)
        phase["advantage"] = time.perf_counter() - t

        t = time.perf_counter()
        rows, trained = self.filter(step, groups, advantages, filters)
        rows += dropped_rows(step, dropped)
        phase["filter"] = time.perf_counter() - t
        return rows, trained, phase

    def result(self, batch: B, rows: list[RolloutRow], phase: dict[str, float], groups: Sequence[Any],
               trained: list[tuple[RolloutRecord, float]], filters: FilterSet | None = None) -> StepResult[B]:
        """The built step; the counts of ``filters`` (or the configured ones) since the last step's."""
        kept = {id(rec) for rec, _ in trained}
        untrained = [r for g in groups for r in g.survivors if id(r) not in kept]
        counts = (filters or self.filters).take_counts()
        lagged = {row.rollout for row in rows if row.filtered and LAG_FILTER in row.filters}
        versions = self.lag.stats(batch.step, [rec.header for rec, _ in trained]
                                  + [r.header for r in untrained if r.rid in lagged])
        return StepResult(batch, rows, phase, counts, untrained, [rec for rec, _ in trained], versions)

    # The phases of ``build``, public so replay (scripts/perf) can run and time them one at a time.

    def advantages(self, groups: Sequence[Any]) -> list[np.ndarray]:
        """Phase ``advantage``: one array per group, over its survivors (the scheduler's, computed when the
        group completed for its gates, when it has them)."""
        out = []
        for g in groups:
            adv = getattr(g, "advantages", None)
            out.append(adv if adv is not None else self.advantage(g.survivors))
        return out

    def filter(self, step: int, groups: Sequence[Any], advantages: Sequence[np.ndarray],
               filters: FilterSet | None = None) -> tuple[list[RolloutRow], list[tuple[RolloutRecord, float]]]:
        """Phase ``filter``: every rollout's row (failed ones included) and the (record, advantage) pairs
        to train on. Filter counts accumulate until ``filters.take_counts()``. A rollout its env's
        ``max_token_lag`` leaves no trained token (token_lag.py) is filtered too, by ``max_token_lag``."""
        rows: list[RolloutRow] = []
        trained: list[tuple[RolloutRecord, float]] = []
        for g, adv in zip(groups, advantages, strict=True):
            rows += [RolloutRow.failed(step, g, r) for r in g.records if not r.ok]
            for rec, a in zip(g.survivors, adv.tolist(), strict=True):
                verdict = (filters or self.filters)(rec, a)
                matched, filtered = list(verdict.matched), verdict.filtered
                masked: int | UnsetType = UNSET  # only with the limit
                if not filtered and rec.header.samples and self.lag.floor(rec.env, step) is not None:
                    plan = self.lag.plan(rec.header, step)
                    masked = plan.masked
                    if not any(plan.keep):
                        matched, filtered = [*matched, LAG_FILTER], True
                if not filtered:
                    trained.append((rec, a))
                rows.append(RolloutRow.survivor(step, g, rec, a, matched, filtered, masked_tokens=masked))
        return rows, trained

    def assemble(self, step: int, trained: Sequence[tuple[RolloutRecord, float]]) -> Batch:
        """Phase ``assemble``: concatenate every trained rollout's column frames once; scalars per sample. The
        batch has the optional columns every trained rollout has (columns/layout.py), and routed experts when they
        all have the same routed shape. A sample ``max_token_lag`` leaves no trained token is left out, and the
        loss mask is 0 on every token older than its sample's ``min_version`` (token_lag.py)."""
        lengths: list[int] = []
        scalars: dict[str, list[Any]] = {"advantage": [], "reward": [], "env": [], "rollout": [], "temperature": [],
                                         "policy": [], "policy_max": [], "min_version": []}
        tails = {s[1:] for rec, _ in trained for s in rec.header.samples}
        if len(tails) > 1:
            log.warning("step %d: routed-expert shapes differ across rollouts %s; the batch carries none",
                        step, sorted(tails))
        names = list(column_names(shared_optional(rec.header.optional for rec, _ in trained if rec.header.samples)))
        if not (len(tails) == 1 and (0, 0) not in tails):
            names.remove(ROUTED)
        chunks: dict[str, list[np.ndarray]] = {name: [] for name in names}
        for rec, adv in trained:
            h = rec.header
            if not h.samples:
                continue
            plan = self.lag.plan(h, step)
            columns = {name: rec.column(name).reshape(rec.tokens, *h.samples[0][1:]) if name == ROUTED
                       else rec.column(name) for name in names}
            if plan.floor is not None:  # its own versions say which tokens to mask, whatever the step carries
                columns["loss_mask"] = mask_older(columns["loss_mask"], rec.column("versions"),
                                                  np.array([0, rec.tokens]), [plan.floor])
            kept = [(at, s) for at, s, keep in zip(_starts(h.samples), h.samples, plan.keep, strict=True) if keep]
            for name, column in columns.items():
                if len(kept) == len(h.samples):
                    chunks[name].append(column)  # the whole rollout: one chunk, as its frame came
                else:
                    chunks[name] += [column[at:at + s[0]] for at, s in kept]
            for _, s in kept:
                lengths.append(s[0])
                scalars["advantage"].append(adv)
                scalars["reward"].append(rec.reward)
                scalars["env"].append(rec.env)
                scalars["rollout"].append(rec.rid)
                scalars["temperature"].append(self.temperatures.get(rec.env, 1.0))
                scalars["policy"].append(h.policy_step)
                scalars["policy_max"].append(h.policy_step if h.policy_max is None else h.policy_max)
                scalars["min_version"].append(plan.floor)
        return Batch.from_columns(self.run, step, chunks, lengths, scalars, self.logprobs_mode)


def _starts(shapes: Sequence[tuple[int, int, int]]) -> list[int]:
    """Each sample's first token in its rollout's columns."""
    out, at = [], 0
    for tokens, _, _ in shapes:
        out.append(at)
        at += tokens
    return out
