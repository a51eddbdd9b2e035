"""Caps that follow the KV cache, end to end: real env worker processes, a simulated server with a small KV cache
(sim/kv.py) answering /metrics over HTTP, ``[scheduler.concurrency]`` on. The cache cannot hold what
``max_inflight`` lets in, so the cap must come down; the job still finishes every step, and each step's metrics say
what the controller saw and did."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.sim.kv import KVModel
from orchestrator.testing.jobs import ARITHMETIC, job_config
from orchestrator.testing.sim import sim_servers
from orchestrator.trainer.reference import ReferenceTrainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("verifiers_home")]
JOB_GUARD_S = 300.0  # a hang guard: seconds on a quiet host, many times that with every core busy
STEPS = 4
MAX_INFLIGHT = 64
# 8 blocks of 16 tokens: four rollouts fill it (a prompt and a reply take two blocks), far below max_inflight;
# 20 ms an iteration keeps each reply in the engine for a good part of a second, so however slowly a busy host's
# env workers send requests, the cache is full and requests wait when it is polled
KV = KVModel(capacity_tokens=128, block_tokens=16, step_ms=20.0, prefill_ms_per_1k=1.0)


async def test_a_cache_too_small_for_max_inflight_brings_the_cap_down_and_every_step_arrives(tmp_path: Path) -> None:
    async with sim_servers(1, kv=KV, max_model_len=128) as servers:
        url = servers[0].url
        cfg = job_config(
            tmp_path, overrides=["pipeline.gates=[]"], run={"name": "t", "max_steps": STEPS},
            inference={"servers": [url], "request_timeout_s": 120.0, "probe_interval_s": 0.2},
            scheduler={"batch_size": 16, "max_inflight": MAX_INFLIGHT, "max_async_level": 1,
                       "max_off_policy_steps": 2, "max_buffered_rollouts": 128,
                       # a poll's request is bounded by poll_s: on a busy host 50 ms could time every one out
                       "concurrency": {"adaptive": True, "poll_s": 0.25, "start_per_server": MAX_INFLIGHT}},
            env=[{**ARITHMETIC, "name": "arith", "workers": 2, "group_size": 4, "sampling": {"max_tokens": 48}}])
        async with Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=STEPS, checkpoint_dir=tmp_path / "ckpt")
            async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                tg.create_task(trainer.run())
                await orch.run()
    assert [r.step for r in trainer.received] == list(range(STEPS))
    metrics = [orjson.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_bytes().splitlines()]
    seen = [m["scheduler"]["concurrency"][url] for m in metrics]
    assert len(seen) == STEPS
    assert min(s["cap"] for s in seen) < MAX_INFLIGHT  # the cache pushed back
    usages = [s["kv_usage"] for s in seen if s["kv_usage"] is not None]  # none before the first poll's answer
    assert usages  # /metrics was read
    assert all(0.0 <= u <= 1.0 for u in usages)
    assert {s["rule"] for s in seen} <= {"start", "hold", "grow", "trim", "cancel", "preempted", "queued"}
