"""Checkpoints that cannot be loaded, with real processes (issue #27 item 3, issue #28 item 4): `orchestrator run`
against a simulated server process and a trainer announcing a corrupt or missing checkpoint, and `orchestrator
check --servers`. On a real vLLM such a load kills the engine (REAL-VLLM.md), so no server may see it; and a
job whose checkpoints never load must end, not wait for ever.

Every wait is for an event (a log line, an exit); the bounds are hang guards for process start-ups on a busy
machine.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from orchestrator.commands.check import check_servers
from orchestrator.config import load_config
from orchestrator.contracts.wire import Batch
from orchestrator.inference.preflight import PreflightError
from orchestrator.testing.procs import logged, orchestrator_process, wait_until, write_job
from orchestrator.testing.sim import sim_process
from orchestrator.trainer.reference import ReferenceTrainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("verifiers_home")]

HANG_GUARD_S = 240.0


async def sim_log(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url.removesuffix("/v1") + "/sim/log") as reply:
        log: dict[str, Any] = await reply.json()
        return log


@dataclass
class CorruptSecond(ReferenceTrainer):
    """Announces checkpoint 2 in a directory whose safetensors file is cut short, and holds checkpoint 3 (a
    good one) until the run's log has named the refused one in a stall line."""

    bad: Path = Path()
    run_log: Path = Path()

    def _save(self, step: int) -> str | None:
        path = super()._save(step)
        if step != 2:
            return path
        header = json.dumps({"w": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}}).encode()
        self.bad.mkdir(parents=True)
        (self.bad / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(100))
        return str(self.bad)

    async def train(self, batch: Batch) -> None:
        if batch.step == 2:  # checkpoint 3 comes after this step: hold it until the stall is named
            await wait_until(lambda: bool(stall_lines(self.run_log)), HANG_GUARD_S, "the stall line")


def stall_lines(run_log: Path) -> list[str]:
    """Step 3's stall lines that name the refused checkpoint (one may come before the refusal, on a busy host)."""
    return [line for line in logged(run_log, "step 3 has 0 of 8 after ") if "checkpoint 2 cannot be loaded" in line]


async def test_a_corrupt_checkpoint_reaches_no_server_and_a_later_good_one_finishes_the_job(tmp_path: Path) -> None:
    run_log, bad = tmp_path / "run.log", tmp_path / "bad" / "step_2"
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, 4, "corrupt")
        async with orchestrator_process("run", str(cfg), "--set", "monitor.stall_warn_s=2", log=run_log,
                                        log_level="INFO") as run:
            trainer = CorruptSecond(f"ipc://{out}/trainer.sock", max_steps=4, checkpoint_dir=tmp_path / "ckpt",
                                    bad=bad, run_log=run_log)
            async with asyncio.timeout(HANG_GUARD_S), asyncio.TaskGroup() as tg:
                training = tg.create_task(trainer.run())
                code = await run.wait()
                if code != 0:
                    training.cancel()  # it would wait for steps that never come
        log = await sim_log(server.url)
    assert code == 0, run_log.read_text()[-3000:]
    assert [r.step for r in trainer.received] == [0, 1, 2, 3]
    why = (f"checkpoint 2 cannot be loaded: {bad} holds a corrupt file model.safetensors: its header puts tensor "
           "data up to byte ")
    [refused] = logged(run_log, "ERROR")
    assert why in refused, refused
    assert "; no server is asked to load it: the servers keep the weights of step 1, in rotation; the run " \
           "stops at " in refused, refused
    stall = stall_lines(run_log)
    assert stall, run_log.read_text()[-3000:]
    assert "waits for a checkpoint of policy >= 2 (the servers have policy 1; no training group opens until " \
           f"then): {why}" in stall[0], stall[0]
    assert not logged(run_log, "leaves rotation")
    assert logged(run_log, "weights of step 3 on 1/1 servers")
    # the server: a pause and a load for every good checkpoint, nothing at all for the bad one
    admin = [(c["path"], c["body"]) for c in log["admin"] if c["method"] == "POST"]
    loads = [body["kwargs"]["weights_path"] for path, body in admin if path == "/collective_rpc"]
    ckpt = (tmp_path / "ckpt").resolve()
    assert loads[:2] == [str(ckpt / "step_1"), str(ckpt / "step_3")], loads
    assert str(bad) not in json.dumps(log)
    pauses = [i for i, (p, _) in enumerate(admin) if p == "/pause"]
    # the run may end during the sync that follows its last step: cut short before its load, and still resumed
    cut = len(pauses) == len(loads) + 1 and [p for p, _ in admin[pauses[-1]:]] == ["/pause", "/resume"]
    assert len(pauses) == len(loads) + cut, admin
    sampled = {g["cache_salt"] for g in log["generate"] if g["status"] == 200}
    assert {"1", "3"} <= sampled  # it served policy 1 while checkpoint 2 was refused, then policy 3


async def test_a_job_whose_checkpoints_never_load_exits_1_naming_the_path(tmp_path: Path) -> None:
    """``weights_path`` names a directory that does not exist: each checkpoint is refused, the job stops after
    ``unloadable_checkpoint_s`` with exit status 1 and says which checkpoint, where and why."""
    run_log, nowhere = tmp_path / "run.log", tmp_path / "nowhere"
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, 6, "never")
        async with orchestrator_process("run", str(cfg), "--set", f'inference.weights_path="{nowhere}/step_{{step}}"',
                                        "--set", "inference.unloadable_checkpoint_s=3", log=run_log) as run, \
                orchestrator_process("receive", f"ipc://{out}/trainer.sock", log=tmp_path / "trainer.log"):
            code = await asyncio.wait_for(run.wait(), HANG_GUARD_S)
        log = await sim_log(server.url)
    assert code == 1, run_log.read_text()[-3000:]
    [error] = [line for line in logged(run_log, "error: ") if line.startswith("error: ")]
    assert error.startswith("error: checkpoint "), error
    step = error.removeprefix("error: checkpoint ").split()[0]
    assert f" cannot be loaded: {nowhere}/step_{step} does not exist; no checkpoint has loaded for 3 s since the " \
           "first was refused (inference.unloadable_checkpoint_s), so the run stops" in error, error
    assert not [c for c in log["admin"] if c["path"] in ("/pause", "/collective_rpc")]


async def test_check_servers_says_what_it_can_of_weights_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    async with sim_process() as server:
        job, _ = write_job(tmp_path, server.url, 1, "check")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--log-level", "ERROR", "check", str(job), "--servers",
            "--set", f'inference.weights_path="{tmp_path}/nowhere/step_{{step}}"',
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD_S)
        assert proc.returncode == 1, (out, err)
        assert (f"inference.weights_path = '{tmp_path}/nowhere/step_{{step}}': {tmp_path}/nowhere does not exist on "
                "this host").encode() in err, err
        (tmp_path / "ckpt").mkdir()  # the trainer's directory, no checkpoint in it yet: a template of future steps
        await check_servers(load_config(job, [f'inference.weights_path="{tmp_path}/ckpt/step_{{step}}"']))
        assert f"# inference.weights_path: {tmp_path}/ckpt exists; no checkpoint in it yet\n" in capsys.readouterr().out
        (tmp_path / "ckpt" / "step_3").mkdir()  # written, but empty
        with pytest.raises(PreflightError, match=f"step 3, the newest there, {tmp_path}/ckpt/step_3 is empty"):
            await check_servers(load_config(job, [f'inference.weights_path="{tmp_path}/ckpt/step_{{step}}"']))
