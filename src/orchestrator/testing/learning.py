"""A learning run, as tests/test_learning.py and scripts/perf/bench_learning.py run it, and its negative controls.

``run_learning(directory, seed, steps, ...)`` runs the whole loop with real processes: a simulated inference
server (subprocess, prime-rl's routes), env workers (subprocesses) with the built-in environments, the
orchestrator (this process) and the learning trainer (a subprocess: ``orchestrator receive --learn``, or with
``corrupt`` this module's trainer with that corruption). It returns each step's metrics. On-policy
(``max_async_level = 0``): every rollout of step ``s`` is sampled with the weights of step ``s``, and the
scheduler opens exactly one batch of groups per policy, so the tasks and weights of every step are fixed by
the seed; only the order in which concurrent requests draw from the server's generator is left to timing.

The corruptions (``CORRUPTIONS``), applied in the trainer to every batch before the update:

- ``shuffle``: the advantages permuted across the batch's samples (seeded by the run's seed and the step);
- ``shift``: the loss mask moved one token later, the off-by-one of aligning the mask with the next-token
  target: it marks the token after each sampled one;
- ``zeros``: the behaviour logprobs replaced by zeros (as if the logprobs column were missing).

``python -m orchestrator.testing.learning ADDRESS CHECKPOINT_DIR --steps N --corrupt KIND [--seed S]`` is
``orchestrator receive ADDRESS --learn --checkpoint-dir DIR --steps N`` with the corruption.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.contracts.wire import Batch
from orchestrator.testing.jobs import Section, toml_text
from orchestrator.trainer.learner import LearnStats, PolicyLearner

CORRUPTIONS = ("shuffle", "shift", "zeros")
# arithmetic: 12 tasks, so the first steps and the last hold the same tasks (with 8 a step, 3 steps hold each
# twice, 6 steps four times) and a margin measures the policy, not which tasks came late. guess-number: a guess,
# the feedback, the guess that counts
ENV_ARGS: dict[str, Section] = {"arithmetic": {"num_tasks": 12}, "guess-number": {"max_turns": 2}}


def corrupt(batch: Batch, kind: str, seed: int) -> Batch:
    """A copy of ``batch`` with one corruption (the received columns are read-only views: new arrays)."""
    columns, scalars = dict(batch.columns), dict(batch.scalars)
    if kind == "shuffle":
        rng = np.random.default_rng([seed, batch.step])
        scalars["advantage"] = rng.permutation(np.asarray(scalars["advantage"])).tolist()
    elif kind == "shift":
        mask = np.zeros_like(columns["loss_mask"])
        mask[1:] = columns["loss_mask"][:-1]
        columns["loss_mask"] = mask
    elif kind == "zeros":
        columns["logprobs"] = np.zeros_like(columns["logprobs"])
    else:
        raise ValueError(f"unknown corruption {kind!r}; one of {CORRUPTIONS}")
    return dataclasses.replace(batch, columns=columns, scalars=scalars)


@dataclasses.dataclass
class CorruptedLearner(PolicyLearner):
    """A ``PolicyLearner`` that corrupts every batch (``kind``, one of ``CORRUPTIONS``) before learning from it."""

    kind: str = "shuffle"
    seed: int = 0

    def update(self, batch: Batch) -> LearnStats:
        return super().update(corrupt(batch, self.kind, self.seed))


def job_toml(directory: Path, url: str, seed: int, steps: int, envs: Sequence[str] = ("arithmetic",),
             batch_size: int = 64) -> str:
    """The job: on-policy, ``batch_size`` rollouts a step, groups of 8, one env worker per environment, answers
    of one token (with longer replies a mask one token late still trains mostly sampled tokens, so that
    control could not fail), no gates, the environments' arguments in ``ENV_ARGS``."""
    return toml_text(
        run={"name": "learning", "output_dir": directory / "out", "seed": seed, "max_steps": steps},
        inference={"servers": [url], "backend": "prime-rl", "request_timeout_s": 120.0},
        scheduler={"batch_size": batch_size, "max_inflight": batch_size, "max_async_level": 0,
                   "max_off_policy_steps": 0, "group_timeout_s": 300.0},
        # every group trains: with gates, which tasks make a step would depend on which groups are rejected
        pipeline={"gates": []},
        env=[{"name": env, "taskset": f"orchestrator-{env}", "group_size": 8, "workers": 1,
              "sampling": {"max_tokens": 1, "temperature": 1.0},
              **({"args": ENV_ARGS[env]} if env in ENV_ARGS else {})} for env in envs])


