"""Stalls that used to hold a job forever, with real processes: env workers frozen with SIGSTOP (local ones and a
remote one), an inference server whose generate route hangs, and one whose whole process is stopped during a
weight sync. Each stall resolves, or is named in the log, within a bound the test sets short through the config:

- a frozen worker is lost ``scheduler.worker_silence_s`` (here WORKER_SILENCE_S) after its last message, with its
  rollouts; a local one is killed and restarted, a remote one re-admitted when it speaks again;
- a hung server's rollouts fail as ``timeout`` ``inference.request_timeout_s`` (here REQUEST_TIMEOUT_S) after they
  started; the server leaves rotation after ``failures_to_evict`` of them and stays out while its generate route
  hangs (the probe's canary), and the run goes on with the other server;
- a weight sync on a stopped server fails after ``weight_sync_timeout_s`` (plus a bounded resume), naming it.

The bounds here are hang guards only: every wait is for an event (a loss, an eviction, a step), never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.commands.report import read_metrics
from orchestrator.config import InferenceConfig, JobConfig
from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.inference.pool import PROBE_CACHE_SALT, InferencePool
from orchestrator.sim.server import SimServer
from orchestrator.testing.jobs import ARITHMETIC, Section, job_config
from orchestrator.testing.procs import orchestrator_process, wait_until
from orchestrator.testing.sim import Faults, sim_cluster, sim_process
from orchestrator.trainer.reference import ReferenceTrainer, save_initial_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("verifiers_home")]

WORKER_SILENCE_S = 3.0  # heartbeats come every second; a loaded machine's worker is not silent this long
REQUEST_TIMEOUT_S = 2.0  # a healthy sim server answers in milliseconds; a hung one never
WEIGHT_SYNC_TIMEOUT_S = 1.0
# hang guard of the env workers' start-up: importing verifiers takes seconds on a quiet machine, and took 100-210 s
# with every core busy many times over (flake runs at --load 6-8), which a guard of the whole job mistook for a hang
START_TIMEOUT_S = 300.0
JOB_TIMEOUT_S = 240.0  # hang guard from then on: a job here takes 20-60 s on a quiet 2-core machine
WAIT_S = 120.0  # hang guard of each wait for an event inside a job


def job(tmp_path: Path, urls: list[str], data_plane: str, *, steps: int, workers: int = 1,
        inference: Section | None = None, scheduler: Section | None = None, silence_s: float = WORKER_SILENCE_S,
        monitor: Section | None = None, env: Section | None = None) -> JobConfig:
    return job_config(
        tmp_path, run={"name": "supervision", "max_steps": steps},
        inference={"servers": urls, "failures_to_evict": 3, "probe_interval_s": 0.2, **(inference or {})},
        scheduler={"batch_size": 8, "max_inflight": 8, "max_async_level": 2, "max_buffered_rollouts": 16,
                   "worker_silence_s": silence_s, **(scheduler or {})},
        transport={"data_plane": data_plane},
        env=[{**(env or ARITHMETIC), "name": "arith", "workers": workers}], monitor=monitor or {})


class Steps:
    """``orch.on_step``: keeps each step's metrics; ``reached(n)`` waits until step ``n`` has finished."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, Any]] = []
        self._changed = asyncio.Event()

    def __call__(self, metrics: dict[str, Any]) -> None:
        self.metrics.append(metrics)
        self._changed.set()

    async def reached(self, step: int) -> None:
        while len(self.metrics) <= step:
            self._changed.clear()
            await self._changed.wait()


Chaos = Callable[[Orchestrator, Steps, ReferenceTrainer], Coroutine[Any, Any, None]]


