"""An env worker's memory stays flat over hundreds of rollouts (a real worker process, verifiers inside, a sim
server over HTTP), read the way a user reads it: from every step's ``scheduler.workers.<name>.rss_mb``.

Why the tolerance. The leak this guards against (the built-in harness kept an HTTP client per rollout) grew a
worker by 86-89 MB per 100 rollouts (scripts/perf/soak_workers.py: 536 -> 846 MB over 352 rollouts); since the
fix the median RSS of a third of the steps moves by less than 1 MB over 760 rollouts, and single heartbeats by
up to ~10 MB (glibc keeps freed heap; nothing trims it in the worker). Between the medians of the first and
last thirds of MEASURED_ROLLOUTS rollouts a growth under GROWTH_LIMIT_MB passes: 3x that noise, and a leak
of a tenth of the old one (0.09 MB per rollout, 27 MB over 300) already fails. The run counts rollouts, not
seconds, so a busy machine makes it slower, not different.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.testing.jobs import ARITHMETIC, job_config
from orchestrator.testing.sim import sim_servers
from orchestrator.testing.worker_memory import rss_growth, worker_rss_series
from orchestrator.trainer.reference import ReferenceTrainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WARMUP_ROLLOUTS = 100  # imports, the tokenizer's renderer, connection pools
MEASURED_ROLLOUTS = 320
BATCH = 16
GROWTH_LIMIT_MB = 30.0


async def test_an_env_worker_rss_stays_flat_over_hundreds_of_rollouts(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # verifiers writes ~/.cache/verifiers
    steps = (WARMUP_ROLLOUTS + MEASURED_ROLLOUTS) // BATCH
    async with sim_servers(1) as servers:
        cfg = job_config(tmp_path, run={"name": "worker-memory", "max_steps": steps},
                         inference={"servers": [servers[0].url]},
                         scheduler={"batch_size": BATCH, "max_inflight": BATCH, "max_async_level": 2},
                         env=[{**ARITHMETIC, "sampling": {"max_tokens": 8}}])
        async with Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=steps, checkpoint_dir=tmp_path / "ckpt")
            async with asyncio.timeout(240), asyncio.TaskGroup() as tg:  # a hang guard: ~40 s on 2 busy cores
                tg.create_task(trainer.run())
                summary = await orch.run()
    written = [orjson.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["scheduler"]["workers"]["local-0"]["rss_mb"] for m in written] == [
        m["scheduler"]["workers"]["local-0"]["rss_mb"] for m in summary.metrics]  # users read it in the file
    assert sum(m["failed"] for m in summary.metrics) == 0  # every rollout ran: the memory measured is theirs
    series = worker_rss_series(summary.metrics)
    assert list(series) == ["local-0"]  # one worker, never restarted (a restart would reset its RSS)
    assert orch.hub.metrics["restarts"] == 0
    points = series["local-0"]
    assert points[-1][0] >= WARMUP_ROLLOUTS + MEASURED_ROLLOUTS - BATCH
    growth = rss_growth("local-0", points, WARMUP_ROLLOUTS)
    assert growth is not None, points
    assert growth.growth_mb < GROWTH_LIMIT_MB, (growth, points)
