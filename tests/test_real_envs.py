"""An environment that is not ours, end to end and offline: verifiers' own TextArena Hangman taskset, played by
verifiers' ``null`` harness (its chat program runs as a ``uv`` script), in our env workers, against the
simulated vLLM server, with our ``[[env]]`` tables passing verifiers' options.

The worker-host kit (a local wheel index for uv, NLTK's ``words`` built from textarena's dictionary) is made by
``scripts/setup.sh`` (``orchestrator prepare-worker-host .venv/worker-host``); nothing here downloads.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.config import JobConfig
from orchestrator.testing.jobs import Section, job_config
from orchestrator.testing.sim import sim_servers
from orchestrator.trainer.reference import ReferenceTrainer
from orchestrator.workers.host import PrepareError, worker_env

pytestmark = pytest.mark.slow

KIT = Path(sys.prefix) / "worker-host"
CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once


def hangman(name: str, workers: int, max_turns: int) -> Section:
    """verifiers' TextArena Hangman taskset, played by the ``null`` harness; its ``verifiers`` table is the
    ``[env.verifiers.player]`` and ``[env.verifiers.timeout]`` tables a user writes."""
    return {"name": name, "taskset": "textarena", "args": {"game": "Hangman-v0"}, "group_size": 2,
            "workers": workers, "select": {"limit": 8}, "sampling": {"max_tokens": 8},
            "verifiers": {"player": {"harness": {"id": "null"}, "max_turns": max_turns, "timeout": {"rollout": 120}},
                          "timeout": {"episode": 180}}}


@pytest.fixture
def worker_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The env workers (our children) get the kit's variables; HOME is the test's, so verifiers' and uv's caches
    start empty; and any https request (NLTK's index, a uv download) meets a closed loopback port instead of
    leaving the machine: the run must not need the network."""
    try:
        env = worker_env(KIT)
    except PrepareError as e:
        pytest.fail(f"{e} (bash scripts/setup.sh makes it)")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HTTPS_PROXY", CLOSED_PORT)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def hangman_job(tmp_path: Path, url: str) -> JobConfig:
    return job_config(
        tmp_path, run={"name": "hangman", "max_steps": 2},
        inference={"servers": [url], "backend": "vllm", "request_timeout_s": 30.0},
        scheduler={"batch_size": 4, "max_inflight": 4, "max_async_level": 1, "max_off_policy_steps": 2,
                   "max_buffered_rollouts": 8},
        # a random policy never wins: every group's rewards are equal, and this test is not about gates
        pipeline={"gates": []},
        env=[hangman("hangman", workers=1, max_turns=4), hangman("one-turn", workers=0, max_turns=1)])


@pytest.mark.timeout(400)
async def test_textarena_hangman_runs_through_env_workers_with_the_uv_harness(tmp_path: Path,
                                                                             worker_host: None) -> None:
    async with sim_servers(1, profile="vllm-0.26") as servers:
        cfg = hangman_job(tmp_path, servers[0].url)
        async with Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=cfg.run.max_steps,
                                       checkpoint_dir=tmp_path / "ckpt")
            async with asyncio.timeout(360), asyncio.TaskGroup() as tg:
                tg.create_task(trainer.run())
                await orch.run()
    assert [r.step for r in trainer.received] == [0, 1]
    out = tmp_path / "out"
    rows = [orjson.loads(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]
    ok = [r for r in rows if r["ok"]]
    assert ok, [r["error"] for r in rows]
    assert all(r["error"] is None for r in rows)
    by_env = {env: [r for r in ok if r["env"] == env] for env in ("hangman", "one-turn")}
    assert by_env["hangman"]
    assert by_env["one-turn"]
    # the game plays the user: the model's move gets the game's feedback, turn after turn, until the game
    # (an invalid move ends it, and the simulated model's words are never valid) closes the exchange...
    for r in by_env["hangman"]:
        assert 2 <= r["turns"] <= 4, r
        assert r["stop"] == "user_closed", r
        assert r["samples"] == 1
        assert r["tokens"] > 0
    # ...unless the seat's max_turns, from our [env.verifiers.player] table, stops it first
    for r in by_env["one-turn"]:
        assert (r["turns"], r["stop"]) == (1, "max_turns"), r
    assert all(r["reward"] == 0.0 for r in ok)  # random words never win the game
    metrics = [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert sum(m["rollouts"] for m in metrics) == len(rows)
    # the null harness's chat program ran as a uv script: verifiers wrote it, uv made its environment offline
    home = tmp_path / "home"
    assert list((home / ".cache" / "verifiers" / "runtimes").glob("scripts*/*.py"))
    assert list((home / ".cache" / "uv").glob("environments-v2/*/bin/python"))
