"""The orchestrator: config, inference pool, env workers, scheduler, step pipeline and transport, wired.

``async with Orchestrator.open(cfg) as orch: await orch.run()``. ``open`` binds sockets, starts local env
workers and opens the pool before any loop starts; ``run`` owns every background loop in one TaskGroup
(lag monitor, pool prober, worker hub, scheduler, weight sync) and runs the steps. Leaving the block
stops workers (by pid) and closes sockets. Heavy step work (advantages, filters, batch assembly, JSONL,
state) runs in a worker thread; the loop only awaits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec
import orjson

from orchestrator.assets import tokenizer_dir, vocab_size
from orchestrator.columns.manifest import StepManifest
from orchestrator.columns.readback import Readback
from orchestrator.columns.unacked import UnackedSteps
from orchestrator.config import JobConfig, to_toml
from orchestrator.delivery.config import FilesystemTransport, PrimeRLTransport, ShmTransport, ZmqTransport
from orchestrator.delivery.filesystem import FileBatchSender
from orchestrator.delivery.primerl import PrimeRLSender
from orchestrator.delivery.sender import Sender
from orchestrator.delivery.wire import Batch, LogprobsMode
from orchestrator.delivery.zmq_link import BatchSender
from orchestrator.errors import UnloadableCheckpoint, WireError
from orchestrator.inference.logprobs import LogprobsCheck
from orchestrator.inference.pool import InferencePool
from orchestrator.inference.preflight import preflight
from orchestrator.lagmon import LagMonitor, LagStats
from orchestrator.outdir import OutputDir
from orchestrator.rollouts.groups import Group
from orchestrator.rollouts.scheduler import EVAL_PREFIX, Scheduler
from orchestrator.scoring.filters import TOKEN_FILTERS, token_filter_args
from orchestrator.security import KeyPair, load_authorized_keys, load_key_pair
from orchestrator.sinks import Sinks, open_sinks
from orchestrator.sinks.samples import SampleTable
from orchestrator.state import STATE_FILE, OrchestratorState, StateError, save_state
from orchestrator.steps.boundary import StepBuilder, StepResult
from orchestrator.steps.dump import dump_due, dump_path
from orchestrator.steps.outputs import (
    StepOutputs,
    eval_rollout_rows,
    format_eval_line,
    format_step_line,
)
from orchestrator.steps.phases import Built, StepPipeline
from orchestrator.steps.rows import RolloutRow
from orchestrator.weights.checkpoints import Checkpoint
from orchestrator.weights.sync_loop import WeightSyncLoop
from orchestrator.workers.hub import WorkerHub
from orchestrator.workers.process import Worker
from orchestrator.workers.protocol import EnvSpec, PoolInfo, Setup, TokenFilter, TokenFilterName

log = logging.getLogger(__name__)
T = TypeVar("T")

WORKER_READY_TIMEOUT_S = 300.0
FLUSH_TIMEOUT_S = 10.0


@dataclass
class RunSummary:
    steps: int = 0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)


class Orchestrator:
    def __init__(self, cfg: JobConfig, pool: InferencePool, hub: WorkerHub, sender: Sender[Any],
                 state: OrchestratorState, sinks: Sinks, logprobs_mode: LogprobsMode | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.hub = hub
        self.sender = sender
        self.state = state
        self.out = Path(cfg.run.output_dir)
        m = cfg.monitor
        self.lag = LagMonitor(m.lag_interval_s, m.lag_window, m.lag_warn_ms, m.lag_error_ms)
        self.outputs = StepOutputs(self.out)
        self.sinks = sinks  # step metrics (and, later, eval metrics under a prefix) go through these
        tokenizer = Path(cfg.model.tokenizer) if cfg.model.tokenizer else tokenizer_dir()
        self.samples = SampleTable(tokenizer)
        vocab = vocab_size(tokenizer)
        if vocab is None:
            log.warning("cannot read the vocabulary size of %s; the gibberish filter assumes 2^17 tokens", tokenizer)
        self.builder = StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, vocab_size=vocab or 2**17,
                                   logprobs_mode=logprobs_mode)
        self.summary = RunSummary()
        # the step's blocking work (advantages, batch, dumps, JSONL, state) runs here, one job at a time; owned:
        # open() waits for it before its own state save, also when a step was cancelled mid-way
        self.step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchestrator-step")
        self.on_step: Callable[[dict[str, Any]], None] = lambda _m: None
        self.on_eval: Callable[[dict[str, Any]], None] = lambda _row: None
        self.held: dict[int, tuple[list[bytes], list[bytes]]] = {}  # rows of steps before a resume (outdir.py)
        self.direct = cfg.transport.data_plane == "direct"
        # direct: the steps sent and not yet acknowledged (bounded by send_hwm), released on acknowledgement,
        # rebuilt when the trainer reports one lost
        self.unacked: UnackedSteps | None = None
        if self.direct:  # config.py allows direct mode only with kind = "zmq"
            assert isinstance(sender, BatchSender)
            assert sender.pool is None
            self.unacked = UnackedSteps(self.builder, hub, sender, self._off_loop, self.outputs.write_rows)
            sender.on_ack = self.unacked.acked
        # direct: reads the columns a due step dump or samples table needs (with our key pair for CURVE servers)
        self.readback = Readback(own_keys(cfg)) if self.direct else None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, cfg: JobConfig, *, resume: bool = False, force: bool = False) -> AsyncIterator[Orchestrator]:
        """``force``: resume even with a config that changes what is sampled (outdir.py)."""
        outdir = await asyncio.to_thread(OutputDir.open, cfg, resume=resume, force=force)
        out, state = outdir.path, outdir.state
        batch_address = cfg.transport.address or f"ipc://{out}/trainer.sock"
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(outdir.close)  # last out: the directory stays locked until everything else is done
            sinks = await asyncio.to_thread(open_sinks, cfg.monitor, out, run_name=cfg.run.name,  # W&B starts here
                                            job=asdict(cfg), resume=resume)
            stack.push_async_callback(asyncio.to_thread, sinks.close)
            pool, hub, logprobs_mode = await open_engines(cfg, stack, out)
            sender = await stack.enter_async_context(open_sender(cfg, batch_address, resume, state.acked_step))
            log.info("env workers connect to %s; trainer reads batches from %s", hub.address, sender.address)
            orch = cls(cfg, pool, hub, sender, state, sinks, logprobs_mode)
            orch.held = outdir.held
            try:
                yield orch
            finally:
                # a step cancelled at shutdown may still have work in the step thread (its writes, its state
                # save): it finishes before the state is saved here, so no two saves ever overlap
                await asyncio.to_thread(orch.step_thread.shutdown)
                # on shutdown too: acknowledgements that came after the last step's save count
                if sender.acked > state.acked_step:
                    state.acked_step = sender.acked
                    save_state(out, state)  # small and atomic; blocking, but the loop is ending anyway

    async def run(self) -> RunSummary:
        """Run steps ``state.acked_step + 1`` .. ``max_steps - 1``; returns per-step metrics.

        After a crash, steps past the last one the trainer acknowledged are generated again (their rollouts
        died with the process); the sender skips any of them the trainer turns out to have, so the trainer
        sees every step once, in order. At the end it waits up to FLUSH_TIMEOUT_S for the trainer to
        acknowledge the last steps and names any it did not."""
        switch = sys.getswitchinterval()
        sys.setswitchinterval(self.cfg.run.gil_switch_ms / 1e3)  # the loop's worst wait for the GIL; restored after
        try:
            return await self._run()
        finally:
            sys.setswitchinterval(switch)

    async def _run(self) -> RunSummary:
        cfg = self.cfg
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(self.lag.run()), tg.create_task(self.pool.run()),
                          tg.create_task(self.hub.run())]
            await start_workers(tg, self.hub, background, cfg.monitor.stall_warn_s)
            refused = await self._reload_policy()
            try:
                sched = Scheduler(cfg, self.pool, self.hub, self.state.policy_step, state=self.state.scheduler or None,
                                  checkpoints=self.sender, first_step=self.state.acked_step + 1)
            except (KeyError, TypeError, ValueError) as e:  # a hand-edited or foreign state file
                raise StateError(f"{self.out / STATE_FILE}: the scheduler's saved state is unusable ({e!r}); fix the "
                                 "file or start fresh (without --resume)") from None
            syncs = WeightSyncLoop(self.pool, sched, self.state, cfg.inference)
            if refused is not None:
                syncs.refuse(*refused)
            t = cfg.transport
            marker = Path(t.marker_dir) if t.checkpoint_source == "marker" and t.marker_dir else None
            background += [tg.create_task(sched.run()), tg.create_task(syncs.run(self.sender.announcements(marker))),
                           tg.create_task(self._evaluations(sched))]
            if self.unacked is not None:
                background += [tg.create_task(self._announce_pools()), tg.create_task(self.unacked.run(sched))]
            # Start-up objects (modules, config, sockets) stay out of every later collection. No gc.collect()
            # first: it held the loop for ~30 ms in bench_scheduler and found no garbage to free.
            gc.freeze()
            self.lag.reset()
            steps = OrchestratorSteps(self, sched)
            for step in range(self.state.acked_step + 1, cfg.run.max_steps):
                await self._step(step, steps)
            await self._last_evaluation(sched, cfg.run.max_steps - 1)
            await self._flush()
            for task in background:
                task.cancel()
        return self.summary

    async def _off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.step_thread, functools.partial(fn, *args,
                                                                                                   **kwargs))

    async def _flush(self) -> None:
        try:
            async with asyncio.timeout(FLUSH_TIMEOUT_S):
                await self.sender.wait_acked()
        except TimeoutError:
            log.warning("the trainer did not acknowledge steps %s within %.0f s; a --resume run sends them again",
                        sorted(self.sender.unacked), FLUSH_TIMEOUT_S)
        self.state.acked_step = self.sender.acked
        await self._off_loop(save_state, self.out, self.state)

    async def _announce_pools(self) -> None:
        """Consumes the pools env workers announce (direct mode); produces announcements to the trainer, so it
        maps each pool before a step names it. Wakes on each worker's ``ready``."""
        assert isinstance(self.sender, BatchSender)
        while True:
            worker, pool = await self.hub.pools.news.get()
            self.sender.announce_pool(worker, msgspec.structs.asdict(pool))

    async def _reload_policy(self) -> tuple[Checkpoint, UnloadableCheckpoint] | None:
        """Resumed: the servers may have restarted since; load the saved policy again. A refused one (its
        directory gone or corrupt) is the weight sync loop's to retry, on the clock of any refusal."""
        if not self.state.policy_step:
            return None
        ckpt = Checkpoint(self.state.policy_step, self.state.policy_path)
        try:
            await self.pool.update_weights(ckpt)
        except UnloadableCheckpoint as e:
            return ckpt, e
        return None

    async def _evaluations(self, sched: Scheduler) -> None:
        """Consumes finished evaluation rounds; produces their rows (metrics.jsonl, eval_rollouts.jsonl), a log
        line and ``on_eval``. Runs until cancelled."""
        while True:
            row, groups = await sched.eval_rows.get()
            row["at_step"] = self.state.next_step
            await self._off_loop(self._write_eval, row, groups)
            log.info("%s", format_eval_line(row))
            self.summary.evals.append(row)
            self.on_eval(row)
            sched.eval_rows.task_done()

    def _write_eval(self, row: dict[str, Any], groups: list[Any]) -> None:
        """Blocking (the step thread): the round's rollouts to eval_rollouts.jsonl, its row to the sinks
        (metrics.jsonl, marked ``"eval": true``; W&B's ``eval/...``)."""
        self.outputs.write_eval_rollouts(eval_rollout_rows(row, groups))
        self.sinks.log_eval(row, step=row["step"])

    async def _last_evaluation(self, sched: Scheduler, last_step: int) -> None:
        """The run's steps are done: the round in progress, and one still due by ``last_step``, finish (each
        group bounded by group_timeout_s) and are written, so no evaluation a run owes is lost."""
        ev = sched.evaluator
        while ev is not None:
            if not ev.idle.is_set():
                log.info("steps done; waiting for the evaluation round in progress")
                await ev.idle.wait()
            await sched.eval_rows.join()
            due = ev.due(last_step)
            if due is None:
                return
            sched.start_evaluation(due)

    async def _step(self, step: int, steps: OrchestratorSteps) -> None:
        """One step: its phases are the step pipeline's (steps/phases.py); its line in the log."""
        metrics = await steps.run(step)
        log.info("%s", format_step_line(metrics))
        self.summary.steps += 1
        self.summary.metrics.append(metrics)
        self.on_step(metrics)

    def _read_back(self, groups: list[Group], manifest: StepManifest, pools: dict[str, PoolInfo], dump: bool
                   ) -> tuple[list[Group], Batch | None]:
        """Blocking (the step thread): direct mode's opt-in column reads (columns/readback.py). For a dump, every
        record's columns and the step's batch; for the samples table only, its few rollouts'."""
        assert self.readback is not None
        if not dump:
            return self.readback.groups(groups, pools, limit=self.sinks.samples), None
        shown = self.readback.groups(groups, pools)
        try:
            return shown, self.readback.batch(manifest)
        except WireError as e:  # a pool gone since the build: the trainer will report the step lost; no dump
            log.warning("step %d: not dumped: its columns cannot be read back: %s", manifest.step, e)
            return shown, None

    def _write_rows(self, step: int, rows: list[RolloutRow], metrics: dict[str, Any]) -> None:
        """A step regenerated after a resume that the trainer already had (not sent) keeps the rows written
        when it was trained; one sent again gets the new rows (outdir.py)."""
        held = self.held.pop(step, None)
        if metrics.get("sent", True):
            self.outputs.write_rows(rows)
            self.sinks.log(metrics, step=step)
        elif held is not None:
            log.info("step %d: the trainer already had it; its rows from before the resume stay", step)
            rollouts, old_metrics = held
            self.outputs.write_lines(rollouts)
            for line in old_metrics:
                self.sinks.log(orjson.loads(line), step=step)
        else:
            self.outputs.write_rows([msgspec.structs.replace(r, regenerated=True) for r in rows])
            self.sinks.log({**metrics, "regenerated": True}, step=step)


