"""The orchestrator's side of a run's steps and evaluation rounds: what ``Orchestrator.run`` drives.

``OrchestratorSteps`` is the step pipeline's host (``StepHost``, steps/phases.py): blocking phases in the step
thread, the data plane's build, the sender's send, the run's state and metrics after it, its outputs (with the
rows a resumed run keeps). ``evaluations`` writes each finished evaluation round; ``last_evaluation`` lets the
rounds a run owes finish after its last step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import orjson

from orchestrator.config import to_toml
from orchestrator.lagmon import LagStats
from orchestrator.rollouts.groups import Group
from orchestrator.rollouts.scheduler import Scheduler
from orchestrator.state import save_state
from orchestrator.steps.boundary import StepResult
from orchestrator.steps.dump import dump_due, dump_path
from orchestrator.steps.outputs import eval_rollout_rows, format_eval_line
from orchestrator.steps.phases import Built, StepPipeline
from orchestrator.steps.rows import RolloutRow

if TYPE_CHECKING:
    from orchestrator.app import Orchestrator

log = logging.getLogger(__name__)
T = TypeVar("T")


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
