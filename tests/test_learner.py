"""The reference trainer's learning mode, on hand-made batches: what it reads, which way it moves the policy,
and what the clip removes. The whole loop learning is in test_learning.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orchestrator.contracts.wire import Batch
from orchestrator.policy import Cursor, Policy, Sequences
from orchestrator.trainer.learner import LearnConfig, PolicyLearner

PROMPT = [2, 5, 14, 11, 113, 85, 131, 83, 3, 2, 6]  # <|im_start|> user what is 12 + 30 ? <|im_end|> ... assistant


def logprob(policy: Policy, prompt: list[int], token: int) -> float:
    z = Cursor(policy, np.array(prompt)).logits()
    return float(z[token] - z.max() - np.log(np.exp(z - z.max()).sum()))


def batch(replies: list[list[int]], advantages: list[float], behaviour: list[list[float]] | None = None,
          prompt: list[int] = PROMPT) -> Batch:
    """Samples ``prompt + reply``; the reply's tokens are the sampled ones (mask 1, their logprobs shipped)."""
    policy = Policy.initial()
    chunks: dict[str, list[np.ndarray]] = {"token_ids": [], "loss_mask": [], "logprobs": []}
    for i, reply in enumerate(replies):
        lps = behaviour[i] if behaviour else [logprob(policy, prompt + reply[:j], t) for j, t in enumerate(reply)]
        chunks["token_ids"].append(np.array(prompt + reply, np.int32))
        chunks["loss_mask"].append(np.array([0] * len(prompt) + [1] * len(reply), np.uint8))
        chunks["logprobs"].append(np.array([0.0] * len(prompt) + lps, np.float32))
    lengths = [len(prompt) + len(r) for r in replies]
    return Batch.from_columns("t", 0, chunks, lengths, {"advantage": advantages, "reward": [0.0] * len(replies),
                                                        "env": ["e"] * len(replies)})


def test_inputs_are_the_sampled_tokens_with_their_sample_s_advantage_and_logprob() -> None:
    b = batch([[140, 3], [150]], [0.5, -0.25])
    seqs, advantage, behaviour, temperature = PolicyLearner().inputs(b)
    n = len(PROMPT)
    assert seqs.positions.tolist() == [n, n + 1, 2 * n + 2]
    assert seqs.token_ids[seqs.positions].tolist() == [140, 3, 150]
    assert advantage.tolist() == [0.5, 0.5, -0.25]
    assert behaviour.tolist() == pytest.approx(b.columns["logprobs"][[n, n + 1, 2 * n + 2]].tolist())
    assert temperature.tolist() == [1.0, 1.0, 1.0]


def test_a_step_raises_what_did_well_and_lowers_what_did_badly() -> None:
    learner = PolicyLearner()
    before = learner.policy
    stats = learner.update(batch([[140], [150]], [0.5, -0.5]))
    assert (stats.samples, stats.tokens) == (2, 2)
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-4)  # on-policy: the shipped logprobs are the policy's
    assert stats.clipped == 1.0  # two samples, a full step: the second pass finds both tokens moved past 1 ± ε
    assert logprob(learner.policy, PROMPT, 140) > logprob(before, PROMPT, 140)
    assert logprob(learner.policy, PROMPT, 150) < logprob(before, PROMPT, 150)
    assert learner.policy.step == 1


def test_the_clip_removes_tokens_already_moved_far_enough() -> None:
    """A token whose ratio to the behaviour policy is past 1 + ε with a positive advantage (or below 1 - ε with
    a negative one) gives no gradient: the policy does not move."""
    lp = logprob(Policy.initial(), PROMPT, 140)
    learner = PolicyLearner(LearnConfig(clip=0.2))
    stats = learner.update(batch([[140], [140]], [0.5, -0.5], behaviour=[[lp - 0.5], [lp + 0.5]]))
    assert stats.clipped == 1.0
    assert stats.grad_norm == 0.0
    assert all(np.array_equal(learner.policy.weights[k], w) for k, w in Policy.initial().weights.items())


def test_a_batch_without_sampled_tokens_changes_nothing(tmp_path: Path) -> None:
    learner = PolicyLearner()
    stats = learner.update(batch([[]], [0.0]))
    assert stats.tokens == 0
    learner.save(tmp_path)
    loaded = Policy.load(tmp_path)
    assert loaded is not None
    assert loaded.step == 0


def test_per_sample_temperature_is_used() -> None:
    b = batch([[140]], [0.5])
    b.scalars["temperature"] = [0.5]
    seqs, _, _, temperature = PolicyLearner(LearnConfig(temperature=1.0)).inputs(b)
    assert isinstance(seqs, Sequences)
    assert temperature.tolist() == [0.5]
