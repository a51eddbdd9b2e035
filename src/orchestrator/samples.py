"""Training samples built from a trace's message nodes: columnar, O(total tokens).

One sample per trainable root-to-leaf branch. Each node contributes a chunk per column (token ids,
loss mask, logprobs scattered to token positions, routed experts); each column is concatenated once,
so building a sample costs O(total tokens) however many turns it has, never a re-pack per turn.
Routed experts stay ``uint8 [tokens, layers, top_k]`` throughout.

Nodes are duck-typed (``token_ids``, ``mask``, ``logprobs``, ``routed_experts``), so this module works on
verifiers' ``MessageNode`` without importing verifiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class SampleError(ValueError):
    """A trace whose data is inconsistent (e.g. routed-expert rows != tokens); its rollout is dropped."""


class NodeLike(Protocol):
    token_ids: list[int]
    mask: list[bool]
    logprobs: list[float]
    routed_experts: Any


@dataclass
class PlainNode:
    """A message node without verifiers: what tests, benchmarks and other frameworks can build samples from."""

    token_ids: list[int]
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routed_experts: Any = None


@dataclass(frozen=True)
class Sample:
    token_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]: 1 where the policy sampled the token
    logprobs: np.ndarray  # float32 [T]: sampling logprob where loss_mask, else 0
    routed_experts: np.ndarray | None  # uint8 [T, layers, top_k]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)

    @property
    def num_sampled(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


def build_sample(nodes: Sequence[NodeLike]) -> Sample:
    """The sample of one root-to-leaf path of nodes. Raises SampleError on inconsistent node data."""
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lps: list[np.ndarray] = []
    routed: list[np.ndarray] = []
    for i, node in enumerate(nodes):
        n = len(node.token_ids)
        tok = np.asarray(node.token_ids, dtype=np.int32)
        # an input node (no logprobs, no True in its mask) needs no per-token conversion of its mask
        plain = not node.logprobs and True not in node.mask
        mask = np.zeros(n, dtype=bool) if plain or not len(node.mask) else np.asarray(node.mask, dtype=bool)
        if plain and len(node.mask) not in (0, n):
            raise SampleError(f"node {i}: mask has {len(node.mask)} entries for {n} tokens")
        if mask.size != n:
            raise SampleError(f"node {i}: mask has {mask.size} entries for {n} tokens")
        sampled = int(np.count_nonzero(mask))
        if len(node.logprobs) != sampled:
            raise SampleError(f"node {i}: {len(node.logprobs)} logprobs for {sampled} sampled tokens")
        lp = np.zeros(n, dtype=np.float32)
        if sampled:
            lp[mask] = node.logprobs
        if not np.all(np.isfinite(lp)):
            raise SampleError(f"node {i}: non-finite logprob")
        ids.append(tok)
        masks.append(mask)
        lps.append(lp)
        if node.routed_experts is not None:
            r = np.asarray(node.routed_experts)
            if r.ndim != 3 or r.shape[0] != n:
                raise SampleError(f"node {i}: routed experts shape {r.shape} for {n} tokens "
                                  "(expected [tokens, layers, top_k])")
            routed.append(r.astype(np.uint8, copy=False))
    if routed and len(routed) != len(ids):
        raise SampleError(f"routed experts on {len(routed)} of {len(ids)} nodes")
    if routed and len({r.shape[1:] for r in routed}) > 1:
        raise SampleError(f"routed experts shapes differ across nodes: {sorted({r.shape[1:] for r in routed})}")
    return Sample(
        token_ids=np.concatenate(ids) if ids else np.zeros(0, np.int32),
        loss_mask=np.concatenate(masks).view(np.uint8) if masks else np.zeros(0, np.uint8),
        logprobs=np.concatenate(lps) if lps else np.zeros(0, np.float32),
        routed_experts=np.concatenate(routed) if routed else None,
    )


def samples_from_trace(trace: Any) -> list[Sample]:
    """One sample per trainable branch of a verifiers ``Trace`` (duck-typed: ``branches[].nodes``)."""
    return [build_sample(b.nodes) for b in trace.branches if b.trainable]
