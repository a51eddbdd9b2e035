"""Training samples built from a trace's message nodes: columnar, O(total tokens).

One sample per trainable root-to-leaf branch. Each node contributes a chunk per column (token ids,
loss mask, logprobs scattered to token positions, routed experts); each column is concatenated once,
so building a sample costs O(total tokens) however many turns it has, never a re-pack per turn. Given the
rollout's ``TokenVersions`` (versions.py), a sample also has the ``versions`` column.
Routed experts stay ``[tokens, layers, top_k]`` in the narrowest type that holds every expert id, uint8 or
uint16 (a model with more than 256 experts), throughout; an id that fits neither is an error, never a wrap.

Nodes are duck-typed (``token_ids``, ``mask``, ``logprobs``, ``routed_experts``), so this module works on
verifiers' ``MessageNode`` without importing verifiers.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from orchestrator.columns.layout import OPTIONAL
from orchestrator.columns.versions import TokenVersions

assert array("i").itemsize == 4, "token ids are gathered as C int, which must be 32-bit"


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
    routed_experts: np.ndarray | None  # uint8 or uint16 [T, layers, top_k]
    versions: np.ndarray | None = None  # int32 [T]: the policy step that sampled each token (versions.py)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)

    def column(self, name: str) -> np.ndarray | None:
        """Column ``name`` (columns/layout.py); None for an optional one this sample does not have."""
        value: np.ndarray | None = getattr(self, name)
        return value

    @property
    def optional(self) -> tuple[str, ...]:
        """The optional token columns it has."""
        return tuple(name for name in OPTIONAL if getattr(self, name) is not None)

    @property
    def num_sampled(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


def build_sample(nodes: Sequence[NodeLike], versions: TokenVersions | None = None) -> Sample:
    """The sample of one root-to-leaf path of nodes, with its ``versions`` column when ``versions`` is given.
    Raises SampleError on inconsistent node data.

    The Python lists of every node are appended into one C buffer per column (``array`` and ``bytes``
    convert a list without creating a numpy array per node), then each column becomes one numpy array and
    is checked once, vectorised. Only routed experts, already arrays, are concatenated.
    """
    ids, lps, mask = array("i"), array("d"), bytearray()
    ends: list[int] = []  # token offset after each node
    lp_ends: list[int] = []  # logprob offset after each node
    routed: list[np.ndarray] = []
    for i, node in enumerate(nodes):
        n = len(node.token_ids)
        m = len(node.mask)
        if m not in (0, n):
            raise SampleError(f"node {i}: mask has {m} entries for {n} tokens")
        try:
            _append(ids, node.token_ids)
            _append(lps, node.logprobs)
            mask += _mask_bytes(node.mask) if m else bytes(n)
        except (TypeError, ValueError, OverflowError) as e:
            raise SampleError(f"node {i}: {e}") from None
        ends.append(len(ids))
        lp_ends.append(len(lps))
        if node.routed_experts is not None:
            r = np.asarray(node.routed_experts)
            if r.ndim != 3 or r.shape[0] != n:
                raise SampleError(f"node {i}: routed experts shape {r.shape} for {n} tokens "
                                  "(expected [tokens, layers, top_k])")
            routed.append(expert_ids(r, i))
    if routed and len(routed) != len(ends):
        raise SampleError(f"routed experts on {len(routed)} of {len(ends)} nodes")
    if routed and len({r.shape[1:] for r in routed}) > 1:
        raise SampleError(f"routed experts shapes differ across nodes: {sorted({r.shape[1:] for r in routed})}")
    sampled = np.frombuffer(mask, np.uint8) != 0
    positions = np.flatnonzero(sampled)
    _check_logprob_counts(positions, ends, lp_ends)
    sampled_lps = np.frombuffer(lps, np.float64).astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(sampled_lps))
    if bad.size:
        raise SampleError(f"node {bisect_right(lp_ends, int(bad[0]))}: non-finite logprob")
    logprobs = np.zeros(sampled.size, np.float32)
    logprobs[positions] = sampled_lps
    token_ids = np.frombuffer(ids, np.int32)
    return Sample(
        token_ids=token_ids,
        loss_mask=sampled.view(np.uint8),
        logprobs=logprobs,
        routed_experts=np.concatenate(routed) if routed else None,
        versions=None if versions is None else versions.sample(token_ids, sampled, ends, positions),
    )


def expert_ids(r: np.ndarray, node: int) -> np.ndarray:
    """``r`` as uint8 or uint16 (uint8/uint16 arrays as they are); SampleError if an id fits neither."""
    if r.dtype in (np.uint8, np.uint16):
        return r
    if r.dtype.kind not in "iu":
        raise SampleError(f"node {node}: routed experts of dtype {r.dtype} are not expert ids")
    if r.size:
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi > 0xFFFF:
            raise SampleError(f"node {node}: routed expert id {lo if lo < 0 else hi} does not fit uint16")
        return r.astype(np.uint8 if hi <= 0xFF else np.uint16)
    return r.astype(np.uint8)


def _append(column: array[Any], values: Any) -> None:
    if type(values) is list:
        column.fromlist(values)  # one C loop, no per-element iterator
    else:
        column.extend(values)


def _mask_bytes(values: Any) -> bytes:
    """One byte per token, nonzero where sampled; ``bytes(list)`` is the fast path for a list of bools."""
    if type(values) is list:
        try:
            return bytes(values)
        except (TypeError, ValueError):  # e.g. numpy bools or values > 255: take the general path
            pass
    return np.asarray(values, dtype=bool).tobytes()


def _check_logprob_counts(positions: np.ndarray, ends: list[int], lp_ends: list[int]) -> None:
    """Every node must carry exactly one logprob per sampled token (``positions``: sampled token indices)."""
    per_node_sampled = np.diff(np.searchsorted(positions, ends), prepend=0)
    per_node_lps = np.diff(np.asarray(lp_ends, np.int64), prepend=0)
    wrong = np.flatnonzero(per_node_sampled != per_node_lps)
    if wrong.size:
        i = int(wrong[0])
        raise SampleError(f"node {i}: {per_node_lps[i]} logprobs for {per_node_sampled[i]} sampled tokens")


def samples_from_trace(trace: Any, versions: TokenVersions | None = None) -> list[Sample]:
    """One sample per trainable branch of a verifiers ``Trace`` (duck-typed: ``branches[].nodes``)."""
    return [build_sample(b.nodes, versions) for b in trace.branches if b.trainable]
