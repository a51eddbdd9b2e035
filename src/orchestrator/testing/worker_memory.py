"""Env worker memory per rollout, read from a run's per-step metrics, for the worker-RSS soak and its test.

Every step's metrics carry, per env worker, the rollouts it completed during the step and the RSS its last
heartbeat reported (``scheduler.workers.<name>.rollouts`` / ``.rss_mb``). ``worker_rss_series`` turns them
into (rollouts completed so far, RSS) points per worker; ``rss_growth`` compares the median RSS of the first
and last thirds of the points after a warm-up (medians: one heartbeat caught mid-rollout, or a heap not yet
given back, moves a single point, not the result). The x axis is rollouts, not time: memory per rollout is
the same on a busy machine as on a quiet one.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RssGrowth:
    """One worker's RSS between the first and last thirds of its points after warm-up."""

    worker: str
    points: int
    rollouts: float  # between the two thirds' medians
    start_mb: float  # median RSS of the first third
    end_mb: float  # median RSS of the last third
    slope_mb_per_100: float  # least squares over every point after warm-up

    @property
    def growth_mb(self) -> float:
        return self.end_mb - self.start_mb

    @property
    def mb_per_100(self) -> float:
        """Growth per 100 rollouts between the two thirds."""
        return self.growth_mb / self.rollouts * 100 if self.rollouts > 0 else 0.0


def worker_rss_series(metrics: Iterable[Mapping[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Per worker, one (rollouts completed so far, RSS MB) point per step whose metrics have its RSS."""
    done: dict[str, int] = {}
    series: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        for name, w in m.get("scheduler", {}).get("workers", {}).items():
            done[name] = done.get(name, 0) + int(w.get("rollouts") or 0)
            if w.get("rss_mb") is not None:
                series.setdefault(name, []).append((done[name], float(w["rss_mb"])))
    return series


def rss_growth(worker: str, points: list[tuple[int, float]], warmup_rollouts: int) -> RssGrowth | None:
    """The growth of ``worker``'s RSS past ``warmup_rollouts`` (None with fewer than 6 points after it)."""
    after = [p for p in points if p[0] >= warmup_rollouts]
    if len(after) < 6:
        return None
    third = len(after) // 3
    first, last = after[:third], after[-third:]
    x = np.array([p[0] for p in after], dtype=float)
    y = np.array([p[1] for p in after], dtype=float)
    slope = float(np.polyfit(x, y, 1)[0]) * 100 if np.ptp(x) > 0 else 0.0
    return RssGrowth(worker, len(after),
                     rollouts=statistics.median(p[0] for p in last) - statistics.median(p[0] for p in first),
                     start_mb=statistics.median(p[1] for p in first), end_mb=statistics.median(p[1] for p in last),
                     slope_mb_per_100=slope)