class OrchestratorSteps:
    """The orchestrator's side of the step pipeline (``StepHost``, steps/phases.py): blocking phases in the
    step thread, the sender's send, the run's state and metrics after it, its outputs; direct mode's build."""

    def __init__(self, orch: Orchestrator, sched: Scheduler) -> None:
        self.orch, self.sched = orch, sched
        dumps = orch.cfg.pipeline.dump_steps  # each dump carries the job's config
        self.pipeline = StepPipeline(orch.builder, self, config_toml=to_toml(orch.cfg) if dumps else None)
        self._cpu0 = time.process_time()

    async def run(self, step: int) -> dict[str, Any]:
        """Every phase of ``step``; its metrics row."""
        dump = dump_due(self.orch.cfg.pipeline.dump_steps, step)
        return await self.pipeline.run(step, self.take, dump_to=dump_path(self.orch.out, step) if dump else None,
                                       build=self.build)

    async def take(self, step: int) -> tuple[list[Group], list[Group]]:
        """Phase ``wait``: the step's groups, and the dropped groups whose rows it writes."""
        self._cpu0 = time.process_time()
        groups = await self.sched.next_step(step)
        return groups, self.sched.take_dropped()

    async def build(self, step: int, groups: Sequence[Group], dropped: Sequence[Group], phase_s: dict[str, float]
                    ) -> Built:
        """The step pipeline's build, or direct mode's manifest of the pools as of now (a rollout in a pool gone
        since it was taken does not train); the survivors the step leaves out are released."""
        orch = self.orch
        if orch.unacked is None:
            built = await self.pipeline.build(step, groups, dropped, phase_s)
        else:
            pools = orch.unacked.pools()
            result = await orch._off_loop(orch.builder.build_manifest, step, groups, dropped, pools)
            orch.unacked.sent(step, list(groups), result.trained)  # before any acknowledgement
            dump = dump_due(orch.cfg.pipeline.dump_steps, step)
            shown, dumped = list(groups), None  # the groups the samples table and the dump read columns from
            if dump or orch.sinks.samples_due(step):  # read now: no span of the step is released before its ack
                shown, dumped = await orch._off_loop(orch._read_back, list(groups), result.batch, pools, dump)
            built = Built(result, shown, dumped)
        orch.hub.release(built.result.untrained)  # direct mode: filtered rollouts' columns are never read
        return built

    async def phase(self, name: str, fn: Callable[[], T]) -> T:
        return await self.orch._off_loop(fn)

    async def send(self, batch: Any) -> bool:
        return await self.orch.sender.send(batch)  # False: a restarted trainer already had this step

    def sent(self, step: int, result: StepResult[Any], sent: bool) -> dict[str, Any]:
        orch, sched = self.orch, self.sched
        if not sent and orch.unacked is not None:  # the trainer had it: nobody reads these columns
            orch.unacked.skipped(step)
        counts = sched.take_counts()
        orch.state.next_step = step + 1
        orch.state.acked_step = orch.sender.acked
        orch.state.policy_step = sched.policy
        orch.state.scheduler = sched.state()
        extra = {"samples": result.num_samples, "policy": sched.policy, "sent": sent,
                 "orch_cpu_ms_per_rollout": round((time.process_time() - self._cpu0) * 1e3 / max(len(result.rows), 1),
                                                  3),
                 "filters": result.filter_counts, "scheduler": counts, "pool": dict(orch.pool.metrics),
                 "hub": dict(orch.hub.metrics)}
        extra.update(orch.sender.metrics())  # the link's state; kind = shm: live MB and spans of the pool
        return extra

    def lag(self) -> LagStats:
        return self.orch.lag.reset()

    async def samples(self, step: int, rows: list[RolloutRow], shown: Sequence[Any]) -> list[dict[str, Any]]:
        orch = self.orch
        if not orch.sinks.samples_due(step):
            return []
        return await orch._off_loop(orch.samples.rows, rows, shown, orch.sinks.samples)

    def write(self, step: int, rows: list[RolloutRow], metrics: dict[str, Any],
              samples: list[dict[str, Any]]) -> None:
        """Blocking (the step thread): rollouts.jsonl, the metrics sinks (metrics.jsonl, W&B), the samples table
        and the state file."""
        orch = self.orch
        orch._write_rows(step, rows, metrics)
        if samples:
            orch.sinks.log_samples(samples, step=step)
        save_state(orch.out, orch.state)


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


