"""``orchestrator run`` with ``kind = "prime-rl"`` feeding a stand-in of prime-rl's trainer, end to end.

The orchestrator runs as a real process against simulated servers that play prime-rl's inference server
(routed experts included); the trainer's data ranks do what prime-rl's receivers do (SUB per rank and READY, or
polling ``rollouts/step_N/rank_R.bin``) and decode with strict msgspec structs; after each step the trainer
writes ``broadcasts/step_N/`` and ``STABLE`` as prime-rl's filesystem broadcast does. The test checks that every
step arrived once, in order, on every rank, with what prime-rl's trainer relies on, and that the servers were
asked to load each broadcast directory.

``scheduler.max_async_level = 0`` makes every step wait for the weights of the step before it, so each
``broadcasts/step_N`` must be loaded (none skipped as stale): what the servers' logs must show does not depend on
timing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from orchestrator.state import load_state
from orchestrator.testing.jobs import ARITHMETIC, write_job_toml
from orchestrator.testing.primerl import (
    FakePrimeRLTrainer,
    MicroBatch,
    Sample,
    check_step,
    free_port_pair,
    read_admin_weight_dirs,
)
from orchestrator.testing.procs import Process, orchestrator_process
from orchestrator.testing.sim import sim_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400), pytest.mark.usefixtures("verifiers_home")]

STEPS = 4
SEQ_LEN = 128
PAD = 4
TEMPERATURE = 0.7


def write_job(tmp_path: Path, urls: list[str], trainer_dir: Path, ranks: int, address: str | None) -> Path:
    return write_job_toml(
        tmp_path, run={"name": "prime", "max_steps": STEPS},
        # prime-rl's trainer tempers its logprobs, so at temperature TEMPERATURE the servers must report processed
        # ones; prime-rl's server has no /server_info to say so: stated. A slow reply on a busy host must not fail:
        # timeouts evict servers, which then skip syncs
        inference={"servers": urls, "backend": "prime-rl", "logprobs_mode": "processed", "request_timeout_s": 120.0},
        scheduler={"batch_size": 8, "max_inflight": 8, "max_async_level": 0, "max_off_policy_steps": 1,
                   "max_buffered_rollouts": 16},
        transport={"kind": "prime-rl", **({"address": address} if address else {"prime_rl_layout": "filesystem"}),
                   "trainer_dir": trainer_dir, "data_ranks": ranks, "seq_len": SEQ_LEN, "pad_to_multiple_of": PAD},
        pipeline={"gates": []},  # every finished group trains: gates are not what this test is about
        env=[{**ARITHMETIC, "name": "arith", "sampling": {"max_tokens": 6, "temperature": TEMPERATURE}}])


async def next_step(trainer: FakePrimeRLTrainer, run: Process) -> list[list[MicroBatch]]:
    """The trainer's next step, or an error if the orchestrator exits first."""
    step = asyncio.ensure_future(trainer.step())
    exited = asyncio.ensure_future(run.wait())
    await asyncio.wait({step, exited}, return_when=asyncio.FIRST_COMPLETED)
    if not step.done():
        step.cancel()
        raise AssertionError(f"orchestrator exited with {run.returncode} before trainer step {trainer.step_now + 1}")
    exited.cancel()
    return step.result()


@pytest.mark.parametrize(("layout", "ranks", "num_experts"), [("zmq", 2, 64), ("zmq", 3, 512), ("filesystem", 2, 64)],
                         ids=["zmq-2-ranks", "zmq-3-ranks-uint16-experts", "files-2-ranks"])
async def test_orchestrator_run_feeds_prime_rls_trainer(tmp_path: Path, layout: str, ranks: int,
                                                        num_experts: int) -> None:
    trainer_dir = tmp_path / "trainer"
    address = f"tcp://127.0.0.1:{free_port_pair()}" if layout == "zmq" else None
    routed_dtype = "uint16" if num_experts > 256 else "uint8"
    steps: list[list[Sample]] = []
    async with sim_cluster(2, profile="prime-rl", layers=2, top_k=2, num_experts=num_experts,
                           logprobs_mode="processed_logprobs") as cluster:
        cfg = write_job(tmp_path, cluster.urls, trainer_dir, ranks, address)
        trainer = FakePrimeRLTrainer(trainer_dir, ranks, address)
        trainer.start()  # before the orchestrator, as a launcher may start them: READY waits in its queue
        try:
            async with orchestrator_process("run", str(cfg)) as run, asyncio.timeout(300):
                for _ in range(STEPS):
                    grid = await next_step(trainer, run)
                    steps.append(check_step(grid, seq_len=SEQ_LEN, pad_to_multiple_of=PAD, routed_dtype=routed_dtype))
                    trainer.publish()  # broadcasts/step_N after training its step N (our step N - 1)
                assert await run.wait() == 0
            assert not await trainer.pending(0.3), "a message after the last step"
        finally:
            trainer.close()
        loaded = [read_admin_weight_dirs(cluster[i].log) for i in range(len(cluster))]

    out = tmp_path / "out"
    rows = [orjson.loads(line) for line in (out / "rollouts.jsonl").read_bytes().splitlines()]
    for k, samples in enumerate(steps):  # trainer step k + 1 holds exactly what our step k trained, once
        trained = [r for r in rows if r["step"] == k and r["ok"] and not r["filtered"]]
        assert sorted((len(s.input_ids), s.advantage) for s in samples) == \
            sorted((r["tokens"], r["advantage"]) for r in trained), f"step {k}"
        for s in samples:
            assert (s.env, s.temperature) == ("arith", TEMPERATURE)
            assert s.routed is not None
            assert s.routed.shape == (len(s.input_ids), 2, 2)
            assert s.advantage is not None
    assert sum(len(s) for s in steps) > 0
    assert load_state(out, "prime").acked_step == STEPS - 1
    broadcasts = {str((trainer_dir / "broadcasts" / f"step_{n}").resolve()) for n in range(1, STEPS + 1)}
    for dirs in loaded:  # every server loaded every broadcast it needed, and nothing else
        assert set(dirs) <= broadcasts
        assert {str((trainer_dir / "broadcasts" / f"step_{n}").resolve()) for n in range(1, STEPS)} <= set(dirs)
