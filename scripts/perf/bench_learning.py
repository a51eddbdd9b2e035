"""Benchmark learning: how many steps the loop needs to reach a reward, and how long that takes.

Runs the learning run of tests/test_learning.py (``orchestrator.testing.learning.run_learning``: a simulated
server, an env worker, the orchestrator and ``orchestrator receive --learn`` as real processes; on-policy,
``--batch-size`` rollouts a step, ``--env`` arithmetic answered in one token, or guess-number in two turns) ``--passes``
times, with seeds ``--seed``, ``--seed`` + 1, ... (``--same-seed``: all ``--seed``, so the spread is what timing
alone changes), for ``--steps`` steps each. Per pass: ``steps_to_threshold``, the first step at which the
reward averaged over the last ``--window`` steps reaches ``--threshold`` (None: never), the run's wall time,
and the margin test_learning.py asserts (mean reward of the last 6 steps minus the first 3). Reported: their
medians.
The baseline, in the same run: one pass with the advantages shuffled across samples in the trainer (the same
tasks, nothing to learn from), which should never reach the threshold (``--no-baseline`` skips it).

A change that slows learning (stale rollouts, a wrong column, a worse update) shows as more steps to the
threshold or a smaller margin; one that slows the loop, as more wall time. ``--corrupt KIND`` makes every pass
a negative control (shuffle, shift, zeros) and ``--concurrent`` runs the passes at once (wall times then
overlap; on 2 cores more than two at once starve the env workers). ``--json`` prints one JSON object as the
last line.

    .venv/bin/python scripts/perf/bench_learning.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from _machine import with_machine

from orchestrator.testing.learning import CORRUPTIONS, margin, rewards, run_learning

FIRST, LAST = 3, 6  # as tests/test_learning.py
TARGET_STEPS = 12  # median steps to the default threshold


def steps_to(values: list[float], threshold: float, window: int) -> int | None:
    """The first step (0-based) whose trailing mean over ``window`` steps reaches ``threshold``."""
    for i in range(window - 1, len(values)):
        if np.mean(values[i - window + 1:i + 1]) >= threshold:
            return i
    return None


async def one_pass(root: Path, seed: int, args: argparse.Namespace, corrupt: str | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    directory = Path(tempfile.mkdtemp(prefix=f"{corrupt or 'right'}-{seed}-", dir=root)) / "run"
    metrics = await run_learning(directory, seed, args.steps, corrupt, envs=(args.env,), batch_size=args.batch_size)
    wall = time.perf_counter() - t0
    r = rewards(metrics, args.env)
    return {"seed": seed, "corrupt": corrupt, "steps_to_threshold": steps_to(r, args.threshold, args.window),
            "wall_s": round(wall, 1), "margin": round(margin(metrics, args.env, FIRST, LAST), 4),
            "rewards": [round(x, 4) for x in r]}


async def bench(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    seeds = [args.seed] * args.passes if args.same_seed else list(range(args.seed, args.seed + args.passes))
    if args.concurrent:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one_pass(root, s, args, args.corrupt)) for s in seeds]
        passes = [t.result() for t in tasks]
    else:
        passes = [await one_pass(root, s, args, args.corrupt) for s in seeds]
    for p in passes:
        print(f"seed {p['seed']}: {p['steps_to_threshold']} steps to {args.threshold}, margin {p['margin']:+.3f}, "
              f"{p['wall_s']} s; rewards {p['rewards']}", file=sys.stderr)
    baseline = None
    if not args.no_baseline and args.corrupt is None:
        baseline = await one_pass(root, args.seed, args, "shuffle")
        print(f"baseline (shuffled advantages), seed {args.seed}: {baseline['steps_to_threshold']} steps, margin "
              f"{baseline['margin']:+.3f}; rewards {baseline['rewards']}", file=sys.stderr)
    reached = [p["steps_to_threshold"] for p in passes if p["steps_to_threshold"] is not None]
    median_steps = statistics.median(reached) if len(reached) == len(passes) else None
    result = {"bench": "learning", "env": args.env, "steps": args.steps, "threshold": args.threshold,
              "window": args.window, "corrupt": args.corrupt, "passes": passes,
              "median_steps_to_threshold": median_steps,
              "median_wall_s": statistics.median(p["wall_s"] for p in passes),
              "median_margin": statistics.median(p["margin"] for p in passes),
              "baseline": baseline, "target_steps": TARGET_STEPS}
    learned = median_steps is not None and median_steps <= TARGET_STEPS
    result["meets_target"] = (learned and (baseline is None or baseline["steps_to_threshold"] is None)
                              if args.corrupt is None else len(reached) == 0)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=3, help="runs, seeds --seed, --seed + 1, ... (default: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=16, help="steps per run (default: 16, as the test)")
    p.add_argument("--threshold", type=float, default=0.15, help="reward to reach (default: 0.15; the untrained "
                                                                  "policy gets about 0.07 on arithmetic)")
    p.add_argument("--window", type=int, default=3, help="steps the reward is averaged over (default: 3)")
    p.add_argument("--corrupt", choices=CORRUPTIONS, default=None, help="every pass a negative control")
    p.add_argument("--concurrent", action="store_true", help="run the passes at once")
    p.add_argument("--same-seed", action="store_true",
                   help="every pass with --seed: the spread is what timing alone changes")
    p.add_argument("--env", choices=("arithmetic", "guess-number"), default="arithmetic",
                   help="the environment trained and measured (default: arithmetic)")
    p.add_argument("--batch-size", type=int, default=64, help="rollouts a step, groups of 8 (default: 64, as the "
                                                             "test's arithmetic runs; its guess-number run: 32)")
    p.add_argument("--no-baseline", action="store_true", help="skip the shuffled-advantages baseline pass")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args()
    if args.steps < FIRST + LAST or args.passes < 1 or args.window < 1:
        p.error(f"need --steps >= {FIRST + LAST}, --passes >= 1, --window >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        os.environ["HOME"] = tmp  # verifiers writes ~/.cache/verifiers
        result = asyncio.run(bench(args, Path(tmp)))
    verdict = "met" if result["meets_target"] else "NOT met"
    print(f"learning: median {result['median_steps_to_threshold']} steps to reward {args.threshold} "
          f"(target <= {TARGET_STEPS}: {verdict}), median wall {result['median_wall_s']} s, median margin "
          f"{result['median_margin']:+.3f} over {args.passes} passes")
    if args.json:
        print(orjson.dumps(with_machine(result)).decode())
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
