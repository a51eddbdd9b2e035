"""Adaptive concurrency against a real vLLM whose KV cache is small: 16 blocks of 128 tokens (the CPU backend's
block size), 2048 tokens of which 1920 usable, set with ``--num-gpu-blocks-override`` (``VLLM_CPU_KVCACHE_SPACE``
counts whole GiB).
Arithmetic rollouts whose one reply is exactly REPLY_TOKENS long (``min_tokens``) grow in place from one block to
four, so vLLM admits many and then must preempt as they grow (a request that does not fit at all only waits:
multi-turn rollouts of short turns queue, they do not preempt). The pressure and the preemptions are vLLM's own,
read from its ``/metrics``.

The same job twice: a static cap that is too high (every rollout of two steps in flight) and the adaptive cap
under that ceiling. At steady state (after STEADY steps; the controller starts at the cache's capacity over the
first rollouts' length, read from vLLM's own ``vllm:cache_config_info``, and learns) the static cap keeps
preempting and the adaptive one keeps preemptions near zero.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.inference.load import parse_load
from orchestrator.realstack.install import StackPaths
from orchestrator.realstack.server import ServeOptions, VLLMServer, start_all
from orchestrator.testing.real_job import RealJob, run_real_job
from orchestrator.trainer.torch_learner import TorchLearnConfig, TorchLearner

pytestmark = [pytest.mark.timeout(1200), pytest.mark.usefixtures("verifiers_home")]
BLOCKS = 16  # x 128 tokens
REPLY_TOKENS = 400
STEPS = 9
STEADY = 5  # steps to learn the cache (from capacity / length, ~4, to 3); steady state after
BATCH = 8
CEILING = 16  # rollouts: two steps' worth, ~7000 tokens at their peak against 1920


@pytest.fixture(scope="module")
def small_kv(stack: StackPaths) -> Iterator[VLLMServer]:
    # vLLM keeps one block back (its null block) and refuses a max_model_len the other 15 cannot hold
    server = VLLMServer(stack, ServeOptions(stack.model("dense"), logprobs_mode="processed_logprobs",
                                            max_model_len=(BLOCKS - 1) * 128,
                                            extra=("--num-gpu-blocks-override", str(BLOCKS))))
    try:
        asyncio.run(start_all([server]))
        yield server
    finally:
        asyncio.run(server.kill(signal.SIGTERM))


class Preemptions:
    """The server's ``vllm:num_preemptions_total``, read every 0.25 s, and when each step ended."""

    def __init__(self, url: str) -> None:
        self.url = url.removesuffix("/v1") + "/metrics"
        self.reads: list[tuple[float, int]] = []
        self.step_ends: list[float] = []

    async def watch(self, orch: Orchestrator) -> None:
        orch.on_step = lambda _m: self.step_ends.append(time.monotonic())
        async with aiohttp.ClientSession() as http:
            while True:
                async with http.get(self.url) as reply:
                    self.reads.append((time.monotonic(), parse_load(await reply.text()).preemptions))
                await asyncio.sleep(0.25)

    def since(self, t: float) -> int:
        before = max((n for at, n in self.reads if at <= t), default=self.reads[0][1])
        return self.reads[-1][1] - before


async def run(tmp_path: Path, server: VLLMServer, model: Path, *, adaptive: bool) -> dict[str, Any]:
    out = tmp_path / ("adaptive" if adaptive else "static")
    job = RealJob(out, model, (server.url,), steps=STEPS, envs=("arith",), batch_size=BATCH, max_inflight=CEILING,
                  group_size=2, max_tokens=REPLY_TOKENS, temperature=0.7, max_async_level=1,
                  sampling={"extra_body": {"min_tokens": REPLY_TOKENS}},
                  concurrency={"adaptive": True, "poll_s": 0.5} if adaptive else {})
    watch = Preemptions(server.url)
    await run_real_job(job, TorchLearner(model, TorchLearnConfig(lr=1e-3)), during=watch.watch)
    rows = [orjson.loads(x) for x in (out / "out" / "rollouts.jsonl").read_bytes().splitlines()]
    steady = [r for r in rows if r["step"] >= STEADY]
    requests = sum(r.get("turns") or 1 for r in steady)
    metrics = [orjson.loads(x) for x in (out / "out" / "metrics.jsonl").read_bytes().splitlines()]
    return {"preempted": watch.since(watch.step_ends[STEADY - 1]), "requests": requests,
            "tokens": max(r["tokens"] for r in rows),
            "failures": [r["failure"] for r in rows if r["failure"]],
            "caps": [m["scheduler"].get("concurrency", {}).get(server.url, {}).get("cap") for m in metrics]}


async def test_adaptive_concurrency_keeps_a_small_real_kv_cache_from_preempting(small_kv: VLLMServer,
                                                                              stack: StackPaths,
                                                                              tmp_path: Path) -> None:
    model = stack.model("dense")
    static = await run(tmp_path, small_kv, model, adaptive=False)
    adaptive = await run(tmp_path, small_kv, model, adaptive=True)
    print(f"static cap {CEILING}: {static}\nadaptive: {adaptive}")
    assert static["tokens"] > REPLY_TOKENS  # the rollouts grew long: the pressure is real ...
    assert static["preempted"] >= 0.05 * static["requests"], static  # ... and the static cap preempts through it
    assert not static["failures"], static
    # near zero at steady state (measured 0 quiet; a probe of the cap the controller learned may cost one or two, and
    # 4 of 32 in a CI run whose loop stalled 1-3 s for a core, four servers on two cores, while static preempted 40+)
    assert adaptive["preempted"] <= max(2, 0.15 * adaptive["requests"]), adaptive
    # a tenth of the static cap's, above a floor of about one probe per steady step: in a CI run with five servers on
    # two cores the static cap preempted only 4 times and the adaptive 2
    assert adaptive["preempted"] <= max(4, static["preempted"] / 10), (adaptive, static)
    assert min(c for c in adaptive["caps"] if c is not None) < CEILING, adaptive  # the controller cut the cap
    assert set(adaptive["failures"]) <= {"kv_pressure"}, adaptive  # only its own cancellations, if any
