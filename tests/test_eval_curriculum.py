"""Online evaluation, gates with refill, the curriculum and exact resume, with real processes: ``orchestrator
run`` (its env workers) and the reference trainer against a simulated inference server."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import defaultdict
from collections.abc import Sequence
from math import comb
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.state import load_state
from orchestrator.testing.jobs import ARITHMETIC, Section, write_job_toml
from orchestrator.testing.procs import orchestrator_process, processes_mentioning, wait_until
from orchestrator.testing.sim import sim_process
from orchestrator.trainer.reference import read_journal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("verifiers_home")]

BOUND_S = 240  # a hang guard only: a run of a few steps takes 10-30 s on a quiet 2-core machine


ARITH: Section = {**ARITHMETIC, "name": "arith"}


def job(tmp_path: Path, url: str, steps: int, *, envs: Sequence[Section] = (ARITH,), name: str = "j",
        scheduler: Section | None = None, **sections: Section) -> Path:
    return write_job_toml(tmp_path, run={"name": name, "max_steps": steps}, inference={"servers": [url]},
                          scheduler={"batch_size": 8, "max_inflight": 16, **(scheduler or {})}, env=envs, **sections)


def rows(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def run_with_trainer(cfg: Path, tmp_path: Path, *args: str) -> int:
    out = tmp_path / "out"
    trainer = orchestrator_process("receive", f"ipc://{out}/trainer.sock", "--checkpoint-dir", str(tmp_path / "ckpt"))
    async with trainer, orchestrator_process("run", str(cfg), *args) as run:
        return await asyncio.wait_for(run.wait(), BOUND_S)


EVAL: Section = {"interval": 2, "num_examples": 5, "group_size": 4,
                 "env": [{"name": "arith", "taskset": "orchestrator-arithmetic", "sampling": {"max_tokens": 4}}]}


def unbiased(n: int, c: int, k: int) -> tuple[float, float]:
    """pass@k and pass^k of a task with c of n rollouts passing, worked out here independently."""
    return 1 - comb(n - c, k) / comb(n, k), comb(c, k) / comb(n, k)


async def test_eval_rows_at_their_steps_with_pass_at_k_of_their_rollouts_and_a_curriculum(tmp_path: Path) -> None:
    envs = [{**ARITH, "curriculum": {"window": 1}}]
    async with sim_process() as server:
        cfg = job(tmp_path, server.url, 5, eval=EVAL, envs=envs)
        assert await run_with_trainer(cfg, tmp_path) == 0
    out = tmp_path / "out"
    metrics = rows(out / "metrics.jsonl")
    evals = [m for m in metrics if m.get("eval")]
    steps = [m for m in metrics if not m.get("eval")]
    assert [m["step"] for m in steps] == list(range(5))
    assert [e["step"] for e in evals] == [0, 2, 4]  # at the start, every 2 steps; the last one waited for
    by_task: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in rows(out / "eval_rollouts.jsonl"):
        by_task[(r["step"], r["task"])].append(r["reward"] if r["ok"] else 0.0)
    for e in evals:
        assert e["policies"] == [e["policy"]]  # one policy version per round (hold_weights)
        m = e["envs"]["arith"]
        tasks = [by_task[(e["step"], t)] for t in range(5)]
        assert [len(t) for t in tasks] == [4] * 5  # the first 5 tasks, 4 rollouts each
        passes = [sum(x > 0.5 for x in t) for t in tasks]
        for k in (1, 2, 4):
            assert m[f"pass@{k}"] == pytest.approx(sum(unbiased(4, c, k)[0] for c in passes) / 5)
            assert m[f"pass^{k}"] == pytest.approx(sum(unbiased(4, c, k)[1] for c in passes) / 5)
        assert m["mean_reward"] == pytest.approx(sum(map(sum, tasks)) / 20)
    # gates with refill: every step is whole, rejected groups were counted, not trained on
    assert all(s["rollouts"] >= 8 for s in steps), [s["rollouts"] for s in steps]
    trained = {(r["step"], r["group"]) for r in rows(out / "rollouts.jsonl") if not r.get("dropped")}
    assert trained
    # the curriculum: tasks leave "unseen" for the pools as their groups complete
    sizes = [s["scheduler"]["curriculum"]["arith"]["pool_sizes"] for s in steps]
    assert sizes[-1]["unseen"] < sizes[0]["unseen"]
    assert sum(v for k, v in sizes[-1].items() if k not in ("unseen", "in_flight")) > 0
    draws = [s["scheduler"]["curriculum"]["arith"]["draws"] for s in steps]
    assert sum(sum(d.values()) for d in draws) >= 5 * 2  # at least two groups a step were drawn


async def test_orchestrator_eval_evaluates_the_servers_once_without_a_trainer(tmp_path: Path) -> None:
    async with sim_process() as server:
        cfg = job(tmp_path, server.url, 5, eval=EVAL)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "eval", str(cfg), "--step", "7",
            "--json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), BOUND_S)
    assert proc.returncode == 0, stderr.decode()
    row = orjson.loads(stdout.splitlines()[-1])
    assert (row["step"], row["eval"]) == (7, True)
    assert b"pass@4" in stdout  # the table
    written = rows(tmp_path / "out" / "eval" / "eval_rollouts.jsonl")
    assert len(written) == 20
    assert rows(tmp_path / "out" / "eval" / "metrics.jsonl") == [row]


async def test_orchestrator_eval_without_an_eval_section_is_a_config_error(tmp_path: Path) -> None:
    cfg = job(tmp_path, "http://127.0.0.1:9/v1", 5)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator", "eval", str(cfg), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(proc.communicate(), BOUND_S)
    assert proc.returncode == 2
    assert b"[eval] section" in stderr


async def test_gates_that_reject_everything_stop_the_run_with_a_clear_error(tmp_path: Path) -> None:
    async with sim_process() as server:
        cfg = job(tmp_path, server.url, 3, scheduler={"max_rejected_batches": 2},
                  pipeline={"gates": [{"name": "reward_range", "args": {"min": 2.0}}]})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "run", str(cfg),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(proc.communicate(), BOUND_S)
    assert proc.returncode == 1, stderr.decode()[-2000:]
    assert b"gates rejected" in stderr
    assert b"reward_range" in stderr


TWO_ENVS = [{**ARITHMETIC, "name": n, "group_size": 2, "weight": w} for n, w in (("a", 1.0), ("b", 2.0))]


def draws(out: Path) -> dict[str, tuple[str, int]]:
    """Group id (g<draw number>) -> (env, task), from the rows of every trained or dropped group."""
    return {r["group"]: (r["env"], r["task"]) for r in rows(out / "rollouts.jsonl")}


async def test_a_sigkilled_run_resumes_drawing_exactly_what_an_uninterrupted_run_draws(tmp_path: Path) -> None:
    steps = 8
    every: Section = {"gates": []}  # every finished group trains: more draws to compare
    async with sim_process() as server:
        straight = tmp_path / "straight"
        assert await run_with_trainer(job(straight, server.url, steps, envs=TWO_ENVS, pipeline=every), straight) == 0
        expected = draws(straight / "out")

        cut = tmp_path / "cut"
        cfg = job(cut, server.url, steps, envs=TWO_ENVS, pipeline=every)
        out = cut / "out"
        journal = cut / "journal.jsonl"
        async with orchestrator_process("receive", f"ipc://{out}/trainer.sock", "--journal", str(journal),
                                        "--checkpoint-dir", str(cut / "ckpt")) as trainer:
            async with orchestrator_process("run", str(cfg)) as run:
                await wait_until(lambda: len(read_journal(journal)) >= 3, BOUND_S, "3 steps at the trainer",
                                 alive=run)
                os.kill(run.pid, signal.SIGKILL)
                await run.wait()
            await wait_until(lambda: not processes_mentioning(f"{out}/workers.sock"), 60, "orphaned env workers")
            before = draws(out)
            saved = load_state(out, "j").scheduler["sampler"]["draws"]
            async with orchestrator_process("run", str(cfg), "--resume") as resumed:
                assert await asyncio.wait_for(resumed.wait(), BOUND_S) == 0
            assert trainer.returncode is None
    after = draws(out)
    later = {g: d for g, d in after.items() if int(g[1:]) > saved}
    assert later, f"the resumed run trained no group drawn after the {saved} saved draws"
    common = set(expected) & set(before) | set(expected) & set(after)
    assert len(common) >= 8  # ~30 groups train per run; how many of them both runs trained depends on timing
    mismatched = {g: (expected[g], after.get(g, before.get(g))) for g in common
                  if expected[g] != after.get(g, before.get(g))}
    assert not mismatched, f"draws differ from the uninterrupted run's: {mismatched}"
    assert {env for env, _ in later.values()} == {"a", "b"}