async def run_job(cfg: JobConfig, chaos: Chaos, *, stop_after_chaos: bool = False,
                  beside: Callable[[Orchestrator], contextlib.AbstractAsyncContextManager[Any]] | None = None
                  ) -> tuple[Orchestrator, list[dict[str, Any]]]:
    """The job with ``chaos`` beside it (and ``beside(orch)`` entered once the orchestrator is open, e.g. a
    remote worker's process), to its last step, or (``stop_after_chaos``) to the first step that ends after the
    chaos did: then it is cancelled, so the job cannot end before what the chaos waits for. Checks that steps
    reached the trainer once each, in order; returns the rollout rows too."""
    async with Orchestrator.open(cfg) as orch, contextlib.AsyncExitStack() as stack:
        if beside is not None:
            await stack.enter_async_context(beside(orch))
        trainer = ReferenceTrainer(orch.sender.address, max_steps=cfg.run.max_steps,
                                   checkpoint_dir=Path(cfg.run.output_dir) / "ckpt")
        steps = Steps()
        orch.on_step = steps
        async with asyncio.timeout(START_TIMEOUT_S) as guard, asyncio.TaskGroup() as tg:
            training = tg.create_task(trainer.run())
            running = tg.create_task(orch.run())
            tg.create_task(started(orch, guard))
            await chaos(orch, steps, trainer)
            if stop_after_chaos:
                await steps.reached(len(steps.metrics))
                running.cancel()
                training.cancel()
    out = Path(cfg.run.output_dir)
    done = [m["step"] for m in read_metrics(out / "metrics.jsonl")]
    assert done == list(range(len(done)))
    assert len(steps.metrics) == len(done)
    assert done == list(range(cfg.run.max_steps)) or stop_after_chaos
    received = [r.step for r in trainer.received]
    assert received == list(range(len(received)))  # each step once, in order
    assert len(received) >= len(done)
    return orch, [orjson.loads(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]


async def started(orch: Orchestrator, guard: asyncio.Timeout) -> None:
    """Once the env workers are ready, the job's hang guard is JOB_TIMEOUT_S from then on."""
    await wait_until(lambda: orch.hub.ready_count() >= orch.hub.expected, START_TIMEOUT_S, "the env workers ready")
    guard.reschedule(asyncio.get_running_loop().time() + JOB_TIMEOUT_S)


@contextlib.contextmanager
def pidfds(pids: list[int]) -> Iterator[list[int]]:
    """Descriptors of these processes: a signal sent through one reaches that process or none, even after its pid
    was reaped and reused (the hub kills and reaps frozen local workers)."""
    fds = [os.pidfd_open(pid) for pid in pids]
    try:
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def signal_all(fds: list[int], sig: signal.Signals) -> None:
    for fd in fds:
        with contextlib.suppress(ProcessLookupError):  # it has exited (killed by the hub)
            signal.pidfd_send_signal(fd, sig)


# -------------------------------------------------------------------------------------------- frozen workers


async def test_frozen_local_workers_are_killed_and_restarted_and_the_step_completes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, data_plane: str) -> None:
    """The issue's case: SIGSTOP both workers for longer than the silence bound, then SIGCONT. They used to be
    declared dead and nothing else: the step sat at "0 rollouts in flight" forever."""
    steps = 5
    facts: dict[str, Any] = {}
    async with sim_cluster(1, faults=Faults(latency_ms=20.0)) as cluster:
        cfg = job(tmp_path, cluster.urls, data_plane, steps=steps, workers=2)

        async def freeze_both(orch: Orchestrator, watch: Steps, _trainer: ReferenceTrainer) -> None:
            await watch.reached(0)
            facts["frozen"] = pids = dict(orch.hub.local_pids())
            lost = orch.hub.metrics["lost"]
            with pidfds(list(pids.values())) as fds:
                signal_all(fds, signal.SIGSTOP)
                facts["step_at_freeze"] = len(watch.metrics)
                await wait_until(lambda: orch.hub.metrics["lost"] >= lost + 2, WAIT_S, "both frozen workers lost")
                signal_all(fds, signal.SIGCONT)  # as in the issue (the hub killed them already: it reaches none)
            await wait_until(lambda: orch.hub.metrics["restarts"] >= 2 and orch.hub.has_ready(), WAIT_S,
                             "the workers restarted and one ready")

        with caplog.at_level(logging.INFO, logger="orchestrator"):
            orch, rows = await run_job(cfg, freeze_both)
    assert facts["step_at_freeze"] < steps  # the steps after the freeze completed (run_job checked all of them)
    pids = orch.hub.local_pids()
    assert not set(pids.values()) & set(facts["frozen"].values())  # both replaced by new processes ...
    assert sorted(pids) == sorted(facts["frozen"])  # ... under their names
    for name, pid in facts["frozen"].items():
        assert re.search(rf"env worker {name} silent for \d+ s: lost, \d+ rollouts in flight fail; killed "
                         rf"\(pid {pid}\) to be restarted", caplog.text), name
    # a worker that was serving restarts at once: no backoff for an exit that was not a failure to load
    delays = re.findall(r"local env worker local-\d \(pid \d+\) exited with status -9; restarting it in (\d+) s",
                        caplog.text)
    assert len(delays) >= 2, delays
    assert set(delays) == {"0"}, delays
    # rollouts in flight on them failed as worker_died, naming the worker and the silence; in direct mode so did
    # those finished there and not trained yet (their columns went with the worker): for the same reason, or as
    # the step builder names it when the step had been taken before the pool went
    why = r"silent for \d+ s" + (r"|its column pool is gone" if data_plane == "direct" else "")
    died = [r for r in rows if r["failure"] == "worker_died"]
    assert all(re.fullmatch(rf"env worker local-\d: ({why})", r["error"]) for r in died), died


