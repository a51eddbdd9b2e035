"""A generation that a keep pause cuts in two: tokens before it from the old weights, after it from the new.

A real vLLM samples a request's tokens one engine step at a time; a keep pause stops the engine between two steps,
the weights (and their version label) change while it is paused, and the request goes on after the resume with
the new ones. So one reply can hold tokens of two policies, and vLLM 0.32+ says which: ``weight_versions`` spans
over its output tokens, a new span wherever a step's tokens carry another label than the last
(``v032:v1/engine/output_processor.py`` ``track_weight_version``, ``v032:v1/engine/core.py``
``_attach_weight_version``; the label is ``"default"`` until ``/update_weight_version`` sets one).

The simulator samples a request's tokens when its latency is over. A request inside the engine when a keep pause
begins on a running engine (in its latency, or held) is ``interrupt``ed instead: the tokens it would have produced so
far (the share of its latency that has passed; half of what is left past it, as a held request) are sampled then, with
the weights and label of that moment, and ``finish`` samples the rest, after the resume, with those of the resume
(the context is the prompt plus the tokens already out, as for a real request). A part that ends with a stop token
ends the request: what is left is not sampled.

What the simulator does not play: a pause that lands during the KV model's decode time (kv.py: the tokens are
sampled before it), and requests with ``n > 1`` (each choice is sampled whole after the resume).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from orchestrator.sim.policy import Sample, SimPolicy
from orchestrator.sim.requests import SamplingParams


@dataclass(eq=False)
class Generation:
    """One generate request's single choice, inside the engine."""

    prompt: list[int]
    sp: SamplingParams
    delay_s: float  # its injected latency: the time its tokens take
    started: float = field(default_factory=time.monotonic)
    parts: list[tuple[str, Sample]] = field(default_factory=list)  # (label, tokens) sampled at interruptions

    @property
    def sampled(self) -> int:
        return sum(int(p.token_ids.size) for _, p in self.parts)

    @property
    def stopped(self) -> bool:
        return bool(self.parts) and self.parts[-1][1].finish_reason == "stop"

    def interrupt(self, policy: SimPolicy, label: str, now: float | None = None) -> None:
        """A keep pause begins: sample the tokens produced so far with the weights and label of now."""
        if self.stopped:
            return
        done, left = self.sampled, self.sp.max_tokens - self.sampled
        elapsed = (time.monotonic() if now is None else now) - self.started
        # within its latency: the share that has passed; without latency, or past it and held: half of what is left
        due = int(self.sp.max_tokens * elapsed / self.delay_s) - done if elapsed < self.delay_s else left // 2
        due = min(due, left - 1)  # the last token comes after the resume: it had not been sampled
        if due <= 0:
            return
        self.parts.append((label, self._sample(policy, due)))

    def finish(self, policy: SimPolicy, label: str) -> tuple[Sample, list[tuple[str, int, int]]]:
        """The whole completion, and its ``(label, start, end)`` spans (consecutive parts of one label merged)."""
        if not self.stopped and self.sampled < max(self.sp.max_tokens, 1):
            self.parts.append((label, self._sample(policy, max(self.sp.max_tokens, 1) - self.sampled)))
        spans: list[tuple[str, int, int]] = []
        at = 0
        for part_label, part in self.parts:
            end = at + int(part.token_ids.size)
            if spans and spans[-1][0] == part_label:
                spans[-1] = (part_label, spans[-1][1], end)
            elif end > at:
                spans.append((part_label, at, end))
            at = end
        return join([p for _, p in self.parts]), spans

    def _sample(self, policy: SimPolicy, n: int) -> Sample:
        context = [*self.prompt, *(t for _, p in self.parts for t in p.token_ids.tolist())]
        done = self.sampled
        sp = dataclasses.replace(self.sp, max_tokens=n, min_tokens=max(self.sp.min_tokens - done, 0))
        return policy.sample(context, sp)


def join(parts: list[Sample]) -> Sample:
    """Samples one after another as one; the finish of the last."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    return Sample(np.concatenate([p.token_ids for p in parts]), np.concatenate([p.logprobs for p in parts]),
                  np.concatenate([p.ranks for p in parts]), last.finish_reason, last.stop_reason,
                  np.concatenate([p.top_ids for p in parts]), np.concatenate([p.top_logprobs for p in parts]))
