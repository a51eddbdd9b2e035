"""Soak: the demo pipeline for many steps; does memory, loop lag, or the count of fds and threads drift?

Runs the demo job (``--config``, default configs/demo.toml: simulated servers as subprocesses, env worker
processes with the built-in environments, the reference trainer in this process) for ``--steps`` steps
(default 300) in a temp output directory. ``--set KEY=VALUE`` overrides config keys; the defaults shrink
the demo's step (``scheduler.batch_size=16``) so 300 steps take minutes, not an hour.

Prints, from the per-step metrics: ``rss_slope_mb_per_step`` (least squares over the second half of the
steps, after warm-up; target <= 0.5), ``max_lag_ms`` per step as first-half and second-half medians and a
least-squares slope (a trend means something accumulates on the loop), and open file descriptors and
threads of this process after warm-up (step >= max(2, steps/10) and >= 10 s) and at the last step (must
be equal) and before the orchestrator opened and after it closed (must be equal: nothing left behind).
Progress goes to stderr every 10 steps. Last line with --json: one JSON object.

    .venv/bin/python scripts/perf/soak.py --steps 300 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.asyncio
from _machine import with_machine

from orchestrator.cli import run_async
from orchestrator.config import load_config

TARGET_RSS_SLOPE = 0.5
WARM_S = 10.0  # start-up connections (first requests, workers joining) have settled
DEFAULT_SETS = ["scheduler.batch_size=16", "scheduler.max_inflight=32"]


def fds() -> int:
    return sum(1 for _ in Path("/proc/self/fd").iterdir())


def threads() -> int:
    return threading.active_count()


def slope(y: list[float]) -> float:
    """Least-squares slope of ``y`` against its index (units of y per step)."""
    if len(y) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(y), dtype=float), np.asarray(y, dtype=float), 1)[0])


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    from orchestrator.app import Orchestrator
    from orchestrator.commands.demo import with_sim_servers
    from orchestrator.trainer.reference import ReferenceTrainer

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        out = args.output_dir or tmp
        sets = [*DEFAULT_SETS, *args.set, f"run.max_steps={args.steps}", f'run.output_dir="{out}"']
        cfg = load_config(args.config, sets)
        rss: list[float] = []
        lag: list[float] = []
        marks: dict[str, int] = {}
        warm = max(2, args.steps // 10)

        t0 = time.perf_counter()
        async with with_sim_servers(cfg) as cfg:
            # process-wide singletons that outlive any one orchestrator by design: the loop's default executor
            # thread and the trainer's shared ZMQ context (Context.instance(), never terminated)
            await asyncio.to_thread(lambda: None)
            zmq.asyncio.Context.instance().socket(zmq.PULL).close()  # its IO thread starts with a first socket
            marks.update(fds_before=fds(), threads_before=threads())

            t_open = time.perf_counter()
            async with Orchestrator.open(cfg) as orch:
                # runs until cancelled: ending at the last step would close its sockets before fds_end is read
                trainer = ReferenceTrainer(orch.sender.address, checkpoint_dir=Path(cfg.run.output_dir) / "ckpt")

                def on_step(m: dict[str, Any]) -> None:
                    rss.append(float(m["rss_mb"]))
                    lag.append(float(m["lag"]["max"]))
                    n = len(rss)
                    if "fds_start" not in marks and n >= warm and time.perf_counter() - t_open >= WARM_S:
                        marks.update(fds_start=fds(), threads_start=threads())

                    if n == args.steps:
                        marks.update(fds_end=fds(), threads_end=threads())
                    if n % 10 == 0 or n == args.steps:
                        print(f"soak: step {n}/{args.steps}, rss {rss[-1]:.0f} MB, lag max {lag[-1]:.1f} ms, "
                              f"fds {fds()}, threads {threads()}, {time.perf_counter() - t0:.0f} s",
                              file=sys.stderr, flush=True)

                orch.on_step = on_step
                async with asyncio.TaskGroup() as tg:
                    trainer_task = tg.create_task(trainer.run())
                    await orch.run()
                    trainer_task.cancel()
            await asyncio.sleep(0.5)  # closed sockets and finished threads settle
            marks.update(fds_after=fds(), threads_after=threads())
    half = len(rss) // 2
    result = {
        "steps": len(rss), "wall_s": round(time.perf_counter() - t0, 1),
        "rss_slope_mb_per_step": round(slope(rss[half:]), 4),
        "rss_first_mb": rss[0], "rss_last_mb": rss[-1], "rss_max_mb": max(rss),
        "max_lag_ms": max(lag),
        "max_lag_median_first_half_ms": round(float(np.median(lag[:half] or lag)), 2),
        "max_lag_median_second_half_ms": round(float(np.median(lag[half:])), 2),
        "max_lag_slope_ms_per_step": round(slope(lag), 4),
        **marks,
    }
    result["fds_equal"] = marks.get("fds_start") == marks.get("fds_end")
    result["threads_equal"] = marks.get("threads_start") == marks.get("threads_end")
    # <=, not ==: a transient fd of the moment (e.g. a log file being rotated) may be open at "before"
    result["nothing_left_behind"] = (marks["fds_after"] <= marks["fds_before"]
                                     and marks["threads_after"] <= marks["threads_before"])
    result["meets_target"] = bool(result["rss_slope_mb_per_step"] <= TARGET_RSS_SLOPE and result["fds_equal"]
                                  and result["threads_equal"] and result["nothing_left_behind"])
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--config", default="configs/demo.toml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"config override, after the soak's defaults {DEFAULT_SETS}")
    p.add_argument("--output-dir", default=None, help="keep outputs here (default: a temp directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be at least 2")
    if args.output_dir:
        args.output_dir = str(Path(args.output_dir).resolve())
    if Path(args.config).exists():
        args.config = str(Path(args.config).resolve())
    with contextlib.chdir(Path(__file__).resolve().parents[2]):  # configs/ paths resolve from the repo root
        result = run_async(soak(args))
    print(f"soak: {result['steps']} steps in {result['wall_s']} s; rss slope {result['rss_slope_mb_per_step']} "
          f"MB/step (target <= {TARGET_RSS_SLOPE}), rss {result['rss_first_mb']:.0f} -> {result['rss_last_mb']:.0f} "
          f"MB; lag max median {result['max_lag_median_first_half_ms']} -> "
          f"{result['max_lag_median_second_half_ms']} ms; fds {result.get('fds_start')} -> {result.get('fds_end')}, "
          f"threads {result.get('threads_start')} -> {result.get('threads_end')}; "
          f"left behind: {'nothing' if result['nothing_left_behind'] else 'SOMETHING'}", file=sys.stderr)
    if args.json:
        print(json.dumps(with_machine(result)))
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
