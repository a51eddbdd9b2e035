"""Rollout filters: which rollouts of a step are not trained on, and which only get counted.

Each ``[[pipeline.filters]]`` table names a filter, whether it is enforced (matched rollouts are dropped
from the batch) or monitor-only (matched rollouts are counted and marked, and still trained on), and its
arguments. Built in:

- ``zero_advantage`` (enforced by default): the rollout's advantage is within ``tolerance`` (1e-6) of 0, so
  it carries no gradient (a group of equal non-binary rewards has advantages of about 1e-17, not 0). It never
  matches a rollout of an env that distils (``distilling``): the teacher's term carries its gradient.
- ``gibberish`` (monitor-only by default): a sampled token with id > ``token_id_threshold`` (a rare token)
  sampled at logprob < -ln(vocab_size) - ``logprob_offset`` (below uniform: high entropy). The rule is the
  one prime-rl's gibberish detector uses; this is an independent vectorised implementation.
- ``repetition`` (monitor-only by default): ``window`` consecutive sampled tokens each sampled with
  probability > ``prob_threshold``: the signature of a repetition loop (arXiv 2506.13585, section 3.2).

A custom filter is ``module:function`` called as ``fn(rollout, advantage, **args) -> bool``.
All token work is numpy over whole arrays: no per-token Python loop.

The direct data plane: the orchestrator has no column bytes, so the token filters
(``TOKEN_FILTERS``) run in the env worker that built the samples (``token_filter``, the same functions), which
reports the indices of the ``[[pipeline.filters]]`` tables its rollout matched (``RolloutHeader.filters``);
``FilterSet(..., in_worker=True)`` reads those instead of the tokens, and enforce/monitor and the counts work
as for every filter. Custom filters cannot run there (not built: ``on = "worker"``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from orchestrator.errors import ConfigError
from orchestrator.scoring.config import FilterConfig
from orchestrator.scoring.gates import take_by_name_and_env
from orchestrator.scoring.hooks import import_hook


class Filterable(Protocol):
    """What a filter sees of a rollout: its env and its sampled tokens (all turns, in order)."""

    @property
    def env(self) -> str: ...

    def sampled(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, logprobs) of the tokens the policy sampled, in order."""
        ...


def longest_run(flags: np.ndarray) -> int:
    """Length of the longest run of True in a 1-D boolean array."""
    if flags.size == 0:
        return 0
    padded = np.concatenate(([False], flags.astype(bool), [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return int((edges[1::2] - edges[::2]).max()) if edges.size else 0


def is_gibberish(token_ids: np.ndarray, logprobs: np.ndarray, *, vocab_size: int,
                 token_id_threshold: int = 100_000, logprob_offset: float = 2.0) -> bool:
    floor = -math.log(vocab_size) - logprob_offset
    return bool(np.any((token_ids > token_id_threshold) & (logprobs < floor)))


def is_repetition(logprobs: np.ndarray, *, window: int = 3000, prob_threshold: float = 0.99) -> bool:
    return longest_run(logprobs > math.log(prob_threshold)) >= window


@dataclass(frozen=True)
class FilterVerdict:
    matched: tuple[str, ...]  # names of every filter that matched, enforced or not
    filtered: bool  # an enforced filter matched: not trained on


TOKEN_FILTERS = ("gibberish", "repetition")  # the built-in filters that read sampled tokens


def token_filter(name: str, args: dict[str, Any]) -> Callable[[np.ndarray, np.ndarray], bool]:
    """Built-in token filter ``name`` over (sampled token ids, their logprobs); TypeError for bad arguments."""
    if name == "gibberish":
        is_gibberish(np.zeros(0, np.int32), np.zeros(0, np.float32), **args)  # checks the names
        return lambda ids, logprobs: is_gibberish(ids, logprobs, **args)
    if name == "repetition":
        is_repetition(np.zeros(0, np.float32), **args)
        return lambda _ids, logprobs: is_repetition(logprobs, **args)
    raise ValueError(f"{name!r} is not a token filter ({', '.join(TOKEN_FILTERS)})")


def token_filter_args(f: FilterConfig, vocab_size: int) -> dict[str, Any]:
    """A token filter's arguments as it runs: gibberish gets the model's ``vocab_size`` unless it names one."""
    args = dict(f.args)
    if f.name == "gibberish":
        args.setdefault("vocab_size", vocab_size)
    return args


class FilterSet:
    """The configured filters, applied to one rollout at a time; keeps counts per filter per env. ``in_worker``
    (direct mode): token filters read what the env worker reported (the rollout's ``worker_filters``: indices of
    the filters it matched) instead of the tokens, and custom filters, which may read tokens, are not applied
    (``skipped`` names them)."""

    def __init__(self, filters: Sequence[FilterConfig], vocab_size: int, *, in_worker: bool = False,
                 distilling: Iterable[str] = ()) -> None:
        self._filters: list[tuple[str, bool, Callable[[Filterable, float], bool]]] = []
        exempt = frozenset(distilling)
        self.skipped: list[str] = []
        for i, f in enumerate(filters):
            if in_worker and f.name in TOKEN_FILTERS:
                fn = self._reported(i)
            elif in_worker and f.name != "zero_advantage":
                self.skipped.append(f.name)
                continue
            else:
                fn = self._build(f, i, vocab_size)
            if f.name == "zero_advantage" and exempt:
                fn = _unless(exempt, fn)
            self._filters.append((f.name, f.enforce, fn))
        self.counts: Counter[tuple[str, str]] = Counter()  # (filter, env) -> matched rollouts

    @staticmethod
    def _reported(i: int) -> Callable[[Filterable, float], bool]:
        return lambda r, _adv: i in getattr(r, "worker_filters", ())

    @staticmethod
    def _build(f: FilterConfig, i: int, vocab_size: int) -> Callable[[Filterable, float], bool]:
        args: dict[str, Any] = dict(f.args)
        key = f"pipeline.filters[{i}]"
        try:
            if f.name == "zero_advantage":
                tolerance = float(args.pop("tolerance", 1e-6))
                if args:
                    raise TypeError(f"takes only tolerance, got {sorted(args)}")
                return lambda _r, adv: abs(adv) <= tolerance
            if f.name in TOKEN_FILTERS:
                fn_tokens = token_filter(f.name, token_filter_args(f, vocab_size))
                return lambda r, _adv: fn_tokens(*r.sampled())
        except TypeError as e:
            raise ConfigError([f"{key}.args: bad arguments for filter {f.name!r}: {e}"]) from None
        fn = import_hook(f.name, f"{key}.name")
        return lambda r, adv: bool(fn(r, adv, **args))

    def __call__(self, rollout: Filterable, advantage: float) -> FilterVerdict:
        matched: list[str] = []
        filtered = False
        for name, enforce, fn in self._filters:
            if fn(rollout, advantage):
                matched.append(name)
                filtered |= enforce
                self.counts[(name, rollout.env)] += 1
        return FilterVerdict(tuple(matched), filtered)

    def take_counts(self) -> dict[str, dict[str, int]]:
        """Counts since the last call, as {filter: {env: matched}}; resets them."""
        return take_by_name_and_env(self.counts)


def _unless(envs: frozenset[str], fn: Callable[[Filterable, float], bool]) -> Callable[[Filterable, float], bool]:
    """``fn``, never matching a rollout of ``envs``."""
    return lambda r, adv: r.env not in envs and fn(r, adv)

