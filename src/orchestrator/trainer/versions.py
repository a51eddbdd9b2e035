"""Which weights sampled each token of a batch, for a trainer: exact where the servers said, else bounds.

A batch's ``versions`` column (columns/versions.py) holds the policy step that sampled each token (exact), -1 for a
token not sampled, and ``-2 - lower`` for one whose step is only bounded from below; the per-sample scalar
``policy_max`` bounds it from above (the newest weights its server could have had when the rollout came back).
``version_bounds`` turns both into two arrays; ``sampled_by(batch, step)`` says which tokens the weights of
``step`` sampled for sure (an exact version, or bounds that meet). A batch without the column (an older sender)
has only the per-sample ``policy`` scalar: its tokens count as sampled by their sample's policy, as before.

A version is that of the forward pass that sampled the token. A request that a weight sync's keep pause caught in
flight goes on, after the resume, over the KV cache its earlier tokens (and prompt) left, computed by the older
weights: its later tokens are of the new version but not what those weights compute from scratch (observed on vLLM
0.32.0: mean 0.12 off; docs/inference-servers.md). ``cut_by_sync`` marks those tokens: sampled by newer weights
than their reply's first token. ``clean_context`` marks the tokens whose whole sample was begun under its token's
version (the sample's ``policy``), where a recomputation must match. A later turn of a sample begun under older
weights is neither: a new request, but one sent while a sync was under way carries the older ``cache_salt`` and may
reuse prefix-cache blocks the older weights computed.
"""

from __future__ import annotations

import numpy as np

from orchestrator.columns.versions import NOT_SAMPLED, exact, lower_bound
from orchestrator.contracts.wire import Batch


def _per_token(batch: Batch, name: str) -> np.ndarray | None:
    values = batch.scalars.get(name)
    if values is None:
        return None
    out: np.ndarray = np.repeat(np.asarray(values, dtype=np.int64), np.diff(batch.offsets))
    return out


def version_bounds(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """int64 per token: the oldest and the newest policy step that may have sampled it (equal when known; -1 for a
    token not sampled). Without a versions column, every token of a sample is given its ``policy`` scalar (else
    the batch's step)."""
    policy = _per_token(batch, "policy")
    if policy is None:
        policy = np.full(batch.num_tokens, batch.step, np.int64)
    versions = batch.columns.get("versions")
    if versions is None:
        return policy, policy.copy()
    lo = lower_bound(versions).astype(np.int64)
    hi = _per_token(batch, "policy_max")
    hi = policy if hi is None else hi
    hi = np.where(exact(versions) | (versions == NOT_SAMPLED), lo, np.maximum(hi, lo))
    return lo, hi


def sampled_by(batch: Batch, step: int | None = None) -> np.ndarray:
    """bool per token: sampled for sure by the weights of ``step`` (default: the batch's step)."""
    step = batch.step if step is None else step
    lo, hi = version_bounds(batch)
    out: np.ndarray = (lo == step) & (hi == step)
    return out


def clean_context(batch: Batch) -> np.ndarray:
    """bool per token: its sample was begun under the weights that sampled it (the sample's ``policy``), so every
    earlier token's KV (and the prompt's) was computed by those weights too. Without ``policy`` scalars: all."""
    policy = _per_token(batch, "policy")
    if policy is None:
        return np.ones(batch.num_tokens, bool)
    lo, hi = version_bounds(batch)
    out: np.ndarray = (lo == policy) & (hi == policy)
    return out


def cut_by_sync(batch: Batch) -> np.ndarray:
    """bool per token: sampled by newer weights than the first token of its reply (a run of exactly versioned
    tokens), so over a KV cache older weights computed: a sync's keep pause cut the reply. Without a versions
    column: none."""
    versions = batch.columns.get("versions")
    if versions is None:
        return np.zeros(batch.num_tokens, bool)
    v = versions.astype(np.int64)
    known = exact(v)  # NOT_SAMPLED and bounded tokens end a reply's run
    begins = known & ~np.concatenate([[False], known[:-1]])
    firsts = batch.offsets[:-1][batch.offsets[:-1] < v.size]
    begins[firsts] = known[firsts]  # a sample's first token begins a run even after another sample's
    start = np.maximum.accumulate(np.where(begins, np.arange(v.size), 0))
    out: np.ndarray = known & (v != v[start])
    return out
