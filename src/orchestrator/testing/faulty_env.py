# mypy: allow-subclassing-any
"""A taskset that fails on purpose, for testing how a job copes with broken environments.

Taskset id ``orchestrator-faulty`` (the ``orchestrator_faulty`` package re-exports this module, as the built-in
environments are registered). It is the arithmetic environment plus one injected fault, chosen by its args::

    [[env]]
    taskset = "orchestrator-faulty"
    args = { fail_in = "rollout", rate = 0.5 }

``fail_in``:

- ``"none"`` (default): no fault; behaves like ``orchestrator-arithmetic``.
- ``"load"``: ``load()`` raises, so the environment cannot start (an ``EnvironmentLoadError`` naming it).
- ``"rollout"``: the harness raises in ``launch()`` (before the first model call) for a ``rate`` share of rollouts.
- ``"scoring"``: the reward function raises for a ``rate`` share of rollouts (after the model answered).
- ``"nan_reward"``: the reward function returns NaN, without raising, for a ``rate`` share of rollouts.
- ``"data"``: a ``rate`` share of tasks carry invalid data (an ``answer`` that is not an integer, as a
  dataset row read without validation would); every rollout of such a task fails when the harness checks its data.
- ``"hold_cpu"`` / ``"hold_sleep"``: the first rollout each worker process scores holds the process's event loop
  for ``hold_s`` seconds, spinning on the CPU (environment code doing heavy work inline) or asleep in a blocking
  call (a synchronous request that hangs); nothing fails. ``rate`` does not apply.
- ``"hold_load"``: ``load()`` sleeps ``hold_s`` seconds first (a dataset download), so its worker stays loading.

The share is spread evenly and deterministically, not drawn at random: with ``rate = 0.5`` every second
rollout of each task fails (counted per worker process; ``rollout``, ``scoring``, ``nan_reward``) and every
second task is invalid (``data``), so a group of two or more rollouts keeps survivors in those three modes.
Injected faults raise ``InjectedFault`` whose message starts with ``injected fault in <where>``; invalid data
raises ``InvalidTaskData`` naming the task and the bad field.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Literal, cast

import verifiers.v1 as vf

from orchestrator.envs.arithmetic import closeness, last_number
from orchestrator.envs.harness import ChatHarness

__all__ = ["FaultyHarness", "FaultyTaskset"]

FaultSite = Literal["none", "load", "rollout", "scoring", "nan_reward", "data", "hold_cpu", "hold_sleep", "hold_load"]


class InjectedFault(RuntimeError):
    """The fault this environment was configured to raise."""


class InvalidTaskData(ValueError):
    """A task's data does not have the fields and types the environment needs."""


def nth_fails(n: int, rate: float) -> bool:
    """Whether the ``n``-th event (1-based) of an evenly spread ``rate`` share fails."""
    return math.floor(n * rate) > math.floor((n - 1) * rate)


def hold(seconds: float, *, spin: bool) -> None:
    """Hold the calling thread (in a reward function: the worker's event loop) for ``seconds``."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if not spin:
            time.sleep(left)


class FaultyData(vf.TaskData):
    answer: int | str  # a string is invalid data: check_data rejects it when a rollout starts
    fail_in: str = "none"
    rate: float = 1.0
    hold_s: float = 0.0


def check_data(data: vf.TaskData) -> FaultyData:
    """The task's data, validated; InvalidTaskData naming the task and the bad field otherwise."""
    answer = getattr(data, "answer", None)
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise InvalidTaskData(f"invalid task data (task {data.idx}): answer must be an integer, got {answer!r}")
    return cast(FaultyData, data)


# (fault site, task) -> rollouts of that task this process has reached the site with
_reached: Counter[tuple[str, int | None]] = Counter()


def fails_here(data: FaultyData, site: str) -> bool:
    """Whether this rollout of ``data``'s task fails at ``site`` (the task's n-th arrival there)."""
    if data.fail_in != site:
        return False
    _reached[(site, data.idx)] += 1
    return nth_fails(_reached[(site, data.idx)], data.rate)


class FaultyTask(vf.Task[FaultyData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        data = check_data(self.data)
        if fails_here(data, "scoring"):
            raise InjectedFault(f"injected fault in scoring (task {data.idx})")
        if fails_here(data, "nan_reward"):
            return math.nan
        if data.fail_in in ("hold_cpu", "hold_sleep") and not _reached[(data.fail_in, None)]:
            _reached[(data.fail_in, None)] += 1
            hold(data.hold_s, spin=data.fail_in == "hold_cpu")
        return closeness(last_number(trace), int(data.answer))


class FaultyTasksetConfig(vf.TasksetConfig):
    fail_in: FaultSite = "none"
    rate: float = 1.0
    hold_s: float = 0.0
    num_tasks: int = 100
    max_operand: int = 50
    seed: int = 0


class FaultyTaskset(vf.Taskset[FaultyTask, FaultyTasksetConfig]):
    def load(self) -> Iterable[FaultyTask]:
        cfg = self.config
        if not 0.0 <= cfg.rate <= 1.0:
            raise ValueError(f"rate must be within 0..1, got {cfg.rate}")
        if cfg.fail_in == "load":
            raise InjectedFault("injected fault in load: this taskset cannot load its tasks")
        if cfg.fail_in == "hold_load":
            time.sleep(cfg.hold_s)
        rng = random.Random(cfg.seed)
        for i in range(cfg.num_tasks):
            a, b = rng.randint(0, cfg.max_operand), rng.randint(0, cfg.max_operand)
            prompt = f"What is {a} + {b}? Answer with the number."
            if cfg.fail_in == "data" and nth_fails(i + 1, cfg.rate):
                data = FaultyData(prompt=prompt, answer=f"{a} plus {b}", fail_in=cfg.fail_in, rate=cfg.rate,
                                 hold_s=cfg.hold_s)
            else:
                data = FaultyData(prompt=prompt, answer=a + b, fail_in=cfg.fail_in, rate=cfg.rate, hold_s=cfg.hold_s)
            yield FaultyTask(data)


class FaultyHarness(ChatHarness):
    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, **kwargs: Any) -> vf.ProgramResult:
        checked = check_data(data)
        if fails_here(checked, "rollout"):
            raise InjectedFault(f"injected fault in rollout (task {checked.idx})")
        return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs)

