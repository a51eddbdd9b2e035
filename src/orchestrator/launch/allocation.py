"""Inside the allocation: the job's roles as job steps, started in order and watched until the job ends.

``orchestrator launch allocation JOB.toml --job-dir DIR`` is what the sbatch script runs, in the batch step:

1. **Place.** The nodes of ``$SLURM_JOB_NODELIST`` and their addresses (``scontrol``) give each role its nodes
   (plan.py) and every address a role is told: the servers' URLs, the orchestrator's worker and trainer
   addresses, the trainer's rendezvous node.
2. **Keys.** The job's CURVE keys are made once in ``DIR/keys`` (kept across requeues and resubmissions): the
   orchestrator's pair, one pair for the env workers and one for the trainer, whose public halves are the
   orchestrator's ``authorized`` directory. Each role is given the paths of the files it needs, never a key.
3. **Start, in order.** The servers; once each answers its health route, the orchestrator (``--resume`` when
   its state exists: a requeued or resubmitted job goes on where the journal says); once it accepts
   connections on its worker port, the env workers and the trainer.
4. **Watch.** A server or env worker step that dies is started again while it has ``restarts`` left; else the
   job goes on without it (the pool takes a dead server out of rotation) until none of its role is left. The
   orchestrator or the trainer dying ends the job (status 1), naming which, how, and its log's last lines.
   The orchestrator ending cleanly ends the job (status 0): the other steps are stopped.
5. **Stop.** SIGTERM (``scancel``, the time limit, a requeue) reaches every step from SLURM itself; this runner
   waits for its steps to end and records why. Every change is written to ``DIR/status.json`` and logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from orchestrator.config import JobConfig
from orchestrator.launch import slurm
from orchestrator.launch.config import LaunchConfig, fill
from orchestrator.launch.plan import Plan, PlanError
from orchestrator.launch.sbatch import JobFiles
from orchestrator.launch.status import JobStatus, StepStatus
from orchestrator.launch.steps import JobStep, describe_exit, last_lines
from orchestrator.security import create_key_pair
from orchestrator.state import STATE_FILE

log = logging.getLogger(__name__)

POLL_S = 1.0
WARN_S = 30.0  # a wait for readiness says what it waits for this often


class JobEnded(Exception):
    """The job is over: ``state`` (completed, failed, stopped), ``why`` and the runner's exit status."""

    def __init__(self, state: str, why: str, code: int) -> None:
        super().__init__(why)
        self.state, self.why, self.code = state, why, code


@dataclass(frozen=True)
class Keys:
    """The job's CURVE key files (the paths each role is given)."""

    server_secret: Path
    server_public: Path
    authorized: Path
    worker_secret: Path
    trainer_secret: Path

    @classmethod
    def make(cls, directory: Path) -> Keys:
        """Make the job's keys in ``directory`` unless they exist (a requeued job keeps its keys)."""
        keys = cls(directory / "orchestrator.key_secret", directory / "orchestrator.key", directory / "authorized",
                   directory / "worker.key_secret", directory / "trainer.key_secret")
        for name in ("orchestrator", "worker", "trainer"):
            if not (directory / f"{name}.key_secret").exists():
                create_key_pair(directory, name)
        keys.authorized.mkdir(mode=0o700, exist_ok=True)
        for name in ("worker", "trainer"):
            if not (keys.authorized / f"{name}.key").exists():
                shutil.copyfile(directory / f"{name}.key", keys.authorized / f"{name}.key")
        return keys


