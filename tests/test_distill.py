"""On-policy distillation end to end: real env worker processes score every sample under a simulated teacher (another
policy), and the trainer gets the teacher's exact logprob of every token, on both data planes and multi-turn
included; a teacher that answers garbage costs counted rollouts, never a sample without its column."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.config import JobConfig
from orchestrator.contracts.wire import Batch
from orchestrator.policy import Policy
from orchestrator.sim.server import Faults
from orchestrator.testing.distill import TEACHER_SEED, exact_logprobs
from orchestrator.testing.jobs import ARITHMETIC, Section, job_config
from orchestrator.testing.sim import sim_cluster
from orchestrator.trainer.reference import ReferenceTrainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("verifiers_home")]
JOB_GUARD_S = 240.0

# one env worker process (it runs every env): each costs seconds of CPU to start
ENVS: list[Section] = [
    {**ARITHMETIC, "name": "arith", "algorithm": "opd"},
    {"name": "guess", "taskset": "orchestrator-guess-number", "args": {"max_turns": 3}, "group_size": 4, "workers": 0,
     "sampling": {"max_tokens": 3}, "algorithm": "reward+opd", "opd_weight": 0.5},
    {**ARITHMETIC, "name": "plain", "workers": 0},  # reward only: no teacher, a column of zeros
]


@dataclass
class Seen:
    """One sample as the trainer got it (copies: the batch's columns are views of its frames)."""

    env: str
    token_ids: np.ndarray
    loss_mask: np.ndarray
    ref_logprobs: np.ndarray
    scalars: dict[str, Any]


def seen(batch: Batch) -> list[Seen]:
    assert "ref_logprobs" in batch.columns, sorted(batch.columns)
    out = []
    for i in range(batch.num_samples):
        s = batch.sample(i)
        out.append(Seen(str(s["env"]), np.array(s["token_ids"]), np.array(s["loss_mask"]),
                        np.array(s["ref_logprobs"]), {k: s[k] for k in batch.scalars}))
    return out


def job(tmp_path: Path, urls: list[str], teacher: list[str], data_plane: str, steps: int,
        envs: list[Section] = ENVS, **teacher_keys: Any) -> JobConfig:
    return job_config(
        tmp_path, overrides=["pipeline.gates=[]"], run={"name": "t", "max_steps": steps},
        inference={"servers": urls, "request_timeout_s": 120.0},
        teacher={"servers": teacher, "model": "teacher", "retry_backoff_s": 0.0, **teacher_keys},
        scheduler={"batch_size": 12, "max_inflight": 12, "max_async_level": 1, "max_off_policy_steps": 2,
                   "max_buffered_rollouts": 24},
        transport={"data_plane": data_plane}, env=envs)


async def run_job(cfg: JobConfig, opened: Callable[[], None] = lambda: None
                  ) -> tuple[list[Seen], list[dict[str, Any]]]:
    """The job's samples as the trainer got them, and its metrics; ``opened`` runs after preflight."""
    samples: list[Seen] = []
    async with Orchestrator.open(cfg) as orch:
        opened()
        trainer = ReferenceTrainer(orch.sender.address, max_steps=cfg.run.max_steps,
                                   checkpoint_dir=Path(cfg.run.output_dir) / "ckpt",
                                   on_batch=lambda b: samples.extend(seen(b)))
        async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
            tg.create_task(trainer.run())
            await orch.run()
    out = Path(cfg.run.output_dir)
    return samples, [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()]


def check_columns(samples: list[Seen]) -> None:
    """Every sample of a distilling env carries its teacher's exact logprobs, the others zeros, with their weights."""
    teacher = Policy.seeded(TEACHER_SEED)
    weights = {"arith": (1.0, 0.0), "guess": (0.5, 1.0), "plain": (0.0, 1.0)}  # (opd_weight, reward_weight)
    for s in samples:
        assert (s.scalars["opd_weight"], s.scalars["reward_weight"]) == weights[s.env]
        assert s.ref_logprobs.dtype == np.float32
        if s.env == "plain":
            assert not s.ref_logprobs.any()
            continue
        assert s.ref_logprobs[0] == 0.0  # no context
        np.testing.assert_allclose(s.ref_logprobs, exact_logprobs(teacher, s.token_ids), rtol=1e-6, atol=1e-6)
        if s.env == "arith":
            assert s.scalars["advantage"] == 0.0  # opd: the teacher's term alone


async def test_the_trainer_gets_the_teachers_exact_logprob_of_every_token(tmp_path: Path, data_plane: str) -> None:
    async with sim_cluster(1) as policy, sim_cluster(1, model="teacher", policy_seed=TEACHER_SEED) as teacher:
        cfg = job(tmp_path, policy.urls, teacher.urls, data_plane, steps=3)
        samples, metrics = await run_job(cfg)
        scored = teacher[0].counters.requests
    check_columns(samples)
    assert {s.env for s in samples} == {"arith", "guess", "plain"}
    runs = [int(np.count_nonzero(np.diff(s.loss_mask.astype(np.int8), prepend=0) == 1))
            for s in samples if s.env == "guess"]
    assert max(runs) > 1  # multi-turn samples: several sampled spans, scored as one sequence
    assert scored >= sum(s.env != "plain" for s in samples)  # one request per distilled sample (more were scored:
    # samples of rollouts not trained on)
    assert not any(k.startswith("teacher") for m in metrics for k in m["failed_by"]), metrics[-1]["failed_by"]


async def test_a_teacher_that_answers_garbage_fails_rollouts_counted_and_ships_none(tmp_path: Path,
                                                                                   data_plane: str) -> None:
    async with sim_cluster(1) as policy, sim_cluster(1, model="teacher", policy_seed=TEACHER_SEED) as teacher:
        cfg = job(tmp_path, policy.urls, teacher.urls, data_plane, steps=2, envs=ENVS[:1], retries=0)
        samples, metrics = await run_job(cfg, lambda: setattr(teacher[0], "faults", Faults(malformed_rate=0.3)))
        garbage = teacher[0].counters.malformed
    check_columns(samples)  # no sample carries a bad column
    failed = sum(m["failed_by"].get("teacher_malformed", 0) for m in metrics)
    assert garbage > 0
    assert failed > 0
