"""Per-group advantages.

The default is the reward minus the group's mean reward, optionally divided by the group's reward std
(``pipeline.std_normalize``). A custom function is named ``module:function`` in ``pipeline.advantage``
and called as ``fn(group, **pipeline.advantage_kwargs) -> list[float]`` with the group's rollouts (each
has at least ``reward``, ``env``, ``task``). Whatever the function, a group of one rollout gets advantage 0
(there is nothing to compare it with), and a result of the wrong length or with a non-finite value is an
error naming the function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from orchestrator.scoring.config import PipelineConfig
from orchestrator.scoring.hooks import import_hook


class Scored(Protocol):
    @property
    def reward(self) -> float: ...


def group_mean_advantage(rewards: np.ndarray, std_normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    """Reward minus the group mean (divided by the std when asked); zeros for a group of one."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.size <= 1:
        return np.zeros(rewards.size, dtype=np.float64)
    adv = rewards - rewards.mean()
    if std_normalize:
        adv /= rewards.std() + eps
    return np.asarray(adv, dtype=np.float64)


class AdvantageFn:
    """The configured advantage function, applied one group at a time."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self._std = cfg.std_normalize
        self._custom: Callable[..., Any] | None = None
        self._kwargs = dict(cfg.advantage_kwargs)
        if cfg.advantage != "default":
            self._custom = import_hook(cfg.advantage, "pipeline.advantage")
            self.name = cfg.advantage
        else:
            self.name = "default"

    def __call__(self, group: Sequence[Scored]) -> np.ndarray:
        n = len(group)
        if n <= 1:
            return np.zeros(n, dtype=np.float64)
        if self._custom is None:
            rewards = np.fromiter((r.reward for r in group), dtype=np.float64, count=n)
            return group_mean_advantage(rewards, self._std)
        out = np.asarray(self._custom(list(group), **self._kwargs), dtype=np.float64)
        if out.shape != (n,):
            raise ValueError(f"advantage function {self.name} returned shape {out.shape} for a group of {n}")
        if not np.isfinite(out).all():
            raise ValueError(f"advantage function {self.name} returned a non-finite value: {out.tolist()}")
        return out
