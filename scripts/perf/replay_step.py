"""Replay one step through the real step-boundary pipeline, phase by phase, with loop-lag attribution.

SOURCE is a step dump (``<output_dir>/dumps/step_000012``, see ``pipeline.dump_steps``, or one written by
``synth_step.py``) or ``synthetic[:R,T,N,L,K]``: R rollouts of T turns and N tokens each with routed experts
L layers x top-k K, made in memory (default ``synthetic:256,8,4096,48,8``). The step runs through
advantage, filter, assemble (StepBuilder), send (encode + ZMQ PUSH over ipc:// to a real BatchReceiver in
a child process), [dump], gc, metrics, write (JSONL), in a temp directory, while the loop's lag is sampled
every 1 ms. Off the loop (default) the worker-thread phases run in ``asyncio.to_thread`` as in the orchestrator;
``--inline`` runs them on the loop (the baseline).

Per phase: wall time, max and p99 loop lag. A phase with a large wall and a small lag is fine (it runs
beside the loop); a lag close to its wall means it holds the loop (the GIL). A replayed dump's rebuilt
batch is compared byte for byte with the dumped one (``batch_matches_dump``).

    .venv/bin/python scripts/perf/replay_step.py outputs/demo/dumps/step_000000 --synthetic-traffic 20 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import _steplib as lib
from _machine import with_machine

from orchestrator.cli import run_async
from orchestrator.errors import OrchestratorError

DEFAULT_SYNTHETIC = "synthetic:256,8,4096,48,8"
PHASES = ("advantage", "filter", "assemble", "send", "dump", "gc", "metrics", "write")


def load_input(source: str, group_size: int, seed: int) -> lib.StepInput:
    if Path(source).exists():
        return lib.dump_input(Path(source))
    if source.startswith("synthetic"):
        spec = source if ":" in source else DEFAULT_SYNTHETIC
        r, t, n, layers, k = lib.parse_synthetic(spec)
        return lib.synthetic_input(r, t, n, layers, k, group_size=group_size, seed=seed)
    raise ValueError(f"{source!r} is neither a dump directory nor synthetic[:R,T,N,L,K]")


async def replay(inp: lib.StepInput, args: argparse.Namespace) -> dict[str, Any]:
    traffic = lib.traffic_from(args, args.synthetic_traffic)
    with tempfile.TemporaryDirectory(prefix="replay-") as tmp:
        async with lib.session(inp, Path(tmp), traffic=traffic, profile=args.profile) as runner:
            for k in range(args.repeat):
                await runner.step(inp.step + k, inline=args.inline, dump=args.dump)
        spans, lag = runner.spans, runner.timeline
    result: dict[str, Any] = lib.summarize(spans, lag)
    result.update({"source": inp.label, "rollouts": inp.rollouts, "tokens": inp.tokens,
                   "mode": "inline" if args.inline else "off_loop", "synthetic_traffic": args.synthetic_traffic,
                   "background_bursts": traffic.bursts, "batch_matches_dump": runner.batch_matches_dump})
    if args.dump:
        result["dump_mb"] = round(runner.dump_mb, 1)
    if args.profile:
        print(runner.profile_text(), end="")
    if args.plot:
        result["plot"] = str(lib.plot(Path(args.plot), spans, lag, f"replay of {inp.label} ({result['mode']})"))
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['source']}: {result['rollouts']} rollouts, {result['tokens']} tokens, {result['mode']}, "
          f"{result['synthetic_traffic']} background tasks, {result['runs']} run(s)")
    print(f"{'phase':<10} {'where':<7} {'wall ms':>9} {'max lag ms':>11} {'p99 lag ms':>11}")
    for name, p in result["phases"].items():
        where = "thread" if name in lib.THREAD_PHASES and result["mode"] == "off_loop" else "loop"
        print(f"{name:<10} {where:<7} {p['wall_s'] * 1e3:>9.1f} {p['max_lag_ms']:>11.2f} {p['p99_lag_ms']:>11.2f}")
    print(f"{'step':<18} {result['wall_s'] * 1e3:>9.1f} {result['max_lag_ms']:>11.2f} {result['p99_lag_ms']:>11.2f}")
    if result["batch_matches_dump"] is not None:
        print(f"rebuilt batch equals the dumped batch: {result['batch_matches_dump']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help=f"a dump directory or synthetic[:R,T,N,L,K] (default {DEFAULT_SYNTHETIC})")
    p.add_argument("--synthetic-traffic", type=int, default=0, metavar="N",
                   help="N background tasks on the loop, each burning --burn-ms then sleeping --sleep-ms")
    lib.add_traffic_arguments(p)
    p.add_argument("--group-size", type=int, default=8, help="synthetic input: rollouts per group (default: 8)")
    p.add_argument("--inline", action="store_true", help="run the worker-thread phases on the loop (baseline)")
    p.add_argument("--dump", action="store_true", help="also write a dump of the step (phase 'dump')")
    p.add_argument("--repeat", type=int, default=1, metavar="K", help="run the step K times (default: 1)")
    p.add_argument("--profile", choices=PHASES, default=None, metavar="PHASE",
                   help=f"cProfile one phase, top 25 by cumulative time ({', '.join(PHASES)})")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="lag timeline with phases shaded + bar chart")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.synthetic_traffic < 0:
        p.error("--repeat must be >= 1 and --synthetic-traffic >= 0")
    gc.collect()
    gc.freeze()  # as the orchestrator does after start-up: imports stay out of the step's collection
    try:
        inp = load_input(args.source, args.group_size, args.seed)
        result = run_async(replay(inp, args))
    except (ValueError, OrchestratorError) as e:
        print(f"replay_step: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(with_machine(result)))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
