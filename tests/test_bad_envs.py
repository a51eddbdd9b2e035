"""Environments that fail, run through the real orchestrator: env worker processes (verifiers inside), a sim
server over HTTP, and the reference trainer over ZMQ.

The faults come from ``orchestrator-faulty`` (orchestrator.testing.faulty_env), selected by taskset args. One
job hosts four faulty environments at once (one env worker process loads them all), so verifiers is
imported once for the module; each test then checks one kind of fault in that job's outputs. A taskset
that fails to load is run through ``orchestrator run`` as a real process: a startup error naming the env.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.config import load_config
from orchestrator.contracts.wire import Batch
from orchestrator.testing.jobs import Section, write_job_toml
from orchestrator.testing.procs import processes_mentioning
from orchestrator.testing.sim import sim_servers
from orchestrator.trainer.reference import ReferenceTrainer

pytestmark = pytest.mark.slow

STEPS = 3


def faulty(name: str, fail_in: str, rate: float, workers: int = 0) -> Section:
    """An ``orchestrator-faulty`` environment that fails in ``fail_in`` for ``rate`` of its rollouts."""
    return {"name": name, "taskset": "orchestrator-faulty", "args": {"fail_in": fail_in, "rate": rate},
            "group_size": 4, "workers": workers, "sampling": {"max_tokens": 6}}


def write_faulty_job(tmp: Path, url: str) -> Path:
    """The job of the four faulty environments: every env worker hosts every environment (workers = 1 in total,
    so one process loads all four)."""
    return write_job_toml(
        tmp, run={"name": "faulty", "max_steps": STEPS},
        # slow replies on a busy host must not fail rollouts: only a hang would time out
        inference={"servers": [url], "request_timeout_s": 120.0},
        scheduler={"batch_size": 8, "max_inflight": 12, "max_buffered_rollouts": 24},
        pipeline={"gates": []},  # every finished group trains: gates are not what this test is about
        env=[faulty("rollout", "rollout", 0.5, workers=1), faulty("scoring", "scoring", 0.5),
             faulty("nan-reward", "nan_reward", 0.5), faulty("bad-data", "data", 1.0)])


@dataclass
class FaultyJob:
    steps_run: int
    received: list[int]  # steps the trainer got, in order
    advantages: list[tuple[int, str, float]] = field(default_factory=list)  # (step, env, advantage) trained on
    rows: list[dict[str, Any]] = field(default_factory=list)  # rollouts.jsonl
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl
    warnings: list[str] = field(default_factory=list)  # the orchestrator's WARNING+ log lines

    def failed(self, env: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["env"] == env and not r["ok"]]

    def ok(self, env: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["env"] == env and r["ok"]]

    def scheduler_counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for m in self.metrics:
            total.update({k: v for k, v in m["scheduler"].items() if isinstance(v, int)})
        return total


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


async def run_faulty_job(tmp: Path) -> FaultyJob:
    async with sim_servers(1) as servers:
        cfg = load_config(write_faulty_job(tmp, servers[0].url))
        advantages: list[tuple[int, str, float]] = []

        def keep(batch: Batch) -> None:
            advantages.extend((batch.step, str(e), float(a))
                              for e, a in zip(batch.scalars["env"], batch.scalars["advantage"], strict=True))

        async with Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=STEPS, on_batch=keep,
                                       checkpoint_dir=tmp / "ckpt")
            async with asyncio.timeout(240), asyncio.TaskGroup() as tg:  # a bound only (verifiers loads slowly)
                tg.create_task(trainer.run())
                summary = await orch.run()
    out = tmp / "out"
    return FaultyJob(summary.steps, [r.step for r in trainer.received], advantages,
                     [orjson.loads(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()],
                     [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()])


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> FaultyJob:
    """One run of the four faulty environments, shared by the tests below (verifiers loads once)."""
    tmp = tmp_path_factory.mktemp("faulty")
    handler = ListHandler()
    logger = logging.getLogger("orchestrator")
    logger.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HOME", str(tmp / "home"))  # verifiers writes ~/.cache/verifiers
            result = asyncio.run(run_faulty_job(tmp))
    finally:
        logger.removeHandler(handler)
    result.warnings = handler.lines
    return result


def test_the_job_finishes_its_steps_despite_failing_environments(job: FaultyJob) -> None:
    assert job.steps_run == STEPS
    assert job.received == list(range(STEPS))
    assert [m["step"] for m in job.metrics] == list(range(STEPS))
    for m in job.metrics:  # each step's failed count is its failed rows
        assert m["failed"] == sum(1 for r in job.rows if r["step"] == m["step"] and not r["ok"])


@pytest.mark.parametrize(("env", "failure", "reason"), [
    ("rollout", "env_error", "InjectedFault: injected fault in rollout (task "),
    ("scoring", "scoring_error", "InjectedFault: injected fault in scoring (task ")])
def test_env_errors_are_failed_rollouts_with_their_reason(job: FaultyJob, env: str, failure: str, reason: str) -> None:
    failed, ok = job.failed(env), job.ok(env)
    assert failed, f"no failed {env} rollout reached a step"
    assert ok, f"no {env} rollout survived (rate 0.5 leaves half of every group)"
    for row in failed:
        assert row["failure"] == failure, row
        assert reason in row["error"], row
        assert row["advantage"] is None  # nothing of it is trained on
        assert row["tokens"] == 0
    # the rollouts that did not fail in those groups were trained on as usual
    assert {r["group"] for r in failed} <= {r["group"] for r in ok}
    assert all(math.isfinite(r["reward"]) for r in ok)
    # counted in metrics, by failure kind, at least once per failed row that reached a step
    counts = job.scheduler_counts()
    assert counts[f"failed:{failure}"] >= len(failed), counts
    assert sum(m["failed"] for m in job.metrics) >= len(failed)
    # and logged once per rollout, naming the env
    assert any(f"({env}) failed: " in line and reason in line for line in job.warnings)


def test_invalid_task_data_fails_its_rollouts_with_a_clear_reason(job: FaultyJob) -> None:
    """Every task of ``bad-data`` is invalid, so each of its groups fails whole and is dropped (by design an
    all-failed group trains nothing): none of it reaches a step, and every rollout's reason is logged."""
    assert job.ok("bad-data") == []
    logged = [line for line in job.warnings if "(bad-data) failed: " in line]
    assert logged, "no bad-data rollout ran"
    for line in logged:
        assert "InvalidTaskData: invalid task data (task " in line, line
        assert "answer must be an integer, got '" in line, line
    dropped = [line for line in job.warnings if "(bad-data) dropped: 4 of 4 rollouts failed" in line]
    assert dropped, "no bad-data group was dropped"
    # their rows are in rollouts.jsonl, marked, so the reason can be read there, not only counted
    rows = job.failed("bad-data")
    assert rows, "no row of a dropped bad-data group"
    assert len(rows) % 4 == 0
    assert len({r["group"] for r in rows}) == len(rows) // 4
    for row in rows:
        assert (row["dropped"], row["failure"]) == (True, "env_error"), row
        assert "InvalidTaskData: invalid task data (task " in row["error"], row
    assert sum(m["dropped"] for m in job.metrics) == len(rows)
    assert all(r["dropped"] is False for r in job.rows if r["env"] != "bad-data")
    # counted in metrics (the log also has what happened after the last step's counts were taken)
    counts = job.scheduler_counts()
    assert counts["dropped_groups"] >= 1
    assert counts["failed:env_error"] >= 4, counts


