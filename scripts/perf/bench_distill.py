"""Benchmark: the same job with and without teacher scoring (on-policy distillation), simulated servers.

One simulated policy server and one simulated teacher server (``--policy-seed``: another tiny policy) run as
subprocesses; the orchestrator runs in this process (uvloop, as ``orchestrator run``) with 2 local env workers and
the reference trainer as a subprocess (``--no-announce``: no weight syncs, so every pass samples the same policy).
Each pass runs ``--rollouts`` arithmetic rollouts (8-token replies, groups of 8, 10 steps): "without" with
``algorithm = "reward"`` and no ``[teacher]``, "with" with ``algorithm = "opd"``, where every env worker scores
every trainable sample under the teacher before sending its record. The passes alternate, ``--repeats`` each
(interleaved: a load that changes during the run hits both), and the figures are medians.

Prints, for both: the orchestrator process's own CPU per rollout (this process's CPU time over the steps, start-up
excluded: env workers and servers are other processes), its loop lag (sampled every ``--lag-interval-s``; the
worst step's p99 and max), rollouts/s; then ``orch_cpu_ratio`` (with / without: the teacher's bytes and requests
live in the env workers, the orchestrator sees the same headers; target <= 1.1),
``lag_p99_delta_ms`` and ``lag_max_delta_ms`` (with - without; target: no growth beyond the run's noise) and
``with_teacher_to_without`` (rollouts/s; no target on 2 cores, where the teacher's prefills share the CPU with
everything else).
``--data-plane direct`` keeps every column, the teacher's too, out of the orchestrator (default: through).

Read ``orch_cpu_ratio`` with ``cpu_ms_per_s`` (the orchestrator's CPU per second of wall time): part of its CPU is
paid per second, not per rollout (the loop-lag sampler at ``--lag-interval-s``, timers, polls), and with the
teacher's prefills on the same 2 cores a pass takes longer, so that part lands on fewer rollouts per second. So
before each pair of passes an idle pass measures what the orchestrator pays a second with nothing completing
(``idle_cpu_ms_per_s``: the same job against a third simulated server that answers nothing within the pass, over
``--idle-s`` once its groups are admitted). It is context, not a correction: subtracted per second from busy
passes it leaves less per rollout with the teacher than without (quiet run: idle 25.9 ms/s, busy passes 37-55
ms/s), so a busy loop absorbs much of it (timers firing on a loop that is awake anyway).
Smoke runs (``--rollouts 200 --repeats 1``, load 6-14 from other work, 2026-11-28): 1.16, 1.19 and 1.24 through,
1.62 direct, where the pass with the teacher ran at 0.29 x the rollouts/s: not a figure; the lead's run on a
quiet machine, at the default sizes, is. Also the
machine's load average at the start and the end: the figures are only as quiet as the machine was, and the
machine and commit (``_machine.py``).
Last line with --json: JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _machine import with_machine
from _running import running

from orchestrator.cli import run_async
from orchestrator.sim.process import sim_process

if TYPE_CHECKING:
    from orchestrator.config import JobConfig

STEPS = 10
STALL_S = 600.0  # the stalled server's latency: no reply within an idle pass
IDLE_SETTLE_S = 3.0  # after the workers are ready: the groups admitted, the requests sent


def job(policy: str, teacher: str | None, rollouts: int, out: Path, lag_interval_s: float, data_plane: str, *,
        preflight: bool = True) -> JobConfig:
    """The job of a pass: ``rollouts`` over STEPS steps; with ``teacher``, every sample scored under it."""
    from orchestrator.config import load_config
    from orchestrator.testing.jobs import toml_text

    out.mkdir(parents=True, exist_ok=True)
    sections: dict[str, Any] = {
        "run": {"name": "bench", "output_dir": out / "run", "max_steps": STEPS},
        "inference": {"servers": [policy], "request_timeout_s": 120.0, "preflight": preflight},
        "scheduler": {"batch_size": rollouts // STEPS, "max_inflight": 64, "max_async_level": STEPS,
                      "max_off_policy_steps": STEPS},
        "pipeline": {"gates": []},  # every group trains: the same work in both passes
        "transport": {"data_plane": data_plane},
        "monitor": {"lag_interval_s": lag_interval_s, "lag_window": 200000, "lag_warn_ms": 1000.0,
                    "lag_error_ms": 10000.0},
        "env": [{"taskset": "orchestrator-arithmetic", "group_size": 8, "workers": 2, "sampling": {"max_tokens": 8},
                 "algorithm": "opd" if teacher else "reward"}],
    }
    if teacher:
        sections["teacher"] = {"servers": [teacher], "model": "teacher", "request_timeout_s": 120.0}
    cfg_path = out / "bench.toml"
    cfg_path.write_text(toml_text(**sections))
    return load_config(cfg_path)


async def one_pass(policy: str, teacher: str | None, rollouts: int, out: Path, lag_interval_s: float,
                   data_plane: str) -> dict[str, Any]:
    async with running(job(policy, teacher, rollouts, out, lag_interval_s, data_plane)) as (_, run):
        cpu0, t0 = time.process_time(), time.perf_counter()
        summary = await run
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    done = sum(m["rollouts"] for m in summary.metrics)
    failed = sum(m["failed"] for m in summary.metrics)
    return {"rollouts": done, "failed": failed, "rollouts_per_s": done / wall, "cpu_ms_per_rollout": cpu * 1e3 / done,
            "cpu_ms_per_s": cpu * 1e3 / wall,
            "lag_p99_ms": max(m["lag"]["p99"] for m in summary.metrics),
            "lag_max_ms": max(m["lag"]["max"] for m in summary.metrics)}


async def idle_pass(stalled: str, out: Path, lag_interval_s: float, data_plane: str, window_s: float) -> float:
    """The orchestrator's CPU per second of wall time while no rollout completes (``stalled``: a policy server
    that answers nothing within the pass): what it pays per second whatever the rollouts (lag sampler, timers,
    polls, the workers' heartbeats), measured over ``window_s`` once its groups are admitted."""
    async with running(job(stalled, None, 800, out, lag_interval_s, data_plane, preflight=False)):
        await asyncio.sleep(IDLE_SETTLE_S)
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(window_s)
        return (time.process_time() - cpu0) * 1e3 / (time.perf_counter() - t0)


def median(passes: list[dict[str, Any]], key: str) -> float:
    return round(float(statistics.median(p[key] for p in passes)), 3)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    load_start = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    idle: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HOME"] = tmp  # verifiers writes ~/.cache/verifiers
        async with sim_process(["--seed", "0"]) as policy, \
                sim_process(["--seed", "1", "--model", "teacher", "--policy-seed", "1", "--max-model-len", "4097"]
                            ) as teacher, \
                sim_process(["--seed", "0", "--latency-ms", str(int(STALL_S * 1000))]) as stalled:
            for server in (policy, teacher, stalled):  # they stand in for GPU servers on other hosts
                os.setpriority(os.PRIO_PROCESS, server.pid, 5)
            for i in range(args.repeats):
                idle.append(await idle_pass(stalled.url, Path(tmp) / f"idle-{i}", args.lag_interval_s,
                                            args.data_plane, args.idle_s))
                print(f"pass {i} idle: {idle[-1]:.3f} ms CPU a second", file=sys.stderr, flush=True)
                for name in ("without", "with"):
                    result = await one_pass(policy.url, teacher.url if name == "with" else None, args.rollouts,
                                            Path(tmp) / f"{name}-{i}", args.lag_interval_s, args.data_plane)
                    runs[name].append(result)
                    print(f"pass {i} {name} teacher: {json.dumps({k: round(v, 3) for k, v in result.items()})}",
                          file=sys.stderr, flush=True)
    out: dict[str, Any] = {"rollouts_per_pass": args.rollouts, "repeats": args.repeats, "data_plane": args.data_plane,
                           "lag_interval_s": args.lag_interval_s}
    for name, passes in runs.items():
        for key in ("cpu_ms_per_rollout", "cpu_ms_per_s", "rollouts_per_s", "lag_p99_ms", "lag_max_ms"):
            out[f"{key}_{name}"] = median(passes, key)
        out[f"failed_{name}"] = sum(p["failed"] for p in passes)
    out["orch_cpu_ratio"] = round(out["cpu_ms_per_rollout_with"] / out["cpu_ms_per_rollout_without"], 3)
    out["idle_cpu_ms_per_s"] = round(float(statistics.median(idle)), 3)
    out["lag_p99_delta_ms"] = round(out["lag_p99_ms_with"] - out["lag_p99_ms_without"], 3)
    out["lag_max_delta_ms"] = round(out["lag_max_ms_with"] - out["lag_max_ms_without"], 3)
    out["with_teacher_to_without"] = round(out["rollouts_per_s_with"] / out["rollouts_per_s_without"], 3)
    out["load_average_start"] = [round(x, 2) for x in load_start]
    out["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=800, help="rollouts per pass (10 steps)")
    p.add_argument("--repeats", type=int, default=3, help="passes of each kind, interleaved")
    p.add_argument("--data-plane", choices=("through", "direct"), default="through",
                   help="through (default): column bytes, the teacher's too, pass the orchestrator; direct: not")
    p.add_argument("--lag-interval-s", type=float, default=0.01, help="loop-lag sampling interval")
    p.add_argument("--idle-s", type=float, default=10.0, help="the window of each idle pass")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args()
    result = run_async(main_async(args))
    if args.json:
        print(json.dumps(with_machine(result)))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
