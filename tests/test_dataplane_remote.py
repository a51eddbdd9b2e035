"""Direct mode across nodes, on one machine: a remote env worker process serves its column pool over ZMQ
(``env-worker --span-address``), and a trainer whose reader believes it is on another host fetches every step's
spans from it instead of mapping the pool (docs/data-plane.md, "Across nodes")."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from orchestrator.app import Orchestrator
from orchestrator.testing.procs import Process, orchestrator_process
from orchestrator.testing.sim import sim_servers
from orchestrator.trainer.reader import StepView
from orchestrator.trainer.receiver import BatchReceiver
from orchestrator.trainer.reference import save_initial_checkpoint
from test_dataplane_e2e import JOB_GUARD_S, direct_job, unacked_steps

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("verifiers_home")]
STEPS = 3


async def worker_alive(proc: Process) -> None:
    """Fails the test at once if the worker process exits (not after the job's guard)."""
    code = await proc.wait()
    raise AssertionError(f"the remote env worker exited with status {code}")


async def fetching_trainer(address: str, ckpt: Path, got: list[tuple[int, list[str]]]) -> BatchReceiver:
    """Reads STEPS steps from ``address`` as a trainer on another host does (its receiver believes every pool is
    on another host, so it fetches, never maps): views gathered, acknowledged, a checkpoint announced after each;
    appends (step, rollout ids) to ``got``. Its receiver, closed."""
    receiver = BatchReceiver(address, auto_ack=False)
    receiver.pools.host = "trainer-node"
    try:
        while len(got) < STEPS:
            view = await receiver.recv_view()
            assert isinstance(view, StepView)
            batch = view.gather()
            got.append((batch.step, [str(r) for r in batch.scalars["rollout"]]))
            del view
            await receiver.ack(batch.step)
            step_dir = await asyncio.to_thread(save_initial_checkpoint, ckpt, batch.step + 1)
            await receiver.announce(batch.step + 1, str(step_dir))
    finally:
        receiver.close()
    return receiver


async def remote_job(tmp_path: Path,
                     trainer: Callable[[Orchestrator, Path], Coroutine[Any, Any, object]]) -> Orchestrator:
    """A direct-mode job whose one env worker is a remote process serving its pool over tcp, with ``trainer``
    (given the orchestrator and a checkpoint directory) run beside it."""
    async with sim_servers(1, profile="prime-rl") as servers:
        cfg = direct_job(tmp_path, [servers[0].url], steps=STEPS)
        cfg = dataclasses.replace(cfg, env=tuple(dataclasses.replace(e, workers=0) for e in cfg.env),
                                  scheduler=dataclasses.replace(cfg.scheduler, remote_workers=1))
        async with Orchestrator.open(cfg) as orch:
            async with (orchestrator_process("env-worker", "--connect", orch.hub.address, "--id", "remote-a",
                                             "--span-address", "tcp://127.0.0.1:0") as proc,
                        asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg):
                tg.create_task(trainer(orch, Path(cfg.run.output_dir) / "ckpt"))
                watch = tg.create_task(worker_alive(proc))
                await orch.run()
                watch.cancel()
            assert unacked_steps(orch) == {}
    return orch


def check_steps(got: list[tuple[int, list[str]]]) -> None:
    """Every step once, in order, no rollout twice."""
    assert [s for s, _ in got] == list(range(STEPS))
    rids = [r for _, rs in got for r in rs]
    assert len(rids) == len(set(rids))


async def test_a_trainer_on_another_host_fetches_every_step_from_the_workers_span_server(tmp_path: Path) -> None:
    got: list[tuple[int, list[str]]] = []
    receivers: list[BatchReceiver] = []

    async def trainer(orch: Orchestrator, ckpt: Path) -> None:
        receivers.append(await fetching_trainer(orch.sender.address, ckpt, got))

    orch = await remote_job(tmp_path, trainer)
    check_steps(got)
    receiver = receivers[0]
    pool = orch.hub.pools.pool("remote-a")
    assert pool is not None
    assert pool.address is not None
    assert pool.address.startswith("tcp://127.0.0.1:")
    assert receiver.pools.remote_fetches >= sum(1 for _, rids in got if rids)  # one request per step with samples
    assert receiver.pools.fetches == 0  # nothing mapped


KILLED_MID_FETCH = """
import asyncio, sys
from orchestrator.trainer.receiver import BatchReceiver

async def main():
    receiver = BatchReceiver(sys.argv[1], auto_ack=False)
    receiver.pools.host = "trainer-node"  # every pool is on another host: fetched from its span server
    fetch = receiver.pools._fetch_spans

    def fetching(*args):
        print("fetching", flush=True)  # killed from here on
        return fetch(*args)

    receiver.pools._fetch_spans = fetching
    await receiver.recv_view()
    await asyncio.Event().wait()  # until SIGKILL

asyncio.run(main())
"""


async def test_a_trainer_killed_mid_fetch_gets_the_step_again_when_restarted(tmp_path: Path) -> None:
    """A trainer on another host is SIGKILLed once it has step 0's manifest and starts fetching its spans (the
    kill lands around the request: before it, or while the reply is on its way); the worker's span server goes
    on, and the trainer started after it gets step 0 again and every later step, once, in order."""
    got: list[tuple[int, list[str]]] = []
    killed: list[int] = []

    async def kill_then_restart(orch: Orchestrator, ckpt: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", KILLED_MID_FETCH, orch.sender.address,
                                                    stdout=asyncio.subprocess.PIPE, env=env)
        try:
            assert proc.stdout is not None
            line = await proc.stdout.readline()
            assert line.strip() == b"fetching", line
            os.kill(proc.pid, signal.SIGKILL)  # the process this test started
            killed.append(await proc.wait())
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                await proc.wait()
        assert orch.sender.acked == -1  # the killed trainer acknowledged nothing
        await fetching_trainer(orch.sender.address, ckpt, got)

    await remote_job(tmp_path, kill_then_restart)
    assert killed == [-signal.SIGKILL]
    check_steps(got)


async def test_local_workers_serve_their_pools_at_the_span_address_to_a_trainer_on_another_host(
        tmp_path: Path) -> None:
    """``transport.span_address``: the orchestrator's own env workers each bind a span server there (a port each)
    and a trainer on another host fetches every step from them, nothing mapped."""
    got: list[tuple[int, list[str]]] = []
    async with sim_servers(1, profile="prime-rl") as servers:
        cfg = direct_job(tmp_path, [servers[0].url], steps=STEPS,
                         overrides=('transport.span_address="tcp://127.0.0.1:0"',))
        async with Orchestrator.open(cfg) as orch:
            async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                trainer = tg.create_task(fetching_trainer(orch.sender.address, Path(cfg.run.output_dir) / "ckpt", got))
                await orch.run()
            pools = orch.hub.pools.pools()
            assert unacked_steps(orch) == {}
    check_steps(got)
    receiver = trainer.result()
    assert receiver.pools.fetches == 0  # nothing mapped
    assert receiver.pools.remote_fetches >= sum(1 for _, rids in got if rids)
    addresses = {p.address for p in pools.values()}
    assert len(addresses) == len(pools) == 2  # a server, and a port, for each local worker
    assert all(a is not None and a.startswith("tcp://127.0.0.1:") for a in addresses)
