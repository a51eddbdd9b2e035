"""The loop learns: the batches we ship teach the policy that sampled them, and wrong batches do not.

Whole loop, real processes (``orchestrator.testing.learning.run_learning``): a simulated inference server
samples every token from the tiny policy (``orchestrator.policy``), an env worker runs a built-in environment
against it, the orchestrator ships each step, and the learning trainer (``orchestrator receive --learn``) takes
clipped importance-weighted policy-gradient steps from exactly what it receives, saves the new policy and
announces it; weight sync loads it into the server before the next step is sampled.

Negative controls: the same run (same seed: the same tasks in every step, the same server generator) with the
trainer's data deliberately wrong: advantages shuffled across samples, loss mask one token late, behaviour
logprobs zeros. Each must miss the margin the right data reaches, which is what lets the positive test fail
when the data is wrong. Arithmetic answers are one token (``max_tokens = 1``): with longer replies a mask one
token late still trains mostly sampled tokens and learns about as well (offline: +0.07..+0.13 over three seeds
with two-token answers), so that control could not fail. Arithmetic uses 12 tasks, so the first steps and the
last hold the same tasks and a margin measures the policy, not which tasks happened to come late.

Timing: on-policy (``max_async_level = 0``), every rollout of step ``s`` is sampled with the weights of step
``s`` and the scheduler opens exactly one batch of groups per policy, so the tasks and weights of every step
are fixed by the seed; what is left to timing is which concurrent request draws which random number. MARGIN
sits between the margins measured over seeds and repeats (``scripts/perf/bench_learning.py``; figures in
scripts/perf/README.md): right data at least 0.108, every control at most 0.021.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from orchestrator.testing.learning import margin, rewards, run_learning

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1300)]

STEPS = 16
FIRST, LAST = 3, 6  # the margin: mean reward of the last LAST steps minus that of the first FIRST
MARGIN = 0.07  # right data reaches it on every environment, no control does (arithmetic)
RUNS_TIMEOUT_S = 1200.0  # only ever reached when something hangs: the five runs take 2-5 minutes on 2 cores

# name: (seed, corruption, environment, rollouts a step)
RUNS: dict[str, tuple[int, str | None, str, int]] = {
    "right": (3, None, "arithmetic", 64),
    "shuffle": (3, "shuffle", "arithmetic", 64),
    "shift": (3, "shift", "arithmetic", 64),
    "zeros": (3, "zeros", "arithmetic", 64),
    "guess": (3, None, "guess-number", 32),
}
Metrics = list[dict[str, Any]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Metrics]:
    """Every run of RUNS, one after the other (at once, they starve each other's env workers on 2 cores until
    the hub declares them dead), shared by the tests below; each run's curve is in its curve.json."""
    tmp = tmp_path_factory.mktemp("learning")

    async def all_runs() -> dict[str, Metrics]:
        out = {}
        async with asyncio.timeout(RUNS_TIMEOUT_S):
            for name, (seed, corrupt, env, batch_size) in RUNS.items():
                out[name] = await run_learning(tmp / name, seed, STEPS, corrupt, (env,), batch_size)
                (tmp / name / "curve.json").write_bytes(orjson.dumps([m["reward_mean"] for m in out[name]]))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp / "home"))  # verifiers writes ~/.cache/verifiers
        return asyncio.run(all_runs())


def curve(metrics: Metrics, env: str = "arithmetic") -> list[float]:
    return [round(r, 3) for r in rewards(metrics, env)]


def test_every_step_is_sampled_with_the_weights_it_trains(runs: dict[str, Metrics]) -> None:
    for name, metrics in runs.items():
        batch = RUNS[name][3]
        assert [m["policy"] for m in metrics] == list(range(STEPS)), name
        assert [(m["rollouts"], m["failed"]) for m in metrics] == [(batch, 0)] * STEPS, name  # one batch per policy


@pytest.mark.parametrize(("run", "env"), [("right", "arithmetic"), ("guess", "guess-number")])
def test_reward_rises_on_every_built_in_environment_when_the_data_is_right(runs: dict[str, Metrics], run: str,
                                                                          env: str) -> None:
    assert margin(runs[run], env, FIRST, LAST) >= MARGIN, curve(runs[run], env)


@pytest.mark.parametrize("corrupt", ["shuffle", "shift", "zeros"])
def test_reward_does_not_rise_when_the_trainer_gets_wrong_data(runs: dict[str, Metrics], corrupt: str) -> None:
    assert margin(runs[corrupt], "arithmetic", FIRST, LAST) < MARGIN, curve(runs[corrupt])
