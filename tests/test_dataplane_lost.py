"""Lost steps in direct mode, with real processes: an env worker killed holding columns of a step sent and not yet
read by the trainer, and a trainer killed while it holds a step it has mapped and not acknowledged. Either way the
trainer gets every step once, in order, whole (docs/data-plane.md, "Failure rules")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.dataplane.direct import DirectPlane
from orchestrator.sim.server import Faults
from orchestrator.testing.procs import wait_until
from orchestrator.testing.sim import sim_servers
from orchestrator.trainer.reader import StepView
from orchestrator.trainer.receiver import BatchReceiver
from orchestrator.trainer.reference import ReferenceTrainer, save_initial_checkpoint
from test_dataplane_e2e import JOB_GUARD_S, direct_job, unacked_steps

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("verifiers_home")]
STEPS = 4


async def test_a_worker_killed_before_the_trainer_maps_its_pool_makes_the_step_refill(tmp_path: Path) -> None:
    """The trainer connects and is sent step 0 (and the pool announcements) but reads nothing yet; the env worker
    holding some of step 0's columns is SIGKILLed; only then does the trainer read: it cannot map that pool,
    reports step 0 lost, and gets step 0 again as a newer attempt, rebuilt without that pool, then the rest."""
    got: list[tuple[int, int, int, list[str]]] = []  # step, attempt, samples, rollout ids
    named_pools: list[set[str]] = []
    async with sim_servers(1, faults=Faults(latency_ms=20.0), profile="prime-rl") as servers:
        cfg = direct_job(tmp_path, [servers[0].url], steps=STEPS)
        async with Orchestrator.open(cfg) as orch:
            ckpt = Path(cfg.run.output_dir) / "ckpt"
            first_sent = asyncio.Event()
            orch.on_step = lambda m: first_sent.set()  # after a step's send: its manifest is in our queue
            receiver = BatchReceiver(orch.sender.address, auto_ack=False)
            killed_pool: list[str] = []

            async def trainer() -> None:
                await first_sent.wait()
                assert isinstance(orch.plane, DirectPlane)
                trained = orch.plane.unacked.steps[0].trained
                assert trained, "step 0 names no rollout (every one filtered): nothing to lose"
                victim = trained[0].header.worker
                pool = orch.hub.pools.pool(victim)
                assert pool is not None
                killed_pool.append(pool.id)
                os.kill(orch.hub.local_pids()[victim], signal.SIGKILL)  # a process this test's orchestrator started
                await wait_until(lambda: orch.hub.metrics["pools_gone"] >= 1, JOB_GUARD_S,
                                 "the hub to report the pool gone", poll_s=0.05)
                while len(got) < STEPS:
                    view = await receiver.recv_view()
                    assert isinstance(view, StepView)
                    batch = view.gather()
                    named_pools.append({p.id for p in view.manifest.pools})
                    got.append((view.step, view.manifest.attempt, batch.num_samples,
                                [str(r) for r in batch.scalars["rollout"]]))
                    del view
                    await receiver.ack(batch.step)
                    step_dir = await asyncio.to_thread(save_initial_checkpoint, ckpt, batch.step + 1)
                    await receiver.announce(batch.step + 1, str(step_dir))

            try:
                async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                    tg.create_task(trainer())
                    await orch.run()
            finally:
                receiver.close()
            assert unacked_steps(orch) == {}  # every step's rollouts released on acknowledgement
            rebuilt = orch.plane.unacked.rebuilt if isinstance(orch.plane, DirectPlane) else 0
    assert [g[0] for g in got] == list(range(STEPS))  # every step once, in order
    assert got[0][1] >= 1  # step 0 came as a rebuilt attempt
    assert rebuilt >= 1
    assert receiver.lost >= 1
    assert all(killed_pool[0] not in pools for pools in named_pools)  # no accepted step names the dead pool
    rids = [rid for g in got for rid in g[3]]
    assert len(rids) == len(set(rids))  # no rollout trained twice
    rows = [orjson.loads(x) for x in (tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines()]
    lost_rows = [r for r in rows if r.get("attempt") and r["failure"] == "worker_died"]
    assert 0 in {r["step"] for r in lost_rows}  # lost rollouts are logged failed, with the attempt replacing them
    final: dict[str, dict[str, Any]] = {}  # what became of each rollout: its row of the newest attempt
    for r in rows:
        if r["rollout"] not in final or r.get("attempt", 0) >= final[r["rollout"]].get("attempt", 0):
            final[r["rollout"]] = r
    for step in range(STEPS):  # whole steps: batch_size rollouts that came back (filtered ones included)
        assert sum(r["step"] == step and r["ok"] and not r["dropped"] for r in final.values()) >= 8


KILLABLE_TRAINER = """
import asyncio, sys
from orchestrator.trainer.receiver import BatchReceiver

async def main():
    receiver = BatchReceiver(sys.argv[1], auto_ack=False)
    view = await receiver.recv_view()  # maps the pools step 0 names; never acknowledged
    print(view.step, flush=True)
    await asyncio.Event().wait()  # until SIGKILL

asyncio.run(main())
"""


async def test_a_trainer_killed_holding_a_mapped_step_gets_it_again_when_restarted(tmp_path: Path) -> None:
    """A trainer process maps step 0 and is SIGKILLed before acknowledging it; nothing was released, so the
    trainer started after it gets step 0 again from the window, and every later step, once, in order."""
    async with sim_servers(1, profile="prime-rl") as servers:
        cfg = direct_job(tmp_path, [servers[0].url], steps=STEPS)
        async with Orchestrator.open(cfg) as orch:
            ckpt = Path(cfg.run.output_dir) / "ckpt"
            trainer = ReferenceTrainer(orch.sender.address, max_steps=STEPS, checkpoint_dir=ckpt)

            async def kill_then_restart() -> None:
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
                proc = await asyncio.create_subprocess_exec(sys.executable, "-c", KILLABLE_TRAINER,
                                                            orch.sender.address, stdout=asyncio.subprocess.PIPE,
                                                            env=env)
                try:
                    assert proc.stdout is not None
                    line = await proc.stdout.readline()
                    assert line.strip() == b"0", line
                    os.kill(proc.pid, signal.SIGKILL)  # the process this test started
                    await proc.wait()
                finally:
                    if proc.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(proc.pid, signal.SIGKILL)
                        await proc.wait()
                assert orch.sender.acked == -1  # the killed trainer acknowledged nothing
                assert unacked_steps(orch)  # so step 0's rollouts are still held for the next trainer
                await trainer.run()

            async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                tg.create_task(kill_then_restart())
                await orch.run()
            assert unacked_steps(orch) == {}
    assert [r.step for r in trainer.received] == list(range(STEPS))
    batch_size = cfg.scheduler.batch_size
    assert batch_size is not None
    assert all(r.samples >= batch_size - 4 for r in trainer.received)