class Allocation:
    """The runner of one job attempt in its allocation (see the module docstring)."""

    def __init__(self, cfg: JobConfig, config_path: Path, overrides: Sequence[str], files: JobFiles, plan: Plan,
                 job_id: str, attempt: int, python: str,
                 job_state: Callable[[str], Awaitable[str | None]] = slurm.ajob_state) -> None:
        """``job_state``: SLURM's word on the job (``slurm.ajob_state``), asked when a step ends before the
        runner heard of a stop."""
        assert cfg.launch is not None
        self.cfg, self.launch, self.config_path, self.overrides = cfg, cfg.launch, config_path, list(overrides)
        self.files, self.plan, self.job_id, self.python, self.job_state = files, plan, job_id, python, job_state
        self.keys = Keys.make(files.keys)
        self.status = JobStatus(job_id, attempt, str(files.root), plan=plan.describe())
        self.steps = self._steps()
        for step in self.steps.values():
            self.status.steps[step.name] = StepStatus(step.role, list(step.nodes), str(step.log_file))
        self.exits: asyncio.Queue[JobStep] = asyncio.Queue()
        self.stopped = asyncio.Event()  # SIGTERM: every step ends by SLURM's own signal, none is a fault

    # ------------------------------------------------------------------------------------- the steps

    def _steps(self) -> dict[str, JobStep]:
        launch, plan, py = self.launch, self.plan, shlex.quote(self.python)
        out: dict[str, JobStep] = {}
        for s in plan.instances("servers"):
            values = {"port": s.port, "index": s.index, "local_index": s.local_index, "node": s.node, "host": s.host,
                      "sim_args": shlex.join(sim_args(self.cfg, s.index)), **self._common()}
            out[s.name] = JobStep(s.name, "servers", (s.node,), fill(launch.servers.command or "", values),
                                  self.files.log(s.name), {k: fill(v, values) for k, v in launch.servers.env.items()},
                                  launch.servers.srun, launch.servers.restarts)
        resume = ["--resume"] if (Path(self.cfg.run.output_dir) / STATE_FILE).exists() else []
        orch = [py, "-m", "orchestrator", "run", str(self.config_path), *self._overrides(), *resume]
        out["orchestrator"] = JobStep("orchestrator", "orchestrator", (plan.orchestrator_node,), " ".join(orch),
                                      self.files.log("orchestrator"), srun_flags=launch.orchestrator.srun)
        for w in plan.instances("env_workers"):
            argv = [py, "-m", "orchestrator", "env-worker", "--connect", plan.worker_address, "--id", w.name,
                    "--server-key", str(self.keys.server_public), "--client-key", str(self.keys.worker_secret),
                    *(["--nice", str(launch.env_workers.nice)] if launch.env_workers.nice else [])]
            out[w.name] = JobStep(w.name, "env_workers", (w.node,), " ".join(argv), self.files.log(w.name),
                                  srun_flags=launch.env_workers.srun, restarts_left=launch.env_workers.restarts)
        values = {"address": plan.trainer_address, "server_key": self.keys.server_public,
                  "client_key": self.keys.trainer_secret, "master_addr": plan.master_addr,
                  "master_port": launch.trainer.master_port, "nodes": len(plan.nodes["trainer"]), **self._common()}
        out["trainer"] = JobStep("trainer", "trainer", plan.nodes["trainer"],
                                 fill(launch.trainer.command or "", values), self.files.log("trainer"),
                                 {k: fill(v, values) for k, v in launch.trainer.env.items()}, launch.trainer.srun)
        return out

    def _common(self) -> dict[str, object]:
        return {"job_dir": self.files.root, "orchestrator": f"{shlex.quote(self.python)} -m orchestrator",
                "model": self.cfg.model.name}

    def _overrides(self) -> list[str]:
        """``--set`` flags: the user's, then what the allocation decides (addresses, remote workers, keys)."""
        plan, sets = self.plan, list(self.overrides)
        if plan.nodes["servers"]:
            sets.append("inference.servers=[" + ", ".join(f'"{u}"' for u in plan.server_urls) + "]")
        workers = plan.instances("env_workers")
        if workers:
            sets.append(f"scheduler.remote_workers={len(workers)}")
            sets += [f"env[{i}].workers=0" for i in range(len(self.cfg.env))]
        sets += [f'scheduler.worker_address="{plan.worker_address}"', f'transport.address="{plan.trainer_address}"',
                 f'security.server_key="{self.keys.server_secret}"',
                 f'security.authorized_keys="{self.keys.authorized}"']
        return [f"--set {shlex.quote(s)}" for s in sets]

    # --------------------------------------------------------------------------------- the job's life

    async def run(self) -> int:
        """Run the job's steps until it ends; the exit status (0: the orchestrator finished)."""
        where = "; ".join(f"{r}: {', '.join(v) if isinstance(v, list) else v}" for r, v in self.plan.describe().items())
        log.info("job %s (attempt %d) in %s: %s", self.job_id, self.status.attempt, self.files.root, where)
        stopped = self.stopped
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stopped.set)
        loop.add_signal_handler(signal.SIGINT, stopped.set)
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._on_signal(stopped))
                    tg.create_task(self._watch_exits(tg))
                    await self._start_in_order(tg)
                    self._set("running", "every role started")
            except* JobEnded as group:
                ended = group.exceptions[0]
                assert isinstance(ended, JobEnded)
            except* Exception as group:  # the runner itself failed: say so where `launch status` looks
                self._set("failed", f"the job's runner failed: {group.exceptions[0]!r}")
                raise
            else:  # pragma: no cover - the watch ends only with JobEnded
                raise AssertionError("the job's watch ended without an outcome")
        finally:
            # stopped by SIGTERM: SLURM has signalled every step already (a second SIGTERM would force the
            # orchestrator's exit, status 124); else each step still running is told to stop
            await self._stop_all(signal_steps=not stopped.is_set())
        self._set(ended.state, ended.why)
        (log.info if ended.code == 0 else log.error)("job %s %s: %s", self.job_id, ended.state, ended.why)
        return ended.code

    async def _on_signal(self, stopped: asyncio.Event) -> None:
        await stopped.wait()
        raise JobEnded("stopped", "SIGTERM (scancel, the time limit or a requeue): every step was told to stop; "
                                  "submit the job again to resume", 143)

    async def _start_in_order(self, tg: asyncio.TaskGroup) -> None:
        servers = [s for s in self.steps.values() if s.role == "servers"]
        for step in servers:
            await self._start(tg, step)
        await self._wait_healthy(servers)
        await self._start(tg, self.steps["orchestrator"])
        await self._wait_listening()
        for step in self.steps.values():
            if step.role in ("env_workers", "trainer"):
                await self._start(tg, step)

    async def _start(self, tg: asyncio.TaskGroup, step: JobStep) -> None:
        await step.start(self.job_id)
        st = self.status.steps[step.name]
        st.state, st.step, st.exit = "running", None, None
        tg.create_task(self._exited(step))
        tg.create_task(self._record_step_id(step))
        self.status.write(self.files.status)

    async def _record_step_id(self, step: JobStep) -> None:
        """SLURM's id of ``step`` (``scancel JOB.STEP`` ends it) into the status, once srun has registered it."""
        starts = step.starts
        for _ in range(60):
            await asyncio.sleep(POLL_S / 2)
            if not step.running or step.starts != starts:
                return
            with contextlib.suppress(slurm.SlurmError):
                found = (await slurm.steps(self.job_id)).get(step.name)
                if found is not None:
                    self.status.steps[step.name].step = found
                    self.status.write(self.files.status)
                    return

    async def _exited(self, step: JobStep) -> None:
        await step.wait()
        await self.exits.put(step)

    async def _watch_exits(self, tg: asyncio.TaskGroup) -> None:
        """Consumes step exits; restarts what may be restarted, ends the job on what cannot go on (JobEnded)."""
        while True:
            step = await self.exits.get()
            assert step.proc is not None
            assert step.proc.returncode is not None
            code, st = step.proc.returncode, self.status.steps[step.name]
            if self.stopped.is_set() or (code != 0 and await self._slurm_is_ending()):
                continue  # the stop records it
            st.exit, st.state = code, "exited"
            how = f"{step.name} (on {', '.join(step.nodes)}) {describe_exit(code)}"
            if step.role == "orchestrator":
                if code == 0:
                    raise JobEnded("completed", "the orchestrator finished every step", 0)
                raise JobEnded("failed", f"{how}; its log {step.log_file}: {last_lines(step.log_file)}", 1)
            if step.role == "trainer":
                if code == 0:
                    log.info("%s; the orchestrator goes on until its last step is acknowledged", how)
                    continue
                raise JobEnded("failed", f"{how}; its log {step.log_file}: {last_lines(step.log_file)}", 1)
            if step.restarts_left > 0:
                step.restarts_left -= 1
                st.restarts += 1
                st.state = "restarting"
                log.warning("%s; starting it again (%d restart(s) left); its log: %s", how, step.restarts_left,
                            step.log_file)
                await self._start(tg, step)
            else:
                alive = [s.name for s in self.steps.values() if s.role == step.role and s.running]
                what = "the pool takes it out of rotation" if step.role == "servers" else "its rollouts fail"
                if self.status.state != "running":  # the orchestrator's preflight needs every server
                    raise JobEnded("failed", f"{how} before the job was running; its log {step.log_file}: "
                                             f"{last_lines(step.log_file)}", 1)
                if not alive:
                    raise JobEnded("failed", f"{how}, and no {step.role.replace('_', ' ')[:-1]} step is left", 1)
                log.warning("%s; %s and the job goes on with %s; its log: %s", how, what, ", ".join(alive) or "none",
                            step.log_file)
            self.status.write(self.files.status)

    async def _slurm_is_ending(self) -> bool:
        """Whether SLURM is ending the job (scancel, the time limit, a requeue) though this runner has not heard
        its SIGTERM yet: slurmd signals the steps one by one, node by node, so a step that exits at once on
        SIGTERM (the trainer) can end before the batch step is signalled. Its exit is then part of the stop, not
        a fault: the stop is set as the SIGTERM would set it. slurmctld marks the job before it signals a step."""
        try:
            state = await self.job_state(self.job_id)
        except slurm.SlurmError as e:
            log.warning("cannot ask SLURM whether job %s is ending (%s): the step's exit is judged alone",
                        self.job_id, e)
            return self.stopped.is_set()
        if state is not None and state != "RUNNING":
            log.info("job %s is %s in SLURM: a step's exit is part of the stop", self.job_id, state)
            self.stopped.set()
        return self.stopped.is_set()

    async def _wait_healthy(self, servers: list[JobStep]) -> None:
        """Until every server answers ``health_path`` with 200 (JobEnded past ``ready_timeout_s``)."""
        urls = {s.name: u.removesuffix("/v1") + self.launch.servers.health_path
                for s, u in zip(servers, self.plan.server_urls, strict=True)}
        waiting, last = dict(urls), dict.fromkeys(urls, "not asked yet")
        t0 = warned = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while waiting:
                for name, url in list(waiting.items()):
                    try:
                        async with session.get(url) as resp:
                            if resp.status == 200:
                                del waiting[name]
                                self.status.steps[name].state = "ready"
                                log.info("%s is healthy (%s) after %.0f s", name, url, time.monotonic() - t0)
                                continue
                            last[name] = f"HTTP {resp.status}"
                    except (aiohttp.ClientError, OSError, TimeoutError) as e:
                        last[name] = f"{type(e).__name__}: {e}"
                if waiting:
                    warned = self._still_waiting(t0, warned, ", ".join(f"{n} ({waiting[n]}: {last[n]})"
                                                                        for n in waiting))
                    await asyncio.sleep(POLL_S)
        self.status.write(self.files.status)

    async def _wait_listening(self) -> None:
        """Until the orchestrator accepts TCP connections on its worker port (it binds once preflight passed)."""
        host, port = self.plan.orchestrator_host, self.launch.orchestrator.worker_port
        t0 = warned = time.monotonic()
        while True:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5.0)
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                break
            except (OSError, TimeoutError) as e:
                warned = self._still_waiting(t0, warned, f"the orchestrator to listen at {host}:{port} ({e})")
            await asyncio.sleep(POLL_S / 2)
        self.status.steps["orchestrator"].state = "ready"
        log.info("the orchestrator listens at %s:%d after %.0f s", host, port, time.monotonic() - t0)

    def _still_waiting(self, t0: float, warned: float, what: str) -> float:
        now = time.monotonic()
        if now - t0 > self.launch.ready_timeout_s:
            raise JobEnded("failed", f"not ready within launch.ready_timeout_s = {self.launch.ready_timeout_s:.0f} "
                                     f"s: {what}", 1)
        if now - warned >= WARN_S:
            log.warning("waiting %.0f s for %s", now - t0, what)
            return now
        return warned

    async def _stop_all(self, *, signal_steps: bool) -> None:
        """Stop every step still running: SIGTERM through SLURM (``signal_steps``; else wait for the SIGTERM
        SLURM sent), SIGKILL after ``stop_timeout_s``. Every step that ended in the stop is recorded ``stopped``
        with its status (one that had ended on its own stays ``exited``)."""
        running = [s for s in self.steps.values() if s.running]
        if running:
            try:
                ids = await slurm.steps(self.job_id)
            except slurm.SlurmError as e:
                log.warning("cannot list the job's steps (%s); stopping srun itself", e)
                ids = {}
            for name, step_id in ids.items():
                if name in self.status.steps:
                    self.status.steps[name].step = step_id
            await asyncio.gather(*(s.stop(ids, self.launch.stop_timeout_s, signal_first=signal_steps)
                                   for s in running))
        for step in self.steps.values():
            st = self.status.steps[step.name]
            if step.proc is not None and step.proc.returncode is not None and st.state != "exited":
                st.state, st.exit = "stopped", step.proc.returncode

    def _set(self, state: str, why: str) -> None:
        self.status.state, self.status.why = state, why
        self.status.write(self.files.status)


