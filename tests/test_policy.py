"""The tiny policy: batched logits and their gradient, token-by-token sampling state, files, and the simulated
server's sampling from it (logprobs exact under the request's sampling parameters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.errors import CheckpointError
from orchestrator.policy import FILE, INITIAL_STOP_PROBABILITY, WEIGHTS, Cursor, Policy, Sequences
from orchestrator.sim.policy import SimPolicy, logprobs_mode_named
from orchestrator.sim.requests import SamplingParams
from orchestrator.sim.vocab import SimVocab


def perturbed(seed: int = 0, scale: float = 0.05) -> Policy:
    """The initial policy with every weight moved: every feature block matters."""
    rng = np.random.default_rng(seed)
    w = Policy.initial().weights
    return Policy({k: w[k] + rng.normal(0, scale, w[k].shape).astype(np.float32) for k in WEIGHTS})


def token(vocab_tokens: tuple[str, ...], text: str) -> int:
    return vocab_tokens.index(text)


def sequences(policy: Policy) -> list[np.ndarray]:
    """Samples with numbers after the same word twice, repeated numbers, and a random tail."""
    t = policy.vocab.tokens
    words = [token(t, w) for w in ("<|im_start|>", "user", "what", "is", "+", "-", "<|im_end|>", "assistant")]
    start, user, what, is_, plus, minus, end, assistant = words
    n = [token(t, str(v)) for v in (12, 30, 7, 300, 12, 45)]
    arithmetic = np.array([start, user, what, is_, n[0], plus, n[1], end, start, assistant, n[2], n[2], end])
    again = np.array([start, user, is_, n[3], minus, n[4], is_, n[5], plus, n[0], assistant, n[1], n[3]])
    rng = np.random.default_rng(1)
    return [arithmetic, again, rng.integers(4, policy.vocab.size, 20)]


def batched(samples: list[np.ndarray]) -> Sequences:
    ids = np.concatenate(samples).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in samples])]).astype(np.int64)
    positions = np.setdiff1d(np.arange(ids.size), offsets[:-1])
    return Sequences(ids, offsets, positions)


def test_gradient_is_the_derivative_of_the_logits() -> None:
    policy = perturbed()
    seqs = batched(sequences(policy))
    logits = policy.logits_at(seqs)
    d = np.random.default_rng(2).normal(0, 1, logits.shape)
    grad = policy.gradient(seqs, d)
    base = float((d * logits).sum())
    rng = np.random.default_rng(3)
    for name in WEIGHTS:
        g = grad[name]
        nonzero = np.argwhere(np.abs(g) > 1e-3)
        assert len(nonzero), name
        for index in nonzero[rng.choice(len(nonzero), 2)]:
            w = {k: v.copy() for k, v in policy.weights.items()}
            w[name][tuple(index)] += 1.0  # the logits are linear in the weights: a unit step is the derivative
            moved = float((d * Policy(w).logits_at(seqs)).sum())
            assert moved - base == pytest.approx(g[tuple(index)], rel=1e-3, abs=1e-3), (name, index)


def test_cursor_gives_the_batched_logits_token_by_token() -> None:
    policy = perturbed(seed=4, scale=0.2)
    for sample in sequences(policy):
        want = policy.logits_at(Sequences(sample.astype(np.int64), np.array([0, sample.size]),
                                          np.arange(1, sample.size)))
        for cut in range(1, sample.size):  # from a prompt of every length, then token by token
            cursor = Cursor(policy, sample[:cut])
            for i in range(cut, sample.size):
                np.testing.assert_allclose(cursor.logits(), want[i - 1], atol=1e-4)
                before = cursor.copy()
                cursor.push(int(sample[i]))
                np.testing.assert_allclose(before.logits(), want[i - 1], atol=1e-4)  # a copy is independent


def test_initial_policy_ends_a_turn_with_the_set_probability() -> None:
    policy = Policy.initial()
    z = Cursor(policy, sequences(policy)[0]).logits()
    p = np.exp(z - z.max())
    p /= p.sum()
    assert p[policy.vocab.eos_id] == pytest.approx(INITIAL_STOP_PROBABILITY, rel=1e-6)
    assert p[~policy.vocab.sampleable].sum() == 0.0


def test_save_and_load(tmp_path: Path) -> None:
    policy = perturbed()
    policy.step = 5
    assert Policy.load(tmp_path) is None  # a directory without a policy file: a trainer that saves nothing
    policy.save(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [FILE]  # no temp file left
    loaded = Policy.load(tmp_path)
    assert loaded is not None
    assert loaded.step == 5
    assert all(np.array_equal(loaded.weights[k], policy.weights[k]) for k in WEIGHTS)
    (tmp_path / FILE).write_bytes(b"not a policy")
    with pytest.raises(CheckpointError, match="not a tiny policy file"):
        Policy.load(tmp_path)
    arrays: dict[str, Any] = {"meta": np.array('{"format": 1}'), **policy.weights}
    np.savez(tmp_path / FILE, **arrays)
    with pytest.raises(CheckpointError, match="this build reads"):
        Policy.load(tmp_path)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("sampling", [
    {"temperature": 1.0}, {"temperature": 0.6}, {"temperature": 1.5, "top_k": 40}, {"temperature": 0.8, "top_p": 0.7},
    {"temperature": 1.0, "top_k": 100, "top_p": 0.9},
])
def test_sampled_logprobs_are_exact_in_each_logprobs_mode(sampling: dict[str, Any], mode: str) -> None:
    """Tokens come from the distribution of temperature, then top-k, then top-p. What the server reports for each
    is, computed here from the batched logits independently: processed, log π(token | context) under that
    distribution; raw (vLLM's default), the log-softmax of the unscaled logits (as observed on vLLM 0.31.0: to
    5e-7 of a float32 recomputation, and 0.19 off the tempered one at T = 0.7)."""
    sim = SimPolicy(SimVocab.load(), seed=3, logprobs_mode=logprobs_mode_named(mode))
    sim.model = perturbed(seed=5, scale=0.3)
    prompt = sequences(sim.model)[0][:10]
    sp = SamplingParams(max_tokens=12, logprobs=1, ignore_eos=True, **sampling)
    for _ in range(5):
        sample = sim.sample(prompt.tolist(), sp)
        ids = np.concatenate([prompt, sample.token_ids])
        logits = sim.model.logits_at(Sequences(ids, np.array([0, ids.size]), np.arange(prompt.size, ids.size)))
        for row, tok, reported in zip(logits, sample.token_ids, sample.logprobs, strict=True):
            z = row / sp.temperature
            if sp.top_k:
                z = np.where(z >= np.sort(z)[-sp.top_k], z, -np.inf)
            order = np.argsort(-z, kind="stable")
            p = np.exp(z[order] - z[order[0]])
            kept = order[: int(np.searchsorted(np.cumsum(p) / p.sum(), sp.top_p)) + 1]
            assert tok in kept  # never an excluded token
            if mode == "raw_logprobs":
                lp = row[tok] - row.max() - np.log(np.exp(row - row.max()).sum())
            else:
                lp = z[tok] - z[kept].max() - np.log(np.exp(z[kept] - z[kept].max()).sum())
            assert reported == pytest.approx(lp, abs=1e-6)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_greedy_sampling_takes_the_most_likely_token_and_reports_raw_logprobs(mode: str) -> None:
    """In either mode: vLLM's greedy path returns before any processing (v031:v1/sample/sampler.py)."""
    sim = SimPolicy(SimVocab.load(), seed=3, logprobs_mode=logprobs_mode_named(mode))
    sim.model = perturbed(seed=6, scale=0.3)
    prompt = sequences(sim.model)[1][:8]
    sample = sim.sample(prompt.tolist(), SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True))
    ids = np.concatenate([prompt, sample.token_ids])
    logits = sim.model.logits_at(Sequences(ids, np.array([0, ids.size]), np.arange(prompt.size, ids.size)))
    assert np.array_equal(sample.token_ids, logits.argmax(axis=1))
    shifted = logits - logits.max(axis=1, keepdims=True)
    raw = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    assert sample.logprobs == pytest.approx(raw.max(axis=1), abs=1e-6)
    assert sample.top_logprobs[:, 1] == pytest.approx(np.sort(raw, axis=1)[:, -2], abs=1e-6)  # the runner-up
    assert np.all(sample.ranks == 1)


