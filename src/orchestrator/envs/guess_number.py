"""Multi-turn guess-the-number: the model guesses, the environment says "higher" or "lower", 2-6 turns.

Reward: 1 for finding the number, else partial credit for how close the last guess came, minus a little
per extra turn; 0 when no guess was a number. Rewards vary within a group, so advantages are non-zero.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

import verifiers.v1 as vf

from orchestrator.envs.harness import ChatHarness, assistant_texts

__all__ = ["GuessNumberHarness", "GuessNumberTaskset"]


class GuessData(vf.TaskData):
    secret: int
    max_number: int
    max_turns: int


def parse_guess(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def feedback(secret: int, text: str, turn: int, max_turns: int) -> str | None:
    """The environment's reply to a guess, or None when the game is over."""
    guess = parse_guess(text)
    if guess == secret or turn + 1 >= max_turns:
        return None
    if guess is None:
        return "That is not a number. Guess a number."
    return "Too low. Guess higher." if guess < secret else "Too high. Guess lower."


def guess_reward(guesses: list[int | None], secret: int, max_number: int) -> float:
    numeric = [g for g in guesses if g is not None]
    if not numeric:
        return 0.0
    if numeric[-1] == secret:
        return 1.0 - 0.05 * (len(guesses) - 1)
    return 0.5 * max(0.0, 1.0 - abs(numeric[-1] - secret) / max_number)


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def found(self, trace: vf.Trace) -> float:
        guesses = [parse_guess(t) for t in assistant_texts(trace)]
        return guess_reward(guesses, self.data.secret, self.data.max_number)


class GuessNumberTasksetConfig(vf.TasksetConfig):
    max_number: int = 100
    max_turns: int = 6
    num_tasks: int = 1000
    seed: int = 0


class GuessNumberTaskset(vf.Taskset[GuessTask, GuessNumberTasksetConfig]):
    def load(self) -> Iterable[GuessTask]:
        cfg = self.config
        if not 2 <= cfg.max_turns <= 6:
            raise ValueError(f"max_turns must be within 2..6, got {cfg.max_turns}")
        rng = random.Random(cfg.seed)
        for _ in range(cfg.num_tasks):
            secret = rng.randint(0, cfg.max_number)
            prompt = f"Guess my number between 0 and {cfg.max_number}. Answer with a number."
            yield GuessTask(GuessData(prompt=prompt, secret=secret, max_number=cfg.max_number,
                                      max_turns=cfg.max_turns))


class GuessNumberHarness(ChatHarness):
    def follow_up(self, data: vf.TaskData, reply: str, turn: int) -> str | None:
        return feedback(int(data.secret), reply, turn, int(data.max_turns))  # type: ignore[attr-defined]