@contextlib.asynccontextmanager
async def trainer_process(address: str, checkpoints: Path, steps: int, corrupt: str | None,
                          seed: int) -> AsyncIterator[asyncio.subprocess.Process]:
    """The learning trainer for ``steps`` steps (a subprocess, killed by its pid on exit if still running)."""
    from orchestrator.procs import child_env
    from orchestrator.testing.procs import python_process

    if corrupt is None:
        argv = ["-m", "orchestrator", "--log-level", "WARNING", "receive", address, "--learn", "--checkpoint-dir",
                str(checkpoints)]
    else:
        argv = ["-m", "orchestrator.testing.learning", address, str(checkpoints), "--corrupt", corrupt, "--seed",
                str(seed)]
    async with python_process(*argv, "--steps", str(steps), env=child_env()) as proc:
        yield proc


async def run_learning(directory: Path, seed: int, steps: int, corrupt: str | None = None,
                       envs: Sequence[str] = ("arithmetic",), batch_size: int = 64) -> list[dict[str, Any]]:
    """One learning run in ``directory`` (created); each step's metrics. Verifiers writes under $HOME."""
    from orchestrator.app import Orchestrator
    from orchestrator.config import load_config
    from orchestrator.sim.process import sim_process

    directory.mkdir(parents=True)  # noqa: ASYNC240 - a few syscalls before anything starts
    async with sim_process(["--profile", "prime-rl", "--seed", str(seed)]) as sim:
        path = directory / "job.toml"
        path.write_text(job_toml(directory, sim.url, seed, steps, envs, batch_size))
        async with Orchestrator.open(load_config(path)) as orch, \
                trainer_process(orch.sender.address, directory / "checkpoints", steps, corrupt, seed) as trainer:
            summary = await orch.run()
            code = await trainer.wait()
            if code:
                raise RuntimeError(f"the learning trainer exited with {code}")
    return summary.metrics


def rewards(metrics: list[dict[str, Any]], env: str) -> list[float]:
    """The mean reward of ``env`` per step (steps without it skipped)."""
    return [float(m["reward_mean"][env]) for m in metrics if env in m["reward_mean"]]


def margin(metrics: list[dict[str, Any]], env: str, first: int, last: int) -> float:
    """Mean reward of the last ``last`` steps minus that of the first ``first``."""
    r = rewards(metrics, env)
    return float(np.mean(r[-last:]) - np.mean(r[:first]))


def main() -> int:
    p = argparse.ArgumentParser(description="a learning trainer that corrupts every batch before learning")
    p.add_argument("address")
    p.add_argument("checkpoint_dir", type=Path)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--corrupt", choices=CORRUPTIONS, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import zmq.asyncio

    from orchestrator.procs import die_with_parent
    from orchestrator.trainer.reference import ReferenceTrainer

    die_with_parent()
    trainer = ReferenceTrainer(args.address, max_steps=args.steps, checkpoint_dir=args.checkpoint_dir,
                               learner=CorruptedLearner(kind=args.corrupt, seed=args.seed))
    try:
        asyncio.run(trainer.run())
    finally:
        zmq.asyncio.Context.instance().term()  # the last acknowledgement goes out first (as `receive` does)
    return 0


if __name__ == "__main__":
    sys.exit(main())
