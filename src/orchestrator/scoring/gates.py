"""Gates (dynamic sampling): which completed groups count toward a step.

A gate runs when a training group completes, before it counts: a rejected group does not count, and the
step keeps filling with later groups (refill), so a step never trains on fewer samples because its groups
taught nothing. ``[[pipeline.gates]]`` tables, all of which must accept a group (an empty list accepts all):

- ``zero_advantage`` (default on; ``tolerance = 1e-6``): rejects a group whose every advantage is within
  ``tolerance`` of 0: it carries no gradient. A tolerance, not ``== 0``: a group of equal non-binary
  rewards has advantages of about 1e-17, not 0. It never rejects a group of an env that distils (``distilling``:
  algorithm 'opd' or 'reward+opd'): the teacher's term carries a gradient whatever the advantages.
- ``reward_range`` (``min``, ``max``): rejects a group whose mean reward is outside [min, max] (e.g. keep
  only tasks the policy solves sometimes).
- ``advantage_range`` (``min``, ``max``): rejects a group whose every advantage lies inside [min, max].
- ``module:function``: ``fn(group, **args) -> bool`` (True keeps it) with ``group.env``, ``.task``,
  ``.policy``, ``.rewards`` and ``.advantages`` (lists over the group's successful rollouts).

``envs`` limits a gate to some environments. Gates run on the event loop, per group, on a handful of
numbers: a custom gate must be cheap. Rejections are counted per gate and env (``counts``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from orchestrator.configbase import Source, opt
from orchestrator.errors import ConfigError
from orchestrator.scoring.hooks import import_hook

GateFn = Callable[["GroupView"], bool]  # True: keep


@dataclass(frozen=True, kw_only=True)
class GateConfig:
    name: str = opt(doc="'zero_advantage', 'reward_range', 'advantage_range', or module:function(group, **args)")
    args: dict[str, Any] = opt({}, doc="arguments of the gate (zero_advantage: tolerance; ranges: min, max)")
    envs: tuple[str, ...] = opt((), doc="environments it applies to (names); empty: all")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        try:
            build_gate(self, key)
        except ConfigError as e:
            yield from (f"{source(key)}: {p}" for p in e.problems)


DEFAULT_GATES = (GateConfig(name="zero_advantage"),)


@dataclass(frozen=True)
class GroupView:
    """What a gate sees of a completed group."""

    env: str
    task: int
    policy: int
    rewards: list[float]
    advantages: list[float]


def build_gate(cfg: GateConfig, key: str) -> GateFn:
    """The gate ``cfg`` names; ConfigError naming ``key`` for an unknown gate or arguments it does not take."""
    args = dict(cfg.args)
    bounds = {"min": -math.inf, "max": math.inf}
    try:
        if cfg.name == "zero_advantage":
            tolerance = float(args.pop("tolerance", 1e-6))
            _no_more(args)
            return lambda g: not all(abs(a) <= tolerance for a in g.advantages)
        if cfg.name in ("reward_range", "advantage_range"):
            lo, hi = (float(args.pop(k, bounds[k])) for k in ("min", "max"))
            _no_more(args)
            if lo > hi:
                raise ValueError(f"min {lo} > max {hi}")
            if cfg.name == "reward_range":
                return lambda g: lo <= float(np.mean(g.rewards)) <= hi if g.rewards else False
            return lambda g: not all(lo <= a <= hi for a in g.advantages)
    except (TypeError, ValueError) as e:
        raise ConfigError([f"{key}.args: bad arguments for gate {cfg.name!r}: {e}"]) from None
    fn = import_hook(cfg.name, f"{key}.name")
    return lambda g: bool(fn(g, **args))


def _no_more(args: dict[str, Any]) -> None:
    if args:
        raise TypeError(f"unexpected arguments {sorted(args)}")


class Gates:
    """The configured gates, applied to one completed group at a time."""

    def __init__(self, gates: Sequence[GateConfig], distilling: Iterable[str] = ()) -> None:
        exempt = frozenset(distilling)  # envs zero_advantage does not apply to (see the module docstring)
        self._gates = [(g.name, set(g.envs), build_gate(g, f"pipeline.gates[{i}]"),
                        exempt if g.name == "zero_advantage" else frozenset()) for i, g in enumerate(gates)]
        self.counts: Counter[tuple[str, str]] = Counter()  # (gate, env) -> groups rejected

    def __call__(self, group: GroupView) -> str | None:
        """The name of the first gate that rejects ``group``; None when every gate keeps it."""
        for name, envs, fn, exempt in self._gates:
            if (not envs or group.env in envs) and group.env not in exempt and not fn(group):
                self.counts[(name, group.env)] += 1
                return name
        return None

    def take_counts(self) -> dict[str, dict[str, int]]:
        """Rejections since the last call, as {gate: {env: groups}}."""
        return take_by_name_and_env(self.counts)


def take_by_name_and_env(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """``counts`` keyed (name, env) as {name: {env: n}}, then cleared (per-step counts of filters and gates)."""
    out: dict[str, dict[str, int]] = {}
    for (name, env), n in sorted(counts.items()):
        out.setdefault(name, {})[env] = n
    counts.clear()
    return out
