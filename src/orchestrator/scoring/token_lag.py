"""Token-level staleness: which trained tokens of a step are older than their environment's ``max_token_lag``.

A token of step ``s`` is too old when the weights that sampled it are more than ``max_token_lag`` steps behind
``s``: its ``versions`` value (columns/versions.py) is below the floor ``s - max_token_lag``; a token whose version
is only bounded counts at its lower bound (it may be that old). Such tokens are masked out of the loss: the loss
mask the trainer gets has 0 there (the step's ``min_version`` scalar says which floor was applied). A sample left
with no trained token is dropped from the step, and a rollout left without samples is not trained (its row is
filtered, by ``max_token_lag``).

Everything here reads record headers only (``RolloutHeader.versions``: per sample, its trained tokens by value),
so both data planes decide the same way without reading columns; the mask itself is applied where the columns are
(the through plane's batch, the trainer library's views of a manifest). A rollout without the summary (a worker
without a versions column) is never masked. ``stats`` are the step's metrics: trained tokens by lag, exact and
bounded, samples that mix versions, what was masked and dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.columns.versions import NOT_SAMPLED

LAG_FILTER = "max_token_lag"  # the reason in a rollout's row, when the limit left it no trained token


@dataclass(frozen=True)
class LagPlan:
    """One rollout at one step: which samples keep trained tokens, and how many tokens are masked."""

    keep: list[bool]  # per sample (every one when its env has no limit)
    masked: int  # trained tokens below the floor (in kept and dropped samples)
    floor: int | None  # the lowest version kept; None: no limit (or nothing to apply it with: no versions)

    @property
    def dropped(self) -> int:
        return self.keep.count(False)


def lower(value: int) -> int:
    return -2 - value if value <= -2 else value


class TokenLag:
    """``limits``: each environment's ``max_token_lag`` (None: no limit)."""

    def __init__(self, limits: Mapping[str, int | None]) -> None:
        self.limits = dict(limits)

    def floor(self, env: str, step: int) -> int | None:
        limit = self.limits.get(env)
        return None if limit is None else step - limit

    def plan(self, header: Any, step: int) -> LagPlan:
        """``header``: a ``RolloutHeader`` with samples."""
        n = len(header.samples)
        floor = self.floor(header.env, step)
        if floor is None or len(header.versions) != n or "versions" not in header.optional:
            return LagPlan([True] * n, 0, None)  # no limit, or a rollout without versions: nothing to mask
        keep, masked = [], 0
        for counts in header.versions:
            total = sum(c for v, c in counts if v != NOT_SAMPLED)
            stale = sum(c for v, c in counts if v != NOT_SAMPLED and lower(v) < floor)
            masked += stale
            keep.append(stale < total or total == 0)
        return LagPlan(keep, masked, floor)

    def keep(self, header: Any, step: int) -> tuple[list[bool], int | None]:
        """``plan``'s samples kept and floor (what a step manifest's builder asks)."""
        plan = self.plan(header, step)
        return plan.keep, plan.floor

    def stats(self, step: int, trained: Sequence[Any]) -> dict[str, Any]:
        """The step's ``versions`` metrics over the trained rollouts' (headers') trained tokens."""
        by_lag: Counter[str] = Counter()
        exact = bounded = mixed = masked = dropped = 0
        for header in trained:
            plan = self.plan(header, step)
            masked += plan.masked
            dropped += plan.dropped
            for counts in header.versions:
                steps = {v for v, _ in counts if v >= 0}
                mixed += len(steps) > 1
                for v, c in counts:
                    if v >= 0:
                        exact += c
                        by_lag[str(step - v)] += c
                    elif v <= -2:
                        bounded += c
        return {"exact": exact, "bounded": bounded, "mixed_samples": mixed, "masked": masked,
                "dropped_samples": dropped, "by_lag": dict(sorted(by_lag.items(), key=lambda kv: int(kv[0])))}
