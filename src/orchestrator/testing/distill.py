"""On-policy distillation in tests: the simulated teacher's exact logprobs, and a teacher server to score with.

``exact_logprobs(policy, ids)`` is what a simulated teacher playing ``policy`` must answer for ``ids`` (the
``ref_logprobs`` column of a sample of those tokens): each token's raw logprob given the tokens before it, floored at
vLLM's -9999.0, and 0 for the first token. It walks the tokens with ``Cursor``, the path the simulated servers sample
with, not ``Policy.logits_at`` (the path they score with), so the two check each other.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from orchestrator.policy import Cursor, Policy
from orchestrator.sim.policy import LOGPROB_FLOOR

TEACHER_SEED = 1  # Policy.seeded(TEACHER_SEED): the simulated teacher the tests and the demo use


def exact_logprobs(policy: Policy, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """float64 [T]: the teacher ``policy``'s logprob of each of ``ids`` given those before it (0 for the first)."""
    tokens = np.asarray(ids, dtype=np.int64)
    out = np.zeros(tokens.size)
    if tokens.size < 2:
        return out
    cursor = Cursor(policy, tokens[:1])
    for i in range(1, tokens.size):
        z = cursor.logits()
        top = float(z.max())
        out[i] = max(float(z[tokens[i]]) - top - float(np.log(np.exp(z - top).sum())), LOGPROB_FLOOR)
        cursor.push(int(tokens[i]))
    return out
