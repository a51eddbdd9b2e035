from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from orchestrator.config import DEFAULT_FILTERS, FilterConfig, PipelineConfig
from orchestrator.errors import ConfigError
from orchestrator.scoring.advantage import AdvantageFn, group_mean_advantage
from orchestrator.scoring.filters import FilterSet, is_gibberish, is_repetition, longest_run


@dataclass
class R:
    reward: float
    env: str = "e"
    token_ids: np.ndarray = field(default_factory=lambda: np.arange(8, dtype=np.int32))
    logprobs: np.ndarray = field(default_factory=lambda: np.full(8, -1.0, dtype=np.float32))

    def sampled(self) -> tuple[np.ndarray, np.ndarray]:
        return self.token_ids, self.logprobs


@pytest.fixture
def hooks() -> Iterator[types.ModuleType]:
    mod = types.ModuleType("user_hooks")

    def rank_advantage(group: list[R], scale: float = 1.0) -> list[float]:
        order = np.argsort([r.reward for r in group])
        return list((order - order.mean()) * scale)

    def wrong_length(group: list[R]) -> list[float]:
        return [0.0]

    def long_rollout(rollout: R, advantage: float, min_tokens: int) -> bool:
        return len(rollout.token_ids) >= min_tokens

    vars(mod).update(rank_advantage=rank_advantage, wrong_length=wrong_length, long_rollout=long_rollout)
    sys.modules["user_hooks"] = mod
    yield mod
    del sys.modules["user_hooks"]


def test_group_mean_advantage() -> None:
    np.testing.assert_allclose(group_mean_advantage(np.array([1.0, 0.0, 0.5, 0.5])), [0.5, -0.5, 0, 0])
    norm = group_mean_advantage(np.array([1.0, 0.0]), std_normalize=True)
    np.testing.assert_allclose(norm, [1.0, -1.0], rtol=1e-5)


def test_group_of_one_and_empty_get_zero() -> None:
    assert group_mean_advantage(np.array([0.7])).tolist() == [0.0]
    fn = AdvantageFn(PipelineConfig())
    assert fn([R(0.7)]).tolist() == [0.0]
    assert fn([]).size == 0


def test_equal_rewards_give_exact_zero_and_are_filtered() -> None:
    adv = AdvantageFn(PipelineConfig())([R(0.3), R(0.3), R(0.3)])
    assert adv.tolist() == [0.0, 0.0, 0.0]
    filters = FilterSet(DEFAULT_FILTERS, vocab_size=1000)
    assert filters(R(0.3), float(adv[0])).filtered


def test_zero_advantage_never_filters_a_rollout_of_an_env_that_distils() -> None:
    filters = FilterSet(DEFAULT_FILTERS, vocab_size=1000, distilling=["opd"])
    assert not filters(R(0.3, env="opd"), 0.0).filtered  # its teacher's term carries the gradient
    assert filters(R(0.3, env="e"), 0.0).filtered
    assert filters.take_counts() == {"zero_advantage": {"e": 1}}


def test_partial_group_uses_survivors_only() -> None:
    adv = AdvantageFn(PipelineConfig())([R(1.0), R(0.0)])  # two of a group of four came back
    assert adv.tolist() == [0.5, -0.5]


def test_custom_advantage_with_kwargs(hooks: types.ModuleType) -> None:
    cfg = PipelineConfig(advantage="user_hooks:rank_advantage", advantage_kwargs={"scale": 2.0})
    adv = AdvantageFn(cfg)([R(0.1), R(0.9), R(0.5)])
    assert adv.tolist() == [-2.0, 2.0, 0.0]
    assert AdvantageFn(cfg)([R(1.0)]).tolist() == [0.0]


def test_custom_advantage_wrong_length_is_an_error(hooks: types.ModuleType) -> None:
    fn = AdvantageFn(PipelineConfig(advantage="user_hooks:wrong_length"))
    with pytest.raises(ValueError, match="returned shape"):
        fn([R(0.0), R(1.0)])


@pytest.mark.parametrize("spec", ["no_colon", "no_such_module_xyz:f", "user_hooks:missing"])
def test_bad_advantage_spec_is_a_config_error(spec: str, hooks: types.ModuleType) -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.advantage"):
        AdvantageFn(PipelineConfig(advantage=spec))


def test_longest_run() -> None:
    assert longest_run(np.array([], dtype=bool)) == 0
    assert longest_run(np.array([0, 1, 1, 0, 1, 1, 1, 0], dtype=bool)) == 3
    assert longest_run(np.ones(5, dtype=bool)) == 5


def test_repetition_detects_a_confident_loop() -> None:
    lp = np.full(100, -2.0, dtype=np.float32)
    assert not is_repetition(lp, window=10)
    lp[40:55] = -0.001
    assert is_repetition(lp, window=10)
    assert not is_repetition(lp, window=16)


def test_gibberish_needs_rare_token_and_low_logprob() -> None:
    ids = np.array([5, 150_000, 7], dtype=np.int32)
    assert not is_gibberish(ids, np.array([-1.0, -5.0, -1.0]), vocab_size=150_000)
    assert is_gibberish(ids, np.array([-1.0, -20.0, -1.0]), vocab_size=150_000)
    assert not is_gibberish(np.array([5, 6, 7]), np.full(3, -20.0), vocab_size=150_000)


def test_filter_set_marks_and_counts_per_env(hooks: types.ModuleType) -> None:
    filters = FilterSet(
        [*DEFAULT_FILTERS, FilterConfig(name="user_hooks:long_rollout", enforce=False, args={"min_tokens": 8})],
        vocab_size=1000,
    )
    looping = R(1.0, env="a", logprobs=np.full(8, -1e-4, dtype=np.float32))
    v = filters(looping, 0.5)
    assert v.matched == ("user_hooks:long_rollout",)  # repetition window (3000) not reached
    assert not v.filtered
    v = filters(R(0.0, env="b"), 0.0)
    assert v.matched == ("zero_advantage", "user_hooks:long_rollout")
    assert v.filtered
    assert filters.take_counts() == {"user_hooks:long_rollout": {"a": 1, "b": 1}, "zero_advantage": {"b": 1}}
    assert filters.take_counts() == {}


def test_monitor_only_filter_does_not_drop() -> None:
    filters = FilterSet([FilterConfig(name="repetition", enforce=False, args={"window": 4})], vocab_size=10)
    v = filters(R(1.0, logprobs=np.full(8, -1e-4, dtype=np.float32)), 1.0)
    assert v.matched == ("repetition",)
    assert not v.filtered


def test_bad_filter_args_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"pipeline.filters\[0\].args: bad arguments for filter 'repetition'"):
        FilterSet([FilterConfig(name="repetition", enforce=True, args={"windw": 3})], vocab_size=10)
    with pytest.raises(ConfigError, match=r"pipeline.filters\[0\].name"):
        FilterSet([FilterConfig(name="nonexistent", enforce=True)], vocab_size=10)