def test_min_tokens_holds_back_every_stop_id_and_eos_until_that_many_are_sampled() -> None:
    """vLLM's min-tokens processor masks the stop ids and EOS (even with ignore_eos) for the first ``min_tokens``
    tokens; raw logprobs are reported before that mask. A policy that stops at once otherwise replies at length."""
    sim = SimPolicy(SimVocab.load(), seed=3)
    sim.model = perturbed(seed=5, scale=0.3)
    prompt = sequences(sim.model)[0][:10].tolist()
    eos = sim.vocab.eos_id
    stop = int(Cursor(sim.model, np.array(prompt)).logits().argmax())  # the likeliest id after the prompt
    free = [len(sim.sample(prompt, SamplingParams(max_tokens=40, stop_token_ids=frozenset({stop}))).token_ids)
            for _ in range(20)]
    held = [sim.sample(prompt, SamplingParams(max_tokens=40, min_tokens=30, stop_token_ids=frozenset({stop}),
                                              ignore_eos=ignore)) for _ in range(10) for ignore in (False, True)]
    assert min(free) < 30  # it stops early on its own ...
    for sample in held:  # ... and not while min_tokens hold the stops back
        assert len(sample.token_ids) >= 30
        assert not {stop, eos} & set(sample.token_ids[:30].tolist())


