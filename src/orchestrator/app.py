"""The orchestrator: config, inference pool, env workers, scheduler, step pipeline and transport, wired.

``async with Orchestrator.open(cfg) as orch: await orch.run()``. ``open`` binds sockets, starts local env
workers and opens the pool before any loop starts; ``run`` owns every background loop in one TaskGroup
(lag monitor, pool prober, worker hub, scheduler, weight sync, evaluation rows, the data plane) and runs the
steps. Leaving the block stops workers (by pid) and closes sockets. Heavy step work (advantages, filters, batch
assembly, JSONL, state) runs in one step thread; the loop only awaits it.

Where the parts live: engines.py (the inference pool, the env workers and the sender, opened), dataplane/plane.py
(the data plane); ``OrchestratorSteps`` below is the step pipeline's host (``StepHost``, steps/phases.py: blocking
phases in the step thread, the data plane's build, the sender's send, the run's state, metrics and outputs after
it), ``evaluations`` writes each finished evaluation round and ``last_evaluation`` lets the rounds a run owes
finish after its last step. docs/architecture.md draws the whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import orjson

from orchestrator.assets import tokenizer_dir, vocab_size
from orchestrator.config import JobConfig, to_toml
from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.contracts.rows import RolloutRow
from orchestrator.contracts.wire import LogprobsMode
from orchestrator.delivery.sender import Sender
from orchestrator.delivery.zmq_link import BatchSender
from orchestrator.engines import job_scheduler, open_engines, open_plane, open_sender, start_workers
from orchestrator.errors import UnloadableCheckpoint
from orchestrator.hub.hub import WorkerHub
from orchestrator.inference.discovery import Resolver
from orchestrator.inference.pool import InferencePool
from orchestrator.lagmon import LagMonitor, LagStats
from orchestrator.outdir import OutputDir
from orchestrator.rollouts.groups import Group
from orchestrator.rollouts.scheduler import Scheduler
from orchestrator.sinks import Sinks, open_sinks
from orchestrator.sinks.samples import SampleTable
from orchestrator.state import STATE_FILE, OrchestratorState, StateError, save_state
from orchestrator.steps.boundary import StepBuilder, StepResult
from orchestrator.steps.dump import dump_due, dump_path
from orchestrator.steps.outputs import StepOutputs, eval_rollout_rows, format_eval_line, format_step_line
from orchestrator.steps.phases import Built, StepPipeline
from orchestrator.weights.sync_loop import WeightSyncLoop, back_to_disk

log = logging.getLogger(__name__)
T = TypeVar("T")

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
        self.syncs: WeightSyncLoop | None = None  # weight syncs: their reports go into the step's metrics
        self.plane = open_plane(cfg.transport, cfg.security, cfg.pipeline.dump_steps, self.builder, hub, sender, sinks,
                                self.off_loop, self.outputs.write_rows)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, cfg: JobConfig, *, resume: bool = False, force: bool = False,
                   resolver: Resolver | None = None) -> AsyncIterator[Orchestrator]:
        """``force``: resume even with a config that changes what is sampled (outdir.py); ``resolver``: the DNS
        ``inference.discover`` asks (default: the system's)."""
        outdir = await asyncio.to_thread(OutputDir.open, cfg, resume=resume, force=force)
        out, state = outdir.path, outdir.state
        batch_address = cfg.transport.address or f"ipc://{out}/trainer.sock"
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(outdir.close)  # last out: the directory stays locked until everything else is done
            sinks = await asyncio.to_thread(open_sinks, cfg.monitor, out, run_name=cfg.run.name,  # W&B starts here
                                            job=asdict(cfg), resume=resume)
            stack.push_async_callback(asyncio.to_thread, sinks.close)
            pool, hub, logprobs_mode = await open_engines(cfg, stack, out, resolver=resolver)
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
        acknowledge the last steps and names any it did not, then tells the trainer the run has ended."""
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
                sched = job_scheduler(cfg, self.pool, self.hub, self.state.policy_step,
                                      state=self.state.scheduler or None, checkpoints=self.sender,
                                      first_step=self.state.acked_step + 1)
            except (KeyError, TypeError, ValueError) as e:  # a hand-edited or foreign state file
                raise StateError(f"{self.out / STATE_FILE}: the scheduler's saved state is unusable ({e!r}); fix the "
                                 "file or start fresh (without --resume)") from None
            channel = self.sender if isinstance(self.sender, BatchSender) else None  # the trainer link, if ZMQ
            syncs = self.syncs = WeightSyncLoop(self.pool, sched, self.state, cfg.inference, channel=channel)
            if refused is not None:
                syncs.refuse(*refused)
            t = cfg.transport
            marker = Path(t.marker_dir) if t.checkpoint_source == "marker" and t.marker_dir else None
            background += [tg.create_task(sched.run()), tg.create_task(syncs.run(self.sender.announcements(marker))),
                           tg.create_task(evaluations(self, sched))]
            background.append(tg.create_task(self.plane.run(sched)))
            # Start-up objects (modules, config, sockets) stay out of every later collection. No gc.collect()
            # first: it held the loop for ~30 ms in bench_scheduler and found no garbage to free.
            gc.freeze()
            self.lag.reset()
            steps = OrchestratorSteps(self, sched)
            for step in range(self.state.acked_step + 1, cfg.run.max_steps):
                await self._step(step, steps)
            await last_evaluation(sched, cfg.run.max_steps - 1)
            await self._flush()
            for task in background:
                task.cancel()
        self.sender.run_finished()  # a trainer waiting to be asked for its last weights stops waiting
        return self.summary

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
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
        await self.off_loop(save_state, self.out, self.state)

    async def _reload_policy(self) -> tuple[Checkpoint, UnloadableCheckpoint] | None:
        """Resumed: the servers may have restarted since; load the saved policy again. A refused one (its
        directory gone or corrupt) is the weight sync loop's to retry, on the clock of any refusal. With weights
        over the wire the policy's weights are often on no disk: the run goes back to the newest synced
        checkpoint that is (a trainer resumes from its newest checkpoint too). A fresh run labels the servers'
        weights as policy 0, the step every token they sample until the first sync is."""
        back_to_disk(self.state, self.cfg.inference)
        if not self.state.policy_step:
            await self.pool.label()
            return None
        ckpt = Checkpoint(self.state.policy_step, self.state.policy_path)
        try:
            await self.pool.update_weights(ckpt)
        except UnloadableCheckpoint as e:
            return ckpt, e
        return None

    async def _step(self, step: int, steps: OrchestratorSteps) -> None:
        """One step: its phases are the step pipeline's (steps/phases.py); its line in the log."""
        metrics = await steps.run(step)
        log.info("%s", format_step_line(metrics))
        self.summary.steps += 1
        self.summary.metrics.append(metrics)
        self.on_step(metrics)


class OrchestratorSteps:
    """The orchestrator's side of the step pipeline (``StepHost``, steps/phases.py): blocking phases in the
    step thread, the data plane's build, the sender's send, the run's state and metrics after it, its outputs."""

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
        """The data plane's build of the step."""
        return await self.orch.plane.build(self.pipeline, step, groups, dropped, phase_s)

    async def phase(self, name: str, fn: Callable[[], T]) -> T:
        return await self.orch.off_loop(fn)

    async def send(self, batch: Any) -> bool:
        return await self.orch.sender.send(batch)  # False: a restarted trainer already had this step

    def sent(self, step: int, result: StepResult[Any], sent: bool) -> dict[str, Any]:
        orch, sched = self.orch, self.sched
        orch.plane.after_send(step, sent)
        counts = sched.take_counts()
        orch.state.next_step = step + 1
        orch.state.acked_step = orch.sender.acked
        orch.state.policy_step = sched.policy
        orch.state.scheduler = sched.state()
        extra = {"samples": result.num_samples, "policy": sched.policy, "sent": sent,
                 "orch_cpu_ms_per_rollout": round((time.process_time() - self._cpu0) * 1e3 / max(len(result.rows), 1),
                                                  3),
                 "filters": result.filter_counts, "versions": result.versions, "scheduler": counts,
                 "pool": dict(orch.pool.metrics),
                 "hub": dict(orch.hub.metrics)}
        extra.update(orch.sender.metrics())  # the link's state; kind = shm: live MB and spans of the pool
        if orch.syncs is not None and (syncs := orch.syncs.take_reports()):
            extra["weight_syncs"] = syncs  # each sync finished since the last step: its phases' wall times
        return extra

    def lag(self) -> LagStats:
        return self.orch.lag.reset()

    async def samples(self, step: int, rows: list[RolloutRow], shown: Sequence[Any]) -> list[dict[str, Any]]:
        orch = self.orch
        if not orch.sinks.samples_due(step):
            return []
        return await orch.off_loop(orch.samples.rows, rows, shown, orch.sinks.samples)

    def write(self, step: int, rows: list[RolloutRow], metrics: dict[str, Any],
              samples: list[dict[str, Any]]) -> None:
        """Blocking (the step thread): rollouts.jsonl, the metrics sinks (metrics.jsonl, W&B), the samples table
        and the state file."""
        self._write_rows(step, rows, metrics)
        if samples:
            self.orch.sinks.log_samples(samples, step=step)
        save_state(self.orch.out, self.orch.state)

    def _write_rows(self, step: int, rows: list[RolloutRow], metrics: dict[str, Any]) -> None:
        """A step regenerated after a resume that the trainer already had (not sent) keeps the rows written
        when it was trained; one sent again gets the new rows (outdir.py)."""
        outputs, sinks = self.orch.outputs, self.orch.sinks
        held = self.orch.held.pop(step, None)
        if metrics.get("sent", True):
            outputs.write_rows(rows)
            sinks.log(metrics, step=step)
        elif held is not None:
            log.info("step %d: the trainer already had it; its rows from before the resume stay", step)
            rollouts, old_metrics = held
            outputs.write_lines(rollouts)
            for line in old_metrics:
                sinks.log(orjson.loads(line), step=step)
        else:
            outputs.write_rows([msgspec.structs.replace(r, regenerated=True) for r in rows])
            sinks.log({**metrics, "regenerated": True}, step=step)


async def evaluations(orch: Orchestrator, sched: Scheduler) -> None:
    """Consumes finished evaluation rounds; produces their rows (metrics.jsonl, eval_rollouts.jsonl), a log
    line and ``on_eval``. Runs until cancelled."""
    while True:
        row, groups = await sched.eval_rows.get()
        row["at_step"] = orch.state.next_step
        await orch.off_loop(_write_eval, orch, row, groups)
        log.info("%s", format_eval_line(row))
        orch.summary.evals.append(row)
        orch.on_eval(row)
        sched.eval_rows.task_done()


def _write_eval(orch: Orchestrator, row: dict[str, Any], groups: list[Any]) -> None:
    """Blocking (the step thread): the round's rollouts to eval_rollouts.jsonl, its row to the sinks
    (metrics.jsonl, marked ``"eval": true``; W&B's ``eval/...``)."""
    orch.outputs.write_eval_rollouts(eval_rollout_rows(row, groups))
    orch.sinks.log_eval(row, step=row["step"])


async def last_evaluation(sched: Scheduler, last_step: int) -> None:
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
