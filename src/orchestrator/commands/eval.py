"""``orchestrator eval CONFIG``: evaluate the inference servers' current model once, with the job's
``[eval]`` section, the same code as online evaluation, and no trainer."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson

from orchestrator.cli import run_async
from orchestrator.commands.check import add_set_argument
from orchestrator.commands.run import interruptible
from orchestrator.config import load_config

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
        from orchestrator.eval.once import evaluate

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
