"""One evaluation round of the servers' current model, without a trainer (``orchestrator eval``).

The same code as a training run's online evaluation: the job's ``[eval]`` section and ``[[eval.env]]``
environments, env workers, the scheduler's evaluation rounds (evaluation only: no training group opens)
and the same metrics and rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any

from orchestrator.app import open_engines, start_workers
from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError
from orchestrator.rollouts.scheduler import Scheduler
from orchestrator.steps.outputs import StepOutputs, eval_rollout_rows, format_eval_line

log = logging.getLogger(__name__)


async def evaluate(cfg: JobConfig, out: Path, *, step: int = 0, policy: int = 0) -> dict[str, Any]:
    """Run one evaluation round labelled ``step`` and ``policy`` against ``cfg``'s servers; append its row
    to ``out/metrics.jsonl`` and its rollouts to ``out/eval_rollouts.jsonl``; return the row."""
    if cfg.eval is None or not cfg.eval.env:
        raise ConfigError(["eval: `orchestrator eval` needs an [eval] section with [[eval.env]] tables"])
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, at_start=True, interval=1))
    outputs = await asyncio.to_thread(StepOutputs, out)
    async with contextlib.AsyncExitStack() as stack:
        pool, hub, _ = await open_engines(cfg, stack, out, evaluation_only=True)
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(pool.run()), tg.create_task(hub.run())]
            await start_workers(tg, hub, background, cfg.monitor.stall_warn_s)
            sched = Scheduler(cfg, pool, hub, policy, train=False)
            background.append(tg.create_task(sched.run()))
            sched.start_evaluation(step)
            row, groups = await sched.eval_rows.get()
            row["at_step"] = step
            await asyncio.to_thread(outputs.write_eval_rollouts, eval_rollout_rows(row, groups))
            await asyncio.to_thread(outputs.metrics.log, row, step=step, prefix="eval")
            log.info("%s", format_eval_line(row))
            for task in background:
                task.cancel()
    return row