async def open_engines(cfg: JobConfig, stack: contextlib.AsyncExitStack, out: Path, *, evaluation_only: bool = False
                       ) -> tuple[InferencePool, WorkerHub, LogprobsMode | None]:
    """The inference pool (checked by preflight unless turned off) and the env-worker hub, entered on
    ``stack``; the hub's workers load the training environments and the ``[[eval.env]]`` ones (under
    EVAL_PREFIX), or only the latter with ``evaluation_only``. Also the logprobs mode batches carry: the one
    preflight settled, or without preflight the one ``inference.logprobs_mode`` states (None for "auto": not
    known, and batches say nothing)."""
    tokenizer = Path(cfg.model.tokenizer) if cfg.model.tokenizer else tokenizer_dir()
    train = () if evaluation_only else cfg.env
    evals = cfg.eval.env if cfg.eval is not None else ()
    setup = Setup([*(EnvSpec(e.label, e.taskset, e.args, e.verifiers, e.select, f"env[{i}]")
                     for i, e in enumerate(train)),
                   *(EnvSpec(EVAL_PREFIX + e.label, e.taskset, e.args, e.verifiers, e.select, f"eval.env[{i}]")
                     for i, e in enumerate(evals))],
                  cfg.model.name, str(tokenizer), cfg.inference.request_timeout_s, cfg.inference.api_key_env,
                  data_plane=cfg.transport.data_plane, worker_pool_bytes=cfg.transport.worker_pool_mb << 20,
                  pool_dir=str(out / "pools"), session=uuid.uuid4().hex,  # session: this process
                  token_filters=worker_token_filters(cfg, tokenizer), span_clients=span_clients(cfg))
    worker_address = cfg.scheduler.worker_address or f"ipc://{out}/workers.sock"
    env_vars = {"HOME": os.environ.get("HOME", str(out))}
    pool = await stack.enter_async_context(InferencePool.open(cfg.inference, cfg.model.name))
    stated = cfg.inference.logprobs_mode
    logprobs_mode: LogprobsMode | None = None if stated == "auto" else stated
    if cfg.inference.preflight:  # before any worker starts: a server that cannot serve the job is named now
        checked = await preflight([s.api for s in pool.servers], backend=cfg.inference.backend,
                                  model=cfg.model.name, tokenizer=tokenizer, resume=True,
                                  logprobs=LogprobsCheck.of(cfg.inference, train,
                                                            prime_rl_trainer=cfg.transport.kind == "prime-rl"))
        log.info("preflight: %d inference server(s) ready (max_model_len %s)", len(checked.servers),
                 sorted({r.max_model_len or 0 for r in checked.servers}))
        logprobs_mode = checked.logprobs_mode
    workers = sum(e.workers for e in (evals if evaluation_only else cfg.env))
    hub = await stack.enter_async_context(WorkerHub.open(
        worker_address, setup, workers, cfg.scheduler.remote_workers, env_vars, cfg.scheduler.worker_nice,
        cfg.security.server_keys(worker_address), cfg.scheduler.worker_silence_s, cfg.transport.span_address))
    return pool, hub, logprobs_mode