def test_raw_sampling_at_temperature_one_draws_what_the_general_path_draws() -> None:
    """Raw logprobs at temperature 1 with nothing cut (RL's sampling) take a shorter path: one exponential for the
    draw and the reported logprobs, the min_tokens mask applied to the weights after. From the same seed it draws
    the very tokens the general path (processed logprobs) draws, with the likeliest id masked for the first
    ``min_tokens``, and past the mask both report the same logprobs."""
    raw, processed = (SimPolicy(SimVocab.load(), seed=3, logprobs_mode=logprobs_mode_named(mode))
                      for mode in ("raw_logprobs", "processed_logprobs"))
    raw.model = processed.model = perturbed(seed=5, scale=0.3)
    prompt = sequences(raw.model)[0][:10].tolist()
    stop = int(Cursor(raw.model, np.array(prompt)).logits().argmax())  # the likeliest id after the prompt
    sp = SamplingParams(max_tokens=40, min_tokens=20, stop_token_ids=frozenset({stop}), logprobs=1)
    for _ in range(10):
        a, b = raw.sample(prompt, sp), processed.sample(prompt, sp)
        assert np.array_equal(a.token_ids, b.token_ids)
        assert len(a.token_ids) >= 20
        assert stop not in a.token_ids[:20].tolist()
        assert a.logprobs[20:] == pytest.approx(b.logprobs[20:], abs=1e-9)


def test_a_mask_over_all_the_weight_draws_from_the_ids_left() -> None:
    """An end of turn ~1000 nats likelier than any other id leaves the shorter path no weight to draw from once
    min_tokens masks it (every other exponential underflows to 0): it draws as the general path does, from the
    ids left, shifted to their best."""
    raw, processed = (SimPolicy(SimVocab.load(), seed=3, logprobs_mode=logprobs_mode_named(mode))
                      for mode in ("raw_logprobs", "processed_logprobs"))
    weights = {k: v.copy() for k, v in Policy.initial().weights.items()}
    eos = raw.vocab.eos_id
    weights["context"][0, eos] += 1000.0
    raw.model = processed.model = Policy(weights)
    prompt = sequences(raw.model)[0][:10].tolist()
    assert int(Cursor(raw.model, np.array(prompt)).logits().argmax()) == eos
    sp = SamplingParams(max_tokens=12, min_tokens=8, logprobs=1)
    for _ in range(5):
        a, b = raw.sample(prompt, sp), processed.sample(prompt, sp)
        assert np.array_equal(a.token_ids, b.token_ids)
        assert eos not in a.token_ids[:8].tolist()
        assert raw.vocab.sampleable[a.token_ids].all()
        assert a.token_ids[8] == eos  # unmasked, it ends the turn at once


def test_new_weights_forget_every_prompt_s_sampling_state() -> None:
    """A prompt seen before the weights changed is sampled from the new weights (the server keeps the state
    after each prompt it sees, for the rest of its group)."""
    sim = SimPolicy(SimVocab.load(), seed=3)
    prompt = sequences(sim.model)[0][:10].tolist()
    sp = SamplingParams(max_tokens=1, logprobs=1)
    sim.sample(prompt, sp)
    w = Policy.initial().weights
    w["context"][0, :] = 0.0
    w["context"][0, 140] = 50.0  # one token takes all the mass
    sim.model = Policy(w)
    assert sim.sample(prompt, sp).token_ids.tolist() == [140]
