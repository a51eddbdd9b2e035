"""The simulated model: what a sim server samples from, and what loading weights changes.

``SimPolicy.sample(prompt_ids, sampling_params)`` is the one place tokens come from (a later change plugs a
small learnable policy in here). Today the token distribution ignores the prompt and depends only on how many
times weights were loaded (``loads``): every load is a different "model", so rollouts of different policies
differ. ``route(rows)`` draws the MoE routing of a sequence. Both draw from generators seeded at construction,
so a server's replies are deterministic under its seed for a given order of requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.sim.requests import SamplingParams
from orchestrator.sim.vocab import SimVocab


@dataclass(frozen=True)
class Sample:
    """One sampled completion, with what vLLM reports about it."""

    token_ids: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float64 [n]: each sampled token's logprob
    ranks: np.ndarray  # int64 [n]: each sampled token's rank in the distribution (1: the most likely)
    finish_reason: str  # "stop" or "length"
    stop_reason: int | None  # the stop token that ended it, None for the end-of-turn token or a length stop
    top_ids: np.ndarray  # int64 [k]: the k most likely ids (k = sampling_params.logprobs; -1: all), best first
    top_logprobs: np.ndarray  # float64 [k]


@dataclass(frozen=True)
class _Dist:
    probs: np.ndarray
    logprobs: np.ndarray
    order: np.ndarray  # ids, most likely first
    rank: np.ndarray  # id -> 1-based rank


@dataclass(frozen=True)
class Experts:
    """The MoE shape routed experts are drawn for."""

    layers: int
    top_k: int
    num_experts: int


class SimPolicy:
    def __init__(self, vocab: SimVocab, seed: int, experts: Experts | None = None) -> None:
        tokens_seed, routing_seed = np.random.SeedSequence(seed).spawn(2)
        self.vocab = vocab
        self.experts = experts
        self.weights_path: str | None = None  # the last directory loaded; None: the weights it started with
        self.loads = 0
        self._rng = np.random.default_rng(tokens_seed)
        self._routing_rng = np.random.default_rng(routing_seed)
        self._dists: dict[float, _Dist] = {}  # by temperature, for the weights loaded now

    def load(self, path: str | None) -> None:
        """Load weights from ``path`` (None: reload the current ones); the distribution changes either way."""
        if path is not None:
            self.weights_path = path
        self.loads += 1
        self._dists.clear()

    def sample(self, prompt_ids: Sequence[int], sp: SamplingParams) -> Sample:
        """Sample up to ``sp.max_tokens`` ids (all at once, then cut at the first stop token)."""
        del prompt_ids  # the simulated model ignores its prompt
        dist = self._dist(sp.temperature)
        ids = self._rng.choice(dist.probs.size, size=max(sp.max_tokens, 1), p=dist.probs)
        stops = set(sp.stop_token_ids) if sp.ignore_eos else {*sp.stop_token_ids, self.vocab.eos_id}
        hit = np.flatnonzero(np.isin(ids, list(stops)))
        finish, stop_reason = "length", None
        if hit.size:
            ids = ids[: hit[0] + 1]
            finish = "stop"
            stop_reason = None if int(ids[-1]) == self.vocab.eos_id else int(ids[-1])
        k = 0 if sp.logprobs is None else dist.order.size if sp.logprobs < 0 else max(sp.logprobs, 1)
        top = dist.order[:k]
        return Sample(ids.astype(np.int64), dist.logprobs[ids], dist.rank[ids], finish, stop_reason,
                      top, dist.logprobs[top])

    def route(self, rows: int) -> np.ndarray:
        """Expert ids ``[rows, layers, top_k]`` (distinct within a token's layer), as int64."""
        assert self.experts is not None
        e = self.experts
        first = self._routing_rng.integers(0, e.num_experts, (rows, e.layers, 1))
        stride = max(e.num_experts // e.top_k, 1)
        return (first + np.arange(e.top_k) * stride) % e.num_experts

    def _dist(self, temperature: float) -> _Dist:
        key = round(temperature, 6)
        dist = self._dists.get(key)
        if dist is None:
            probs = self.vocab.distribution(self.loads, temperature)
            order = np.argsort(-probs, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(1, order.size + 1)
            with np.errstate(divide="ignore"):
                logprobs = np.maximum(np.log(probs), -9999.0)  # vLLM floors logprobs at -9999.0
            dist = self._dists[key] = _Dist(probs, logprobs, order, rank)
        return dist
