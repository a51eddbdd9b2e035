"""What a job runs on, opened before any loop starts: the inference pool (checked by preflight) and the env
workers' hub, and the wait until the workers are ready (the orchestrator and ``orchestrator eval`` share them);
the batch sender ``[transport] kind`` names (ZMQ and shm, files in a shared directory, prime-rl's trainer)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orchestrator.assets import tokenizer_dir
from orchestrator.config import JobConfig
from orchestrator.contracts.protocol import EnvSpec, Setup, TeacherSpec
from orchestrator.contracts.rows import RolloutRow
from orchestrator.contracts.wire import LogprobsMode
from orchestrator.dataplane.direct import DirectPlane
from orchestrator.dataplane.plane import DataPlane, OffLoop, ThroughPlane, own_keys, worker_setup
from orchestrator.delivery.config import (
    FilesystemTransport,
    PrimeRLTransport,
    ShmTransport,
    TransportConfig,
    ZmqTransport,
)
from orchestrator.delivery.filesystem import FileBatchSender
from orchestrator.delivery.primerl import PrimeRLSender
from orchestrator.delivery.sender import Sender
from orchestrator.delivery.zmq_link import BatchSender
from orchestrator.errors import InferenceError
from orchestrator.hub.hub import WorkerHub
from orchestrator.inference.discovery import Resolver
from orchestrator.inference.logprobs import LogprobsCheck
from orchestrator.inference.pool import InferencePool
from orchestrator.inference.preflight import PreflightError, encode_probe, preflight, preflight_teacher
from orchestrator.inference.server import InferenceServer
from orchestrator.rollouts.links import WorkerLink
from orchestrator.rollouts.scheduler import EVAL_PREFIX, Scheduler
from orchestrator.security import SecurityConfig
from orchestrator.sinks import Sinks
from orchestrator.steps.boundary import StepBuilder
from orchestrator.workers.process import Worker

log = logging.getLogger(__name__)

WORKER_READY_TIMEOUT_S = 300.0


async def open_engines(cfg: JobConfig, stack: contextlib.AsyncExitStack, out: Path, *, evaluation_only: bool = False,
                       resolver: Resolver | None = None) -> tuple[InferencePool, WorkerHub, LogprobsMode | None]:
    """The inference pool (checked by preflight unless turned off) and the env-worker hub, entered on
    ``stack``; the hub's workers load the training environments and the ``[[eval.env]]`` ones (under
    EVAL_PREFIX), or only the latter with ``evaluation_only``. Also the logprobs mode batches carry: the one
    preflight settled, or without preflight the one ``inference.logprobs_mode`` states (None for "auto": not
    known, and batches say nothing). ``resolver``: the DNS of ``inference.discover`` (default: the system's); a
    server it finds while the job runs is admitted by the same preflight, holding the settled logprobs mode."""
    tokenizer = Path(cfg.model.tokenizer) if cfg.model.tokenizer else tokenizer_dir()
    train = () if evaluation_only else cfg.env
    evals = cfg.eval.env if cfg.eval is not None else ()
    workers = sum(e.workers for e in (evals if evaluation_only else cfg.env))
    teacher = None if evaluation_only else teacher_spec(cfg, workers + cfg.scheduler.remote_workers)
    setup = Setup([*(EnvSpec(e.label, e.taskset, e.args, e.verifiers, e.select, f"env[{i}]",
                             distill=e.distills and teacher is not None) for i, e in enumerate(train)),
                   *(EnvSpec(EVAL_PREFIX + e.label, e.taskset, e.args, e.verifiers, e.select, f"eval.env[{i}]")
                     for i, e in enumerate(evals))],
                  cfg.model.name, str(tokenizer), cfg.inference.request_timeout_s, cfg.inference.api_key_env,
                  session=uuid.uuid4().hex, teacher=teacher)  # session: this process
    setup = worker_setup(setup, cfg.transport, cfg.security, cfg.pipeline.filters, tokenizer, out)
    worker_address = cfg.scheduler.worker_address or f"ipc://{out}/workers.sock"
    env_vars = {"HOME": os.environ.get("HOME", str(out))}
    pool = await stack.enter_async_context(InferencePool.open(cfg.inference, cfg.model.name, resolver=resolver))
    stated = cfg.inference.logprobs_mode
    logprobs_mode: LogprobsMode | None = None if stated == "auto" else stated
    if cfg.inference.preflight:  # before any worker starts: a server that cannot serve the job is named now
        check = LogprobsCheck.of(cfg.inference, [e.sampling.temperature for e in train],
                                 prime_rl_trainer=cfg.transport.kind == "prime-rl")
        checked = await preflight([s.api for s in pool.servers], backend=cfg.inference.backend,
                                  model=cfg.model.name, tokenizer=tokenizer, resume=True,
                                  transfer=cfg.inference.transfer_backend, logprobs=check)
        log.info("preflight: %d inference server(s) ready (max_model_len %s)", len(checked.servers),
                 sorted({r.max_model_len or 0 for r in checked.servers}))
        logprobs_mode = checked.logprobs_mode
        pool.admit = functools.partial(admit_server, cfg, tokenizer, dataclasses.replace(check, stated=logprobs_mode))
        if teacher is not None and cfg.teacher is not None:
            lengths = [r.max_model_len for r in checked.servers if r.max_model_len]
            await preflight_teacher(cfg.teacher, encoded=encode_probe(tokenizer),
                                    policy_max_len=max(lengths) if lengths else None)
    hub = await stack.enter_async_context(WorkerHub.open(
        worker_address, setup, workers, cfg.scheduler.remote_workers, env_vars, cfg.scheduler.worker_nice,
        cfg.security.server_keys(worker_address), cfg.scheduler.worker_silence_s, cfg.transport.span_address))
    return pool, hub, logprobs_mode


async def admit_server(cfg: JobConfig, tokenizer: Path, check: LogprobsCheck, server: InferenceServer) -> None:
    """The job's preflight of one server that joins while it runs (``inference.discover``), holding it to the
    logprobs mode the job settled (``check.stated``); InferenceError naming every problem."""
    try:
        await preflight([server], backend=cfg.inference.backend, model=cfg.model.name, tokenizer=tokenizer,
                        resume=True, logprobs=check)
    except PreflightError as e:
        raise InferenceError("preflight: " + "; ".join(e.problems)) from None


def teacher_spec(cfg: JobConfig, workers: int) -> TeacherSpec | None:
    """What env workers are told of ``[teacher]`` (each gets ``workers``' even share of its in-flight bound); None
    when no training env distils (or there is no teacher)."""
    t = cfg.teacher
    if t is None or not any(e.distills for e in cfg.env):
        return None
    return TeacherSpec(servers=list(t.servers), model=t.model, max_inflight=t.worker_share(workers),
                       timeout_s=t.request_timeout_s, retries=t.retries, retry_backoff_s=t.retry_backoff_s,
                       api_key_env=t.api_key_env)


async def start_workers(tg: asyncio.TaskGroup, hub: WorkerHub, background: list[asyncio.Task[Any]],
                        warn_s: float) -> None:
    """Wait until the hub's env workers are ready, naming those it waits for every ``warn_s`` (with none local
    and none remote, one runs on this loop, for debugging: its task joins ``background``)."""
    local, remote = hub.local, hub.remote
    if local + remote == 0:  # debugging mode: environments run on this loop
        log.warning("workers = 0: environments run inside the orchestrator process (debugging only)")
        background.append(tg.create_task(_in_process_worker(hub.address)))
    elif remote:
        log.info("waiting for %d remote env worker(s): orchestrator env-worker --connect %s", remote, hub.address)
    await hub.wait_ready(max(local + remote, 1), WORKER_READY_TIMEOUT_S, warn_s)


async def _in_process_worker(address: str) -> None:
    code = await Worker(address, "in-process").run()
    if code:
        raise RuntimeError(f"in-process env worker exited with {code}")


def open_sender(cfg: JobConfig, address: str, resume: bool, acked_before: int = -1
                ) -> contextlib.AbstractAsyncContextManager[Sender[Any]]:
    """The batch sender ``[transport] kind`` names: ZMQ (default; shm: columns through shared memory), files in
    a shared directory, or prime-rl's own trainer. A ZMQ sender on tcp:// with ``[security]`` keys accepts only
    the authorized trainers; prime-rl's link cannot authenticate (config.py refuses a non-loopback address
    unless ``security.allow_unauthenticated_trainer``). ``acked_before``: the step the state says the trainer
    acknowledged (a resumed run; a ZMQ trainer reporting less is behind). Every wait warns every
    ``monitor.stall_warn_s``."""
    t = cfg.transport.chosen
    warn_s = cfg.monitor.stall_warn_s
    if isinstance(t, PrimeRLTransport):
        if cfg.security.allow_unauthenticated_trainer and t.layout == "zmq":
            log.warning("batches go to the prime-rl trainer at %s unauthenticated and unencrypted "
                        "(security.allow_unauthenticated_trainer)", t.address)
        return PrimeRLSender.open(
            t.trainer_dir, data_ranks=t.data_ranks, seq_len=t.seq_len, pad_to_multiple_of=t.pad_to_multiple_of,
            layout=t.layout, address=t.address, window=t.send_hwm, resume=resume,
            temperature={e.label: e.sampling.temperature for e in cfg.env}, warn_s=warn_s)
    if isinstance(t, FilesystemTransport):
        return FileBatchSender.open(t.directory, t.send_hwm, resume=resume, warn_s=warn_s)
    shm_bytes = t.shm_pool_mb << 20 if isinstance(t, ShmTransport) else None  # columns through a same-node pool
    return BatchSender.open(address, t.send_hwm, warn_s, require_report=resume, shm_bytes=shm_bytes,
                            server_keys=cfg.security.server_keys(address),  # tcp:// with keys: CURVE
                            keep=t.keep_acked if isinstance(t, ZmqTransport) else 0,
                            acked_before=acked_before if resume else -1)


def job_scheduler(cfg: JobConfig, pool: InferencePool, hub: WorkerLink, policy: int = 0, **kwargs: Any) -> Scheduler:
    """The scheduler of ``cfg``'s job, given the sections it reads (``kwargs``: the rest of its arguments)."""
    return Scheduler(cfg.scheduler, cfg.env, pool, hub, policy, pipeline=cfg.pipeline, evaluation=cfg.eval,
                     seed=cfg.run.seed, stall_warn_s=cfg.monitor.stall_warn_s, **kwargs)


def open_plane(transport: TransportConfig, security: SecurityConfig, dump_steps: int | Sequence[int],
               builder: StepBuilder, hub: WorkerHub, sender: Sender[Any], sinks: Sinks, off_loop: OffLoop,
               write_rows: Callable[[list[RolloutRow]], None]) -> DataPlane:
    """The plane ``transport.data_plane`` names. ``dump_steps``: ``pipeline.dump_steps`` (a due dump reads the
    step's columns back); ``off_loop(fn, *args)`` runs blocking work in the step thread; ``write_rows`` appends
    rows to rollouts.jsonl (a rebuilt step's)."""
    if transport.data_plane == "through":
        return ThroughPlane()
    assert isinstance(sender, BatchSender)  # config.py allows direct mode only with kind = "zmq"
    return DirectPlane(builder, hub, sender, sinks, off_loop, write_rows, own_keys(security), dump_steps)