def span_clients(cfg: JobConfig) -> list[str]:
    """Direct mode with ``[security]`` keys: the public keys the env workers' span servers accept (those of
    ``security.authorized_keys``: the job's trainers and workers; and ours, for step dumps and the samples
    table), so those servers are CURVE."""
    sec = cfg.security
    if cfg.transport.data_plane != "direct" or sec.authorized_keys is None:
        return []
    ours = own_keys(cfg)
    return sorted({k.decode() for k in load_authorized_keys(sec.authorized_keys)}
                  | ({ours.public.decode()} if ours else set()))


def own_keys(cfg: JobConfig) -> KeyPair | None:
    """This orchestrator's key pair (a client of span servers for dumps and the samples table), or None without
    ``[security]`` keys."""
    return None if cfg.security.server_key is None else load_key_pair(cfg.security.server_key)


def worker_token_filters(cfg: JobConfig, tokenizer: Path) -> list[TokenFilter]:
    """The token filters env workers run in direct mode (they have the tokens; the orchestrator does not), with
    the arguments the orchestrator would use (gibberish: the model's vocabulary size)."""
    if cfg.transport.data_plane != "direct":
        return []
    vocab = vocab_size(tokenizer) or 2**17  # as the step builder assumes when it cannot read it
    return [TokenFilter(i, cast(TokenFilterName, f.name), token_filter_args(f, vocab))
            for i, f in enumerate(cfg.pipeline.filters) if f.name in TOKEN_FILTERS]


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


def load_metrics(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
