"""Benchmark: one step boundary under background load on the loop, off the loop vs inline, in the same run.

A synthetic step of ``--rollouts`` records (default 256; 8 turns, 4,096 tokens each, routed experts 48 x 8:
~400 MB of columns) goes through the real step-boundary pipeline (advantage, filter, assemble, encode +
ZMQ send to a receiver process, gc, metrics, JSONL; see _steplib.py) while ``--tasks`` background
tasks (default 200) run on the loop, each burning ``--burn-ms`` (0.3) of CPU then sleeping 0.5-2 ms.
Loop lag is sampled every 1 ms. Measured in one run, in this order:

1. background only: the same tasks for ``--baseline-s`` with no step work (200 x 0.3 ms bursts saturate
   the loop on their own, so this is the floor the step's lag must be compared with);
2. the step off the loop (as the orchestrator runs it), ``--repeat`` times;
3. the same step inline on the loop (the baseline);
4. the step off the loop with a dump written (``dump_*``: the dump phase's lag).

Prints ``max_lag_ms``, ``p99_lag_ms`` (targets <= 10 and <= 5), ``wall_s``, the ``inline_*`` and
``background_only_*`` figures, ``dump_max_lag_ms`` and ratios. Last line with --json: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _steplib as lib
from _machine import with_machine

from orchestrator.cli import run_async

TARGET_MAX_MS = 10.0
TARGET_P99_MS = 5.0


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


async def bench(args: argparse.Namespace, inp: lib.StepInput) -> dict[str, Any]:
    traffic = lib.traffic_from(args, args.tasks)
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        async with lib.session(inp, Path(tmp), traffic=traffic) as runner:
            await runner.step(0)  # warm-up: thread pool, first-touch allocations; not measured
            start = time.perf_counter()
            await asyncio.sleep(args.baseline_s)
            background = runner.timeline.summary([(start, time.perf_counter())])
            step = 1
            off: list[lib.PhaseSpan] = []
            for _ in range(args.repeat):
                off += await runner.step(step)
                step += 1
            inline = await runner.step(step, inline=True)
            dumped = await runner.step(step + 1, dump=True)
        lag = runner.timeline
    ours, base, dump = lib.summarize(off, lag), lib.summarize(inline, lag), lib.summarize(dumped, lag)
    dump_phase = dump["phases"]["dump"]
    bg_max, bg_p99 = background["max_lag_ms"], background["p99_lag_ms"]
    result: dict[str, Any] = {
        "rollouts": inp.rollouts, "tokens": inp.tokens, "tasks": args.tasks, "burn_ms": args.burn_ms,
        "sleep_ms": args.sleep_ms, "repeat": args.repeat, "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "max_lag_ms": ours["max_lag_ms"], "p99_lag_ms": ours["p99_lag_ms"], "wall_s": ours["wall_s"],
        "inline_max_lag_ms": base["max_lag_ms"], "inline_p99_lag_ms": base["p99_lag_ms"],
        "inline_wall_s": base["wall_s"],
        "background_only_max_lag_ms": bg_max, "background_only_p99_lag_ms": bg_p99,
        "dump_max_lag_ms": dump_phase["max_lag_ms"], "dump_p99_lag_ms": dump_phase["p99_lag_ms"],
        "dump_wall_s": dump_phase["wall_s"], "dump_mb": round(runner.dump_mb, 1),
        "dump_step_max_lag_ms": dump["max_lag_ms"],
        "max_lag_ratio_to_background": _ratio(ours["max_lag_ms"], bg_max),
        "p99_lag_ratio_to_background": _ratio(ours["p99_lag_ms"], bg_p99),
        "dump_max_lag_ratio_to_background": _ratio(dump_phase["max_lag_ms"], bg_max),
        "inline_max_lag_ratio_to_background": _ratio(base["max_lag_ms"], bg_max),
        "max_lag_ratio_to_inline": _ratio(ours["max_lag_ms"], base["max_lag_ms"]),
        "wall_ratio_to_inline": _ratio(ours["wall_s"], base["wall_s"]),
        "meets_target": ours["max_lag_ms"] <= TARGET_MAX_MS and ours["p99_lag_ms"] <= TARGET_P99_MS,
        "background_only": background, "phases": ours["phases"], "inline_phases": base["phases"],
    }
    if args.plot:
        result["plot"] = str(lib.plot(Path(args.plot), off + inline + dumped, lag,
                                      f"bench_step: off loop x{args.repeat}, inline, with dump"))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rollout (default: 4096)")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tasks", type=int, default=200, help="background tasks on the loop (default: 200)")
    lib.add_traffic_arguments(p)
    p.add_argument("--baseline-s", type=float, default=2.0, help="background-only window (default: 2 s)")
    p.add_argument("--repeat", type=int, default=3, help="off-loop steps measured (default: 3)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="lag timeline with phases shaded + bar chart")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    gc.collect()
    gc.freeze()
    inp = lib.synthetic_input(args.rollouts, args.turns, args.tokens, args.layers, args.top_k, seed=args.seed)
    result = run_async(bench(args, inp))
    verdict = "met" if result["meets_target"] else "NOT met"
    print(f"step of {result['rollouts']} rollouts / {result['tokens']} tokens with {args.tasks} background tasks:")
    print(f"  background only: lag max {result['background_only_max_lag_ms']} ms, "
          f"p99 {result['background_only_p99_lag_ms']} ms")
    print(f"  off the loop:    lag max {result['max_lag_ms']} ms, p99 {result['p99_lag_ms']} ms, "
          f"wall {result['wall_s']} s (target max <= {TARGET_MAX_MS}, p99 <= {TARGET_P99_MS}: {verdict})")
    print(f"  inline:          lag max {result['inline_max_lag_ms']} ms, p99 {result['inline_p99_lag_ms']} ms, "
          f"wall {result['inline_wall_s']} s")
    print(f"  dump ({result['dump_mb']} MB): lag max {result['dump_max_lag_ms']} ms, "
          f"p99 {result['dump_p99_lag_ms']} ms, wall {result['dump_wall_s']} s")
    if args.json:
        print(json.dumps(with_machine(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
