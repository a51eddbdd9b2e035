"""The ``versions`` column: which policy step sampled each token, exact where the server said so, else bounded.

One int32 per token:

- ``v >= 0``: token sampled by the weights of policy step ``v`` (exact: the server's ``weight_versions`` spans,
  vLLM 0.32+, name the version label the orchestrator set to the step at each sync);
- ``NOT_SAMPLED`` (-1): not sampled (prompt, environment and template tokens);
- ``v <= -2``: sampled, version not known exactly: at least ``-2 - v`` (``bounded(lower)``); the sample's
  ``policy_max`` scalar bounds it from above (the newest weights its server could have had when the rollout came
  back). A token a server without ``weight_versions`` sampled (vLLM 0.26 and 0.31, prime-rl's server) is bounded
  by the policy the rollout was assigned under; ``policy == policy_max`` makes it exact.

``lower_bound`` reads the column back; a naive reader that takes it as plain versions sees bounded tokens as very
old (a large lag: masked by any staleness check) and never equal to its own step (left out of any parity check),
which is the safe side.

``TokenVersions`` makes the column in the env worker, per sample, from the versions each generate call of the
rollout reported (``CallVersions``, keyed by the call's prompt length and completion tokens, which is where that
completion lies in every sample that holds it): O(tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

NOT_SAMPLED = -1
DTYPE = np.dtype("<i4")

CallKey = tuple[int, int, int]  # (prompt tokens, completion tokens, hash of the completion's int32 bytes)


def bounded(lower: int) -> int:
    """The column value of a sampled token whose version is only known to be at least ``lower``."""
    return -2 - lower


def lower_bound(versions: np.ndarray) -> np.ndarray:
    """Each token's version (exact) or lower bound (bounded); NOT_SAMPLED where not sampled."""
    out: np.ndarray = np.where(versions <= -2, -2 - versions, versions)
    return out


def exact(versions: np.ndarray) -> np.ndarray:
    """bool per token: sampled by a known version."""
    out: np.ndarray = versions >= 0
    return out


def call_key(prompt_tokens: int, completion: np.ndarray | Sequence[int]) -> CallKey:
    """Where a generate call's completion lies in a sample, and what it is."""
    ids = np.asarray(completion, dtype=np.int32)
    return (prompt_tokens, int(ids.size), hash(ids.tobytes()))


def span_versions(spans: Any, tokens: int) -> np.ndarray:
    """Per output token, the step a reply's ``weight_versions`` spans name (``[{"version", "start", "end"}]``,
    half-open over output tokens); -1 where no span names a step (a label that is not a step number, such as
    vLLM's ``"default"`` before the first sync; a token no span covers; malformed spans)."""
    out = np.full(tokens, -1, np.int32)
    if not isinstance(spans, list):
        return out
    for span in spans:
        if not isinstance(span, dict):
            continue
        label, start, end = span.get("version"), span.get("start"), span.get("end")
        if isinstance(label, str) and label.isdigit() and isinstance(start, int) and isinstance(end, int) \
                and 0 <= start <= end <= tokens and int(label) < 2**31 - 1:
            out[start:end] = int(label)
    return out


class TokenVersions:
    """The versions of one rollout's sampled tokens: ``calls`` maps a generate call's key to what each of its
    replies reported per output token (-1: unknown); tokens no call explains, or explained with -1 or by replies
    that disagree, are bounded by ``floor`` (the policy the rollout was assigned under)."""

    def __init__(self, floor: int, calls: Mapping[CallKey, list[np.ndarray]] | None = None) -> None:
        self.floor = floor
        self.calls = calls or {}
        self.exact = 0  # sampled tokens given an exact version, over every sample built
        self.bounded = 0

    def sample(self, ids: np.ndarray, sampled: np.ndarray, ends: Sequence[int]) -> np.ndarray:
        """The column of one sample: ``ids`` its tokens, ``sampled`` bool per token, ``ends`` the token offset
        after each of its nodes (a node's sampled tokens are one call's completion)."""
        out = np.where(sampled, np.int32(bounded(self.floor)), np.int32(NOT_SAMPLED)).astype(DTYPE)
        if self.calls:
            start = 0
            for end in ends:
                positions = np.flatnonzero(sampled[start:end]) + start
                if positions.size:
                    out[positions] = self._node(int(positions[0]), ids[positions])
                start = end
        known = out >= 0
        self.exact += int(np.count_nonzero(known))
        self.bounded += int(np.count_nonzero(sampled)) - int(np.count_nonzero(known))
        return out

    def _node(self, prompt_tokens: int, completion: np.ndarray) -> np.ndarray:
        found = self.calls.get(call_key(prompt_tokens, completion))
        floor = np.int32(bounded(self.floor))
        if not found:
            return np.full(completion.size, floor, DTYPE)
        if any(not np.array_equal(found[0], other) for other in found[1:]):  # two calls, same tokens: which?
            lowest: np.ndarray = np.minimum.reduce([np.where(v >= 0, v, self.floor) for v in found])
            return (-2 - lowest).astype(DTYPE)
        out: np.ndarray = np.where(found[0] >= 0, found[0], floor).astype(DTYPE)
        return out


def summary(versions: np.ndarray, loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """``[(value, count)]`` of the column over a sample's trained tokens, in value order: what a record header
    carries so the orchestrator can count and mask stale tokens without reading columns."""
    values, counts = np.unique(versions[loss_mask != 0], return_counts=True)
    return [(int(v), int(c)) for v, c in zip(values.tolist(), counts.tolist(), strict=True)]
