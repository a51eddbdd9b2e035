"""``orchestrator eval CONFIG``: evaluate the inference servers' current model once, with the job's
``[eval]`` section, the same code as online evaluation, and no trainer."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from orchestrator.cli import run_async
from orchestrator.commands.check import add_set_argument
from orchestrator.commands.run import interruptible
from orchestrator.config import load_config
from orchestrator.errors import ConfigError

if TYPE_CHECKING:
    from orchestrator.config import JobConfig

log = logging.getLogger(__name__)

HELP = "evaluate the servers' current model once with the config's [eval] environments (no trainer)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job config (TOML) with an [eval] section")
    add_set_argument(p)
    p.add_argument("--out", type=Path, default=None,
                   help="where metrics.jsonl and eval_rollouts.jsonl are appended (default: <run.output_dir>/eval)")
    p.add_argument("--step", type=int, default=0, help="the step this evaluation is of, in its rows (default 0)")
    p.add_argument("--policy", type=int, default=0, help="the weight version the servers have, in its rows")
    p.add_argument("--json", action="store_true", help="print the round's row as one JSON object, last")


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # a ConfigError exits 2 before anything starts
    out = (args.out or Path(cfg.run.output_dir) / "eval").resolve()
    rows: list[dict[str, Any]] = []

    async def job() -> None:
        rows.append(await evaluate(cfg, out, step=args.step, policy=args.policy))

    code = run_async(interruptible(job()))
    if code or not rows:
        return code
    print(table(rows[0]))
    print(f"rows: {out / 'metrics.jsonl'}, rollouts: {out / 'eval_rollouts.jsonl'}")
    if args.json:
        print(orjson.dumps(rows[0]).decode())
    return 0


def table(row: dict[str, Any]) -> str:
    """Per env: mean reward, pass@k and pass^k columns, solve none / all, errors."""
    envs = row["envs"]
    keys = ["mean_reward", *sorted((k for m in envs.values() for k in m if k.startswith(("pass@", "pass^"))),
                                   key=lambda k: (k[4], int(k[5:]))), "solve_none", "solve_all"]
    keys = list(dict.fromkeys(keys))
    width = max(len(e) for e in envs) + 2
    lines = ["env".ljust(width) + "".join(k.rjust(12) for k in keys) + "errors".rjust(8)]
    for env, m in envs.items():
        lines.append(env.ljust(width) + "".join(f"{m.get(k, 0.0):12.3f}" for k in keys) + f"{m['errors']:8d}")
    return "\n".join(lines)

async def evaluate(cfg: JobConfig, out: Path, *, step: int = 0, policy: int = 0) -> dict[str, Any]:
    """Run one evaluation round labelled ``step`` and ``policy`` against ``cfg``'s servers; append its row
    to ``out/metrics.jsonl`` and its rollouts to ``out/eval_rollouts.jsonl``; return the row.

    The same code as a training run's online evaluation: the ``[eval]`` section and its environments, env
    workers, the scheduler's evaluation rounds (evaluation only: no training group opens), the same rows."""
    from orchestrator.engines import job_scheduler, open_engines, start_workers
    from orchestrator.steps.outputs import StepOutputs, eval_rollout_rows, format_eval_line

    if cfg.eval is None or not cfg.eval.env:
        raise ConfigError(["eval: `orchestrator eval` needs an [eval] section with [[eval.env]] tables"])
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, at_start=True, interval=1))
    outputs = await asyncio.to_thread(StepOutputs, out)
    async with contextlib.AsyncExitStack() as stack:
        pool, hub, _ = await open_engines(cfg, stack, out, evaluation_only=True)
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(pool.run()), tg.create_task(hub.run())]
            await start_workers(tg, hub, background, cfg.monitor.stall_warn_s)
            sched = job_scheduler(cfg, pool, hub, policy, train=False)
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