def holding(how: str, hold_s: float) -> Section:
    """orchestrator-faulty: the first rollout each worker process scores holds its event loop ``hold_s`` seconds,
    spinning on the CPU (``cpu``) or asleep in a blocking call (``sleep``)."""
    return {"taskset": "orchestrator-faulty", "args": {"fail_in": f"hold_{how}", "hold_s": hold_s}}


async def test_a_worker_whose_loop_is_held_by_work_is_not_lost_and_one_asleep_is(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A CI run lost a worker and its 32 rollouts after 10 s without a heartbeat while its process was busy (the
    machine's disk and cores were shared with a real vLLM and a PyTorch trainer). Now a local worker silent past
    worker_silence_s whose process is at work (running, waiting on the disk, using CPU) is given up to
    AT_WORK_FACTOR times the bound, said once; one asleep in a blocking call doing nothing is lost at the bound."""
    silence_s = 2.0
    async with sim_cluster(1) as cluster:
        cfg = job(tmp_path / "cpu", cluster.urls, "through", steps=2, silence_s=silence_s,
                  env=holding("cpu", 3 * silence_s))
        with caplog.at_level(logging.INFO, logger="orchestrator"):
            orch, rows = await run_job(cfg, lambda *_: asyncio.sleep(0))
        assert orch.hub.metrics["lost"] == 0, caplog.text
        assert not [r for r in rows if r["failure"]], rows
        assert re.search(r"env worker local-0 silent for \d+ s, but its process \(pid \d+\) is (running|working): "
                         r"its event loop is held, not frozen; lost if still silent at 12 s", caplog.text)

        cfg = job(tmp_path / "sleep", cluster.urls, "through", steps=2, silence_s=silence_s,
                  env=holding("sleep", 3 * silence_s))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="orchestrator"):
            async with Orchestrator.open(cfg) as orch, asyncio.TaskGroup() as tg:
                trainer = ReferenceTrainer(orch.sender.address, max_steps=2)
                tasks = [tg.create_task(trainer.run()), tg.create_task(orch.run())]
                # each process the hub restarts sleeps again: the job cannot end, so it is cancelled
                await wait_until(lambda: orch.hub.metrics["lost"] >= 1, START_TIMEOUT_S, "the sleeping worker lost")
                for task in tasks:
                    task.cancel()
        assert re.search(r"env worker local-0 silent for [2-5] s: lost", caplog.text), caplog.text
        assert "its event loop is held" not in caplog.text


async def test_local_workers_stopped_as_they_start_are_named_then_killed_and_restarted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, data_plane: str) -> None:
    """The issue's case: both env workers SIGSTOPped as soon as they start. Nothing named the wait, and a worker
    that had not sent its first heartbeat was never lost: the run sat silent, pids unchanged, for 300 s. Now the
    start-up wait is named every monitor.stall_warn_s (each worker, its pid, connected or not, stopped), and a
    local worker stopped before it is ready is killed after worker_silence_s and restarted."""
    warn_s = 1.0
    facts: dict[str, Any] = {}
    async with sim_cluster(1) as cluster:
        # each worker takes 3 s to load (forked from the warm process, it would otherwise be ready at once)
        loading = {**ARITHMETIC, "taskset": "orchestrator-faulty", "args": {"fail_in": "hold_load", "hold_s": 3.0}}
        cfg = job(tmp_path, cluster.urls, data_plane, steps=2, workers=2, monitor={"stall_warn_s": warn_s},
                  env=loading)

        @contextlib.asynccontextmanager
        async def stopped_as_they_start(orch: Orchestrator) -> AsyncIterator[None]:
            facts["stopped"] = pids = dict(orch.hub.local_pids())  # started by open(), loading still
            with pidfds(list(pids.values())) as fds:
                signal_all(fds, signal.SIGSTOP)
                yield

        async def restarted(orch: Orchestrator, _watch: Steps, _trainer: ReferenceTrainer) -> None:
            await wait_until(lambda: orch.hub.metrics["restarts"] >= 2, WAIT_S, "both stopped workers restarted")

        with caplog.at_level(logging.INFO, logger="orchestrator"):
            orch, _ = await run_job(cfg, restarted, beside=stopped_as_they_start)  # and every step completed
    pids = orch.hub.local_pids()
    assert not set(pids.values()) & set(facts["stopped"].values())  # both replaced ...
    assert sorted(pids) == sorted(facts["stopped"])  # ... under their names
    messages = [r.getMessage() for r in caplog.records]
    waits = [m for m in messages if m.startswith("env workers: 0 of 2 ready after ")]
    assert waits, messages
    said = re.match(r"env workers: 0 of 2 ready after (\d+) s", waits[0])
    assert said is not None, waits[0]
    first = float(said[1])
    assert first <= warn_s + 5, waits[0]  # at warn_s, give or take a busy machine's timer
    for name, pid in facts["stopped"].items():
        killed = [i for i, m in enumerate(messages) if re.fullmatch(
            rf"env worker {name} \(pid {pid}\) stopped \(SIGSTOP or a debugger\) for \d+ s before it was ready: "
            r"lost; killed to be restarted", m)]
        assert len(killed) == 1, (name, messages)
        named = [i for i, m in enumerate(messages) if i in range(killed[0]) and re.search(
            rf"{name} \(local, pid {pid}, (not connected|connected, loading its environments), stopped for \d+ s\)",
            m)]
        assert named, (name, waits)  # the wait named it, stopped, before it was killed


async def test_a_frozen_remote_worker_is_dropped_then_readmitted_when_it_speaks_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, data_plane: str) -> None:
    """A remote worker is not the hub's to kill: lost while frozen (its rollouts fail, the job waits for a worker),
    re-admitted after SIGCONT, and the records it had in flight count as late, not as invalid messages."""
    steps = 4
    facts: dict[str, Any] = {}
    worker: list[asyncio.subprocess.Process] = []
    async with sim_cluster(1, faults=Faults(latency_ms=20.0)) as cluster:
        cfg = job(tmp_path, cluster.urls, data_plane, steps=steps, workers=0, scheduler={"remote_workers": 1})

        @contextlib.asynccontextmanager
        async def remote_worker(orch: Orchestrator) -> AsyncIterator[None]:
            async with orchestrator_process("env-worker", "--connect", orch.hub.address, "--id", "remote-a") as proc:
                worker.append(proc)
                yield

        async def freeze_then_continue(orch: Orchestrator, watch: Steps, _trainer: ReferenceTrainer) -> None:
            await watch.reached(0)
            proc = worker[0]
            proc.send_signal(signal.SIGSTOP)
            try:
                await wait_until(lambda: not orch.hub.has_ready(), WAIT_S, "the frozen worker lost", alive=proc)
                facts["step_at_loss"] = len(watch.metrics)
            finally:
                proc.send_signal(signal.SIGCONT)
            await wait_until(orch.hub.has_ready, WAIT_S, "the worker re-admitted", alive=proc)

        with caplog.at_level(logging.INFO, logger="orchestrator"):
            orch, rows = await run_job(cfg, freeze_then_continue, beside=remote_worker)
    assert facts["step_at_loss"] < steps
    assert orch.hub.metrics["restarts"] == 0  # not killed: the same process served again
    assert orch.hub.worker_stats()["remote-a"][0] > 0  # rollouts completed after its re-admission
    assert re.search(r"env worker remote-a silent for \d+ s: lost, \d+ rollouts in flight fail; re-admitted if it "
                     r"speaks again", caplog.text)
    assert "env worker remote-a is back: sending setup to re-admit it" in caplog.text
    assert not [k for k in orch.hub.metrics if k.startswith("rejected:")], orch.hub.metrics  # stragglers: late
    died = [r for r in rows if r["failure"] == "worker_died"]
    assert all(re.fullmatch(r"env worker remote-a: silent for \d+ s", r["error"]) for r in died), died


# --------------------------------------------------------------------------------------------- hung servers


def written_rows(orch: Orchestrator) -> list[dict[str, Any]]:
    """The complete lines of rollouts.jsonl so far (the step thread may be appending one)."""
    path = orch.out / "rollouts.jsonl"
    data = path.read_bytes() if path.exists() else b""
    return [orjson.loads(x) for x in data[:data.rfind(b"\n") + 1].splitlines()]


GROUP_TIMEOUT_S = 120.0  # far above the request timeout in the hung-server test: that one must fire


def probe_hangs(server: SimServer) -> int:
    return sum(g.fault == "hang" and g.cache_salt == PROBE_CACHE_SALT for g in server.log.generate)


@pytest.mark.parametrize("off_policy_steps", [
    pytest.param(100, id="rollouts-time-out"),
    # the case: steps run on with the other server, so the hung server's groups are cancelled as stale
    # before their requests time out, and never say the server is hung: the pool's liveness check must
    pytest.param(2, id="rollouts-go-stale-first"),  # the least the config allows (max_async_level = 2)
])
async def test_a_hung_server_times_out_its_rollouts_leaves_rotation_and_the_run_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, off_policy_steps: int, data_plane: str) -> None:
    """Its generate route stops answering while /health still does (the sim's hang fault): env workers' requests
    time out after request_timeout_s (or their groups go stale first), the server leaves rotation like one that
    errs, stays out while the probe's generate canary hangs, and rejoins once it answers again; every step
    completes meanwhile."""
    facts: dict[str, Any] = {}
    async with sim_cluster(2, faults=Faults(latency_ms=10.0)) as cluster:
        hung_url = cluster.urls[0]
        # stopped once the server is back: never its last step first, which the wait below for a timed-out row
        # may outlast (a fresh-clone CI run on a fast machine ran all of 100 steps, then waited out its guard)
        cfg = job(tmp_path, cluster.urls, data_plane, steps=5000, silence_s=30.0,
                  inference={"request_timeout_s": REQUEST_TIMEOUT_S, "weight_sync_timeout_s": 30.0},
                  # the group timeout far above the request timeout: that one must fire
                  scheduler={"group_timeout_s": GROUP_TIMEOUT_S, "max_off_policy_steps": off_policy_steps})

        async def hang_then_recover(orch: Orchestrator, watch: Steps, _trainer: ReferenceTrainer) -> None:
            await watch.reached(0)
            pooled = orch.pool.servers[0]
            assert pooled.url == hung_url
            cluster.set_faults(0, hang_rate=1.0)
            await wait_until(lambda: not pooled.in_rotation, WAIT_S, "the hung server evicted", poll_s=0.02)
            facts["step_at_eviction"] = len(watch.metrics)
            await wait_until(lambda: probe_hangs(cluster[0]) >= 2, WAIT_S, "two probes of it hung", poll_s=0.02)
            await watch.reached(facts["step_at_eviction"] + 1)  # the run went on with the other server
            facts["rejoined_while_hung"] = pooled.in_rotation
            logging.getLogger("orchestrator.test").info("the hung server answers again")
            cluster.set_faults(0)
            await wait_until(lambda: pooled.in_rotation, WAIT_S, "the server back in rotation", poll_s=0.02)
            served = len(cluster[0].log.generate)
            await wait_until(lambda: any(g.status == 200 and g.cache_salt != PROBE_CACHE_SALT
                                         for g in list(cluster[0].log.generate)[served:]), WAIT_S,
                             "rollouts served by it again", poll_s=0.02)
            if off_policy_steps == 100:  # a timed-out rollout's row is written when its group ends, which a sibling
                # still queued for a connection to the hung server delays (seen under load) up to the group's
                # timeout (a fresh-clone CI run waited 120 s and saw none: its group began before the hang)
                await wait_until(lambda: any(r["failure"] == "timeout" for r in written_rows(orch)),
                                 GROUP_TIMEOUT_S + WAIT_S, "a timed-out rollout's row", poll_s=0.1)

        with caplog.at_level(logging.INFO, logger="orchestrator"):
            _, rows = await run_job(cfg, hang_then_recover, stop_after_chaos=True)
    assert not facts["rejoined_while_hung"]
    messages = [r.getMessage() for r in caplog.records]
    cleared = messages.index("the hung server answers again")
    left = [i for i, m in enumerate(messages) if m.startswith(f"inference server {hung_url} leaves rotation")]
    back = [i for i, m in enumerate(messages) if m.startswith(f"inference server {hung_url} rejoins rotation")]
    assert len(left) == 1, left  # out once, until it answered again
    assert left[0] < cleared < back[0], (left, cleared, back)
    assert re.search(r"\d+ failure\(s\) in a row, last: timeout: ", messages[left[0]])
    # its rollouts failed as request timeouts, each no sooner than the timeout (none as a group timeout), or
    # were cancelled as stale before it
    timeouts = [r for r in rows if r["failure"] == "timeout"]
    assert {r["failure"] for r in rows if not r["ok"]} <= {"timeout", "stale"}
    assert timeouts or off_policy_steps < 100
    assert all(r["wall_s"] >= REQUEST_TIMEOUT_S for r in timeouts), [r["wall_s"] for r in timeouts]
    assert all(re.search(r"timed out|Timeout", r["error"]) for r in timeouts), {r["error"] for r in timeouts}


async def test_a_stalled_step_names_each_server_out_of_rotation_and_its_last_probe(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, data_plane: str) -> None:
    """A server that stays out says why in every stall line: why it left, and what its last probe found. Probe
    failures after the first were at DEBUG, and a stalled step named the servers only when none was left, so a
    server kept out (the issue: a hung one that answered again, not back in 120 s, under load) never said why."""
    facts: dict[str, Any] = {}
    async with sim_cluster(2) as cluster:
        down = cluster.urls[0]
        cfg = job(tmp_path, cluster.urls, data_plane, steps=100, monitor={"stall_warn_s": 1.0},
                  inference={"request_timeout_s": 60.0})  # server 1's held rollouts stay in flight

        async def stall_with_one_out(orch: Orchestrator, watch: Steps, _trainer: ReferenceTrainer) -> None:
            await watch.reached(0)
            cluster.set_faults(1, hold=True)  # its rollouts stay in flight: the step stalls
            cluster.set_faults(0, down=True)  # 503 everywhere: out of rotation, and every probe fails
            pattern = (rf"waits for rollouts \(servers out of rotation: {re.escape(down)} out for \d+ s \(.+\); its "
                       r"last probe \((\d+) failed\) \d+ s ago: GET \S+/health: HTTP 503")
            await wait_until(lambda: any(int(m[1]) >= 3 for r in caplog.records if (m := re.search(
                pattern, r.getMessage()))), WAIT_S, "a stall line naming three failed probes", poll_s=0.05)
            facts["probes"] = orch.pool.servers[0].probe_failures
            cluster.set_faults(1)  # released: the run goes on

        with caplog.at_level(logging.INFO, logger="orchestrator"):
            await run_job(cfg, stall_with_one_out, stop_after_chaos=True)
    stays = [r for r in caplog.records if r.getMessage().startswith(f"inference server {down} stays out")]
    assert facts["probes"] >= 3
    # the same verdict again is at DEBUG: a server may stay out for hours; the stall lines repeat it
    assert [r.levelname for r in stays][:1] == ["INFO"], [(r.levelname, r.getMessage()) for r in stays]
    assert sum(r.levelname == "INFO" for r in stays) < facts["probes"]


async def test_weight_sync_on_a_stopped_server_is_bounded_and_named_and_it_rejoins_after(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A server process stopped with SIGSTOP answers nothing, /health included: its weight sync fails after
    weight_sync_timeout_s while the other server's completes, the log names it, and once it continues the probe
    syncs it to the current weights and it rejoins."""
    for step in (1, 2):
        save_initial_checkpoint(tmp_path, step)
    async with sim_process() as stopped, sim_process() as running:
        cfg = InferenceConfig(servers=(stopped.url, running.url), weight_sync_timeout_s=WEIGHT_SYNC_TIMEOUT_S,
                              request_timeout_s=REQUEST_TIMEOUT_S, probe_interval_s=0.1,
                              weights_path=f"{tmp_path}/step_{{step}}")
        async with InferencePool.open(cfg, "sim-model") as pool, asyncio.TaskGroup() as tg:
            prober = tg.create_task(pool.run())
            with caplog.at_level(logging.INFO, logger="orchestrator"):
                stopped.proc.send_signal(signal.SIGSTOP)
                try:
                    async with asyncio.timeout(WAIT_S):
                        first = await pool.update_weights(Checkpoint(1))
                        assert not pool.servers[0].in_rotation
                        second = await pool.update_weights(Checkpoint(2))  # it is not waited for again
                finally:
                    stopped.proc.send_signal(signal.SIGCONT)
                await wait_until(lambda: pool.servers[0].in_rotation, WAIT_S, "the stopped server back")
            prober.cancel()
        log = await read_log(stopped.url)
    assert (first.updated, second.updated) == ([running.url], [running.url])
    assert first.failed == {stopped.url: f"pause on {stopped.url} took more than {WEIGHT_SYNC_TIMEOUT_S:g} s"}
    assert second.failed == {}  # out of rotation: the probe syncs it before it rejoins
    assert f"inference server {stopped.url} leaves rotation: weight sync to step 1 failed: pause on" in caplog.text
    assert "weight sync to step 1 failed on 1 of 2 servers" in caplog.text
    assert f"inference server {stopped.url} rejoins rotation (healthy on probe, weights of step 2)" in caplog.text
    assert log["weights_path"] == f"{tmp_path}/step_2"
    assert log["pause_mode"] is None  # resumed, whatever order its queued pause and resume were handled in


async def read_log(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url.removesuffix("/v1") + "/sim/log") as reply:
        data: dict[str, Any] = await reply.json()
        return data

