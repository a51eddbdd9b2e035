"""``orchestrator demo --real-stack DIR``: the demo's job on a real vLLM server and the PyTorch trainer."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import orjson
import pytest

from orchestrator.realstack.install import StackPaths
from orchestrator.testing.procs import orchestrator_process

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("verifiers_home")]


async def test_the_demo_runs_on_the_real_stack(stack: StackPaths, tmp_path: Path, repo: Path) -> None:
    out = tmp_path / "demo"
    async with orchestrator_process("demo", "--config", str(repo / "configs" / "demo.toml"), "--steps", "2",
                                    "--output-dir", str(out), "--real-stack", str(stack.root), "--set",
                                    "sim.servers=1", stdout=subprocess.PIPE) as demo:
        stdout, _ = await asyncio.wait_for(demo.communicate(), 500)
    assert demo.returncode == 0, stdout.decode()[-2000:]
    assert "real vLLM servers on the tiny dense model" in stdout.decode()
    metrics = [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    failures = [(r["step"], r["failure"], r.get("error")) for r in
                (orjson.loads(line) for line in (out / "rollouts.jsonl").read_bytes().splitlines()) if r["failure"]]
    assert all(m["failed"] == 0 for m in metrics), failures
    assert list((out / "checkpoints" / "step_1").glob("*.safetensors"))  # the PyTorch trainer's checkpoint
