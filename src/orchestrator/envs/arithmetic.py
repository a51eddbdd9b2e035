"""Single-turn arithmetic: add or subtract two small numbers, answer with the number.

Reward: 1 for the exact answer, else partial credit that falls with the distance to it (so a group of
rollouts gets different rewards, and advantages, even from a weak policy), 0 with no number at all.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator

import verifiers.v1 as vf

from orchestrator.envs.harness import ChatHarness, assistant_texts

__all__ = ["ArithmeticHarness", "ArithmeticTaskset"]


class ArithmeticData(vf.TaskData):
    answer: int


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return closeness(last_number(trace), self.data.answer)


def last_number(trace: vf.Trace) -> int | None:
    """The last number in the model's last reply."""
    texts = assistant_texts(trace)
    numbers = re.findall(r"-?\d+", texts[-1]) if texts else []
    return int(numbers[-1]) if numbers else None


def closeness(guess: int | None, answer: int) -> float:
    if guess is None:
        return 0.0
    return 1.0 if guess == answer else 0.5 / (1.0 + abs(guess - answer) / 10.0)


class ArithmeticTasksetConfig(vf.TasksetConfig):
    max_operand: int = 50
    num_tasks: int = 1000
    seed: int = 0


def problems(seed: int = 0, num_tasks: int = 1000, max_operand: int = 50) -> Iterator[tuple[str, int]]:
    """The taskset's (prompt, answer) pairs, in its order (bench_real_vllm.py sends the same prompts directly)."""
    rng = random.Random(seed)
    for _ in range(num_tasks):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        yield f"What is {a} {op} {b}? Answer with the number.", a + b if op == "+" else a - b


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticTasksetConfig]):
    def load(self) -> Iterable[ArithmeticTask]:
        c = self.config
        for prompt, answer in problems(c.seed, c.num_tasks, c.max_operand):
            yield ArithmeticTask(ArithmeticData(prompt=prompt, answer=answer))


class ArithmeticHarness(ChatHarness):
    pass