def sim_args(cfg: JobConfig, index: int) -> list[str]:
    """``{sim_args}``: ``orchestrator sim-inference`` flags for the job's ``[sim]`` table, seeded per server."""
    inf = cfg.inference
    return [*cfg.sim.arguments(cfg.model.name, inf.backend, inf.transfer_backend), "--seed", str(cfg.sim.seed + index)]


async def run_allocation(cfg: JobConfig, config_path: Path, overrides: Sequence[str], job_dir: Path) -> int:
    """The ``orchestrator launch allocation`` command: this attempt of the job, from SLURM's environment."""
    launch: LaunchConfig | None = cfg.launch
    assert launch is not None
    job_id = os.environ.get("SLURM_JOB_ID")
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not job_id or not nodelist:
        raise slurm.SlurmError("not inside a SLURM allocation (no SLURM_JOB_ID / SLURM_JOB_NODELIST): submit the "
                               "script with sbatch, or use `orchestrator launch slurm`")
    files = JobFiles(job_dir)
    files.logs.mkdir(parents=True, exist_ok=True)
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    try:
        nodes = await slurm.hostnames(nodelist)
        plan = Plan.make(launch, nodes, await slurm.node_addresses(nodes))
    except (PlanError, slurm.SlurmError) as e:  # nothing started: say why where `launch status` looks
        JobStatus(job_id, attempt, str(files.root), state="failed", why=str(e)).write(files.status)
        raise
    python = launch.python or sys.executable
    return await Allocation(cfg, config_path, overrides, files, plan, job_id, attempt, python).run()