def test_a_nan_reward_never_reaches_the_trainer(job: FaultyJob) -> None:
    """Was: a reward function that returns NaN (without raising) gives an ``ok`` rollout with reward NaN; the
    default advantage of its whole group is then NaN and is sent to the trainer. Expected: the rollout fails
    with a reason naming the reward (and the rest of its group trains)."""
    assert any(env == "nan-reward" for _, env, _ in job.advantages), "no nan-reward group reached a step"
    bad = [(step, env, a) for step, env, a in job.advantages if not math.isfinite(a)]
    assert bad == [], f"{len(bad)} non-finite advantages sent to the trainer, e.g. {bad[:3]}"
    failed = job.failed("nan-reward")
    assert failed, "no nan-reward rollout failed"
    assert all(r["failure"] == "invalid_reward" and "reward" in r["error"].lower() for r in failed), failed[:2]


# ------------------------------------------------------------------------------ a taskset that cannot load


@pytest.mark.parametrize(("args", "cause"), [
    ({"fail_in": "load"}, "InjectedFault: injected fault in load: this taskset cannot load its tasks"),
    ({"rate": "lots"}, "env[1].args.rate: Input should be a valid number"),  # verifiers' check, our key
], ids=["raises-in-load", "invalid-taskset-args"])
async def test_environment_that_fails_to_load_stops_the_run_with_exit_1(args: Section, cause: str,
                                                                        tmp_path: Path) -> None:
    out = tmp_path / "out"
    async with sim_servers(1) as servers:
        job = write_job_toml(
            tmp_path, run={"max_steps": 2}, inference={"servers": [servers[0].url]}, scheduler={"batch_size": 4},
            env=[{"name": "arith", "taskset": "orchestrator-arithmetic", "group_size": 4},
                 {"name": "broken", "taskset": "orchestrator-faulty", "args": args, "group_size": 4, "workers": 0}])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "run", str(job),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "HOME": str(tmp_path / "home")})
        try:
            # a bound only: loading takes 6 s on a quiet machine, far more with its cores busy
            _, stderr = await asyncio.wait_for(proc.communicate(), 180)
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
    err = stderr.decode()
    assert proc.returncode == 1, err
    assert "error: env worker local-0: environment 'broken' (taskset 'orchestrator-faulty') failed to load: " in err
    assert cause in err, err
    assert "Traceback" not in err
    assert not (out / "metrics.jsonl").exists()  # no step ran
    assert processes_mentioning(str(out)) == []  # its env worker is gone too
