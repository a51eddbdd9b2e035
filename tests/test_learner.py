"""The reference trainer's learning mode, on hand-made batches: what it reads, which way it moves the policy,
and what the clip removes. The whole loop learning is in test_learning.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orchestrator.contracts.wire import Batch
from orchestrator.policy import Cursor, Policy, Sequences
from orchestrator.testing.distill import TEACHER_SEED, exact_logprobs
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


def with_teacher(b: Batch, ref: list[list[float]], opd: list[float], reward: list[float] | None = None) -> Batch:
    """``b`` with a teacher's column (each sample's reply tokens get ``ref``; prompt tokens -5) and its scalars."""
    col = []
    for i, r in enumerate(ref):
        n = int(b.offsets[i + 1] - b.offsets[i]) - len(r)
        col.append(np.array([0.0] + [-5.0] * (n - 1) + r, np.float32))
    b.columns["ref_logprobs"] = np.concatenate(col)
    b.scalars["opd_weight"] = opd
    b.scalars["reward_weight"] = reward or [1.0] * len(opd)
    return b


def test_the_teachers_term_moves_the_policy_towards_what_the_teacher_prefers() -> None:
    """No reward advantage at all: a token the teacher likes more than the policy does rises, one it likes less
    falls; the reported KL is the mean of log π(y) - r over the distilled tokens, before the update."""
    before = Policy.initial()
    lp140, lp150 = logprob(before, PROMPT, 140), logprob(before, PROMPT, 150)
    learner = PolicyLearner()
    stats = learner.update(with_teacher(batch([[140], [150]], [0.0, 0.0]), [[lp140 + 2.0], [lp150 - 2.0]],
                                        [1.0, 1.0], [0.0, 0.0]))
    assert stats.teacher_kl == pytest.approx(0.0, abs=1e-5)  # (-2 + 2) / 2
    assert stats.grad_norm > 0
    assert logprob(learner.policy, PROMPT, 140) > lp140
    assert logprob(learner.policy, PROMPT, 150) < lp150
    assert "KL to the teacher 0.0000" in str(stats)


def test_a_sample_of_weight_0_is_not_distilled_and_a_batch_without_the_column_reports_no_kl() -> None:
    b = with_teacher(batch([[140], [150]], [0.0, 0.0]), [[0.0], [-20.0]], [0.0, 0.0])
    learner = PolicyLearner()
    stats = learner.update(b)
    assert stats.teacher_kl is None
    assert stats.grad_norm == 0.0  # no advantage, no teacher's term: nothing to learn
    assert PolicyLearner().update(batch([[140]], [0.5])).teacher_kl is None


def exact_kl(student: Policy, teacher: Policy, contexts: list[list[int]]) -> float:
    """The mean over ``contexts`` of KL(student || teacher) of the next token, over the whole vocabulary."""
    out = []
    for ctx in contexts:
        s, t = (Cursor(p, np.array(ctx)).logits() for p in (student, teacher))
        ls, lt = s - np.logaddexp.reduce(s), t - np.logaddexp.reduce(t)
        out.append(float(np.sum(np.exp(ls) * (ls - lt))))
    return float(np.mean(out))


def opd_steps(steps: int, shuffle: bool) -> tuple[float, float]:
    """``steps`` on-policy updates on one-token replies the student samples, scored exactly by a teacher of
    another seed; the exact KL to it before and after (``shuffle``: the teacher's logprobs permuted across the
    batch, the control)."""
    teacher, rng = Policy.seeded(TEACHER_SEED), np.random.default_rng(0)
    prompts = [[2, 5, 14, 11, a, 85, b, 83, 3, 2, 6] for a, b in [(113, 131), (120, 140), (100, 170), (130, 115)]]
    learner = PolicyLearner(LearnConfig(lr=0.2))  # the teacher's term is larger than the demo's advantages
    before = exact_kl(learner.policy, teacher, prompts)
    for _ in range(steps):
        replies, contexts = [], []
        for p in prompts:
            z = Cursor(learner.policy, np.array(p)).logits()
            probs = np.exp(z - np.logaddexp.reduce(z))
            replies += [[int(t)] for t in rng.choice(probs.size, 16, p=probs / probs.sum())]
            contexts += [p] * 16
        b = batch(replies, [0.0] * len(replies), [[logprob(learner.policy, c, r[0])] for c, r in
                                                    zip(contexts, replies, strict=True)])
        b.columns["token_ids"][:] = np.concatenate([c + r for c, r in zip(contexts, replies, strict=True)])
        ref = [[float(exact_logprobs(teacher, c + r)[-1])] for c, r in zip(contexts, replies, strict=True)]
        if shuffle:
            ref = [ref[i] for i in rng.permutation(len(ref))]
        learner.update(with_teacher(b, ref, [1.0] * len(ref), [0.0] * len(ref)))
    return before, exact_kl(learner.policy, teacher, prompts)


def test_distillation_lowers_the_exact_kl_to_the_teacher_and_a_shuffled_teacher_does_not() -> None:
    """Seeded: the same numbers every run (measured 4.49 -> 2.24, and the control 4.49 -> 5.14)."""
    before, after = opd_steps(6, shuffle=False)
    assert after < 0.7 * before, (before, after)
    before, control = opd_steps(6, shuffle=True)
    assert control > 0.9 * before, (before, control)
