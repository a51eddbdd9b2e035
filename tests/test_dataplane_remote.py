"""Direct mode across nodes, on one machine: a remote env worker process serves its column pool over ZMQ
(``env-worker --span-address``), and a trainer whose reader believes it is on another host fetches every step's
spans from it instead of mapping the pool (docs/data-plane.md, "Across nodes")."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from orchestrator.app import Orchestrator
from orchestrator.dataplane.reader import StepView
from orchestrator.testing.procs import Process, orchestrator_process
from orchestrator.testing.sim import sim_servers
from orchestrator.transport.receiver import BatchReceiver
from test_dataplane_e2e import JOB_GUARD_S, direct_job, unacked_steps

pytestmark = pytest.mark.slow
STEPS = 3


@pytest.fixture(autouse=True)
def verifiers_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # verifiers writes ~/.cache/verifiers


async def worker_alive(proc: Process) -> None:
    """Fails the test at once if the worker process exits (not after the job's guard)."""
    code = await proc.wait()
    raise AssertionError(f"the remote env worker exited with status {code}")


async def test_a_trainer_on_another_host_fetches_every_step_from_the_workers_span_server(tmp_path: Path) -> None:
    got: list[tuple[int, list[str]]] = []
    async with sim_servers(1, profile="prime-rl") as servers:
        cfg = direct_job(tmp_path, [servers[0].url], steps=STEPS)
        cfg = dataclasses.replace(cfg, env=tuple(dataclasses.replace(e, workers=0) for e in cfg.env),
                                  scheduler=dataclasses.replace(cfg.scheduler, remote_workers=1))
        async with Orchestrator.open(cfg) as orch:
            receiver = BatchReceiver(orch.sender.address, auto_ack=False)
            receiver.pools.host = "trainer-node"  # every pool is on "another host": fetched from its span server
            ckpt = Path(cfg.run.output_dir) / "ckpt"

            async def trainer() -> None:
                while len(got) < STEPS:
                    view = await receiver.recv_view()
                    assert isinstance(view, StepView)
                    batch = view.gather()
                    got.append((batch.step, [str(r) for r in batch.scalars["rollout"]]))
                    del view
                    await receiver.ack(batch.step)
                    step_dir = ckpt / f"step_{batch.step + 1}"
                    step_dir.mkdir(parents=True, exist_ok=True)
                    await receiver.announce(batch.step + 1, str(step_dir))

            try:
                async with (orchestrator_process("env-worker", "--connect", orch.hub.address, "--id", "remote-a",
                                                 "--span-address", "tcp://127.0.0.1:0") as proc,
                            asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg):
                    tg.create_task(trainer())
                    watch = tg.create_task(worker_alive(proc))
                    await orch.run()
                    watch.cancel()
            finally:
                receiver.close()
            pool = orch.hub.pools.pool("remote-a")
            assert unacked_steps(orch) == {}
    assert [s for s, _ in got] == list(range(STEPS))
    assert pool is not None
    assert pool.address is not None
    assert pool.address.startswith("tcp://127.0.0.1:")
    assert receiver.pools.remote_fetches >= sum(1 for _, rids in got if rids)  # one request per step with samples
    assert receiver.pools.fetches == 0  # nothing mapped
    rids = [r for _, rs in got for r in rs]
    assert len(rids) == len(set(rids))
