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

``TokenVersions`` makes the column in the env worker, per sample, from the spans each generate call of the
rollout reported (``CallSpans``, keyed by the call's prompt length and completion tokens, which is where that
completion lies in every sample that holds it): O(tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

NOT_SAMPLED = -1
DTYPE = np.dtype("<i4")

CallKey = tuple[int, int, int]  # (prompt tokens, completion tokens, hash of the completion's int32 bytes)
CallSpans = tuple[tuple[int, int, int], ...]  # (step or -1 when unknown, start, end) over a reply's output tokens


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
    ids = np.asarray(completion, dtype=DTYPE)
    return (prompt_tokens, int(ids.size), hash(ids.tobytes()))


def call_spans(weight_versions: Any, tokens: int) -> CallSpans:
    """A reply's ``weight_versions`` (``[{"version", "start", "end"}]``, half-open over its ``tokens`` output tokens)
    as spans of step numbers; -1 for a label that is not a step number (vLLM's ``"default"`` before the first
    sync), and for malformed spans or output tokens no span covers (vLLM: null when no label was reported)."""
    out: list[tuple[int, int, int]] = []
    for span in weight_versions if isinstance(weight_versions, list) else ():
        if not isinstance(span, dict):
            continue
        label, start, end = span.get("version"), span.get("start"), span.get("end")
        if isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= tokens:
            step = int(label) if isinstance(label, str) and label.isdigit() and len(label) < 10 else -1
            out.append((step, start, end))
    return tuple(out)


def expand(spans: CallSpans, tokens: int) -> np.ndarray:
    """One int32 per output token: the step of the span that covers it, -1 where none does."""
    out = np.full(tokens, -1, DTYPE)
    for step, start, end in spans:
        out[start:end] = step
    return out


class TokenVersions:
    """The versions of one rollout's sampled tokens: ``calls`` maps a generate call's key to the spans each reply
    with that key reported; tokens no call explains, or explained as unknown or by replies that disagree, are
    bounded by ``floor`` (the policy the rollout was assigned under)."""

    def __init__(self, floor: int, calls: Mapping[CallKey, list[CallSpans]] | None = None) -> None:
        self.floor = floor
        self.calls = calls or {}
        self.exact = 0  # sampled tokens given an exact version, over every sample built
        self.bounded = 0

    def sample(self, ids: np.ndarray, sampled: np.ndarray, ends: Sequence[int],
               positions: np.ndarray | None = None) -> np.ndarray:
        """The column of one sample: ``ids`` its tokens, ``sampled`` bool per token, ``ends`` the token offset
        after each of its nodes (a node's sampled tokens are one call's completion); ``positions``: the sampled
        tokens' indices, when the caller has them."""
        out = np.where(sampled, np.int32(bounded(self.floor)), np.int32(NOT_SAMPLED)).astype(DTYPE)
        n_sampled = int(np.count_nonzero(sampled))
        if self.calls and n_sampled:
            positions = np.flatnonzero(sampled) if positions is None else positions
            cuts = np.searchsorted(positions, np.asarray(ends, np.int64)).tolist()  # each node's sampled tokens
            start = 0
            for cut in cuts:
                if cut > start:
                    self._node(out, ids, positions[start:cut])
                start = cut
        known = int(np.count_nonzero(out >= 0))
        self.exact += known
        self.bounded += n_sampled - known
        return out

    def _node(self, out: np.ndarray, ids: np.ndarray, where: np.ndarray) -> None:
        """Write one node's sampled tokens (at ``where``: one call's completion) into ``out``, if a call says."""
        first, n = int(where[0]), int(where.size)
        contiguous = int(where[-1]) - first == n - 1  # verifiers' layout: the completion ends its node
        completion = ids[first:first + n] if contiguous else ids[where]
        found = self.calls.get(call_key(first, completion))
        if not found:
            return  # bounded, as written
        if any(other != found[0] for other in found[1:]):  # two calls, the same tokens: which one is this?
            lowest: np.ndarray = np.minimum.reduce([np.where(v >= 0, v, self.floor) for v in
                                                    (expand(f, n) for f in found)])
            out[where] = -2 - lowest
            return
        for step, start, end in found[0]:
            if step >= 0:
                if contiguous:
                    out[first + start:first + end] = step
                else:
                    out[where[start:end]] = step


def summary(versions: np.ndarray, loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """``[(value, count)]`` of the column over a sample's trained tokens, in value order: what a record header
    carries so the orchestrator can count and mask stale tokens without reading columns."""
    values, counts = np.unique(versions[loss_mask != 0], return_counts=True)
    return [(int(v), int(c)) for v, c in zip(values.tolist(), counts.tolist(), strict=True)]


def older_than(versions: np.ndarray, floor: int | np.ndarray) -> np.ndarray:
    """bool per token: sampled by weights (possibly, for a bounded token) older than ``floor``."""
    out: np.ndarray = (versions != NOT_SAMPLED) & (lower_bound(versions) < floor)
    return out


def mask_older(loss_mask: np.ndarray, versions: np.ndarray, offsets: np.ndarray,
               floors: list[int | None]) -> np.ndarray:
    """``loss_mask`` (the concatenation of samples ``offsets[i]:offsets[i + 1]``) with 0 on every token older than
    its sample's floor (None: no floor); a new array when anything changes, else ``loss_mask`` itself."""
    if all(f is None for f in floors):
        return loss_mask
    lengths = np.diff(offsets)
    per_token = np.repeat(np.array([np.iinfo(np.int64).min if f is None else f for f in floors], np.int64), lengths)
    stale = older_than(versions, per_token)
    if not stale.any():
        return loss_mask
    out: np.ndarray = np.where(stale, 0, loss_mask).astype(loss_mask.dtype)
    return out
