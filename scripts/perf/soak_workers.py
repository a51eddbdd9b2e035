"""Worker-RSS soak: how much memory an env worker starts with, and whether it grows with the rollouts it runs.

At ready: the job opened with its worker hub alone running (nothing scheduled), once every worker has reported
ready, the RSS of each env worker process (``VmRSS`` of the hub's local workers, by name).
``--ready-only`` stops there (~15 s: what ``regress.py`` runs; with ``--config`` another job's workers, its
inference servers replaced by simulated ones as for every config here). Otherwise it then opens the job anew (whose
workers get rollouts the moment they are ready) and runs it (``--config``, default configs/demo.toml: simulated
servers as subprocesses, one env worker process per built-in environment, the reference trainer in this process)
for ``--rollouts`` rollouts in all (default 2,000), and reads each worker's RSS from its heartbeats as every step's
metrics carry it (``scheduler.workers.<name>.rss_mb``). Per worker, past ``--warmup`` rollouts (default 200:
imports, connection pools): the median RSS of the first and last thirds of the steps and the growth per 100
rollouts between them, and a least-squares slope per 100 rollouts. Progress goes to stderr every 10 steps. Last
line with --json: one JSON object.

    .venv/bin/python scripts/perf/soak_workers.py --json
    .venv/bin/python scripts/perf/soak_workers.py --ready-only --json
    .venv/bin/python scripts/perf/soak_workers.py --rollouts 4000 --set scheduler.batch_size=32 --json

Targets: ``max_worker_rss_ready_mb`` <= 300 with the built-in environments (what a worker holds at ready:
src/orchestrator/workers/renderer.py and scripts/perf/README.md); ``worker_rss_growth_mb_per_100`` (the worst
worker's) <= 1.0. The leak this measures was ~86 MB per 100 rollouts (one HTTP client kept per rollout by the
built-in harness, ~0.8 MB of SSL context each).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import with_machine

from orchestrator.cli import run_async
from orchestrator.config import load_config

TARGET_MB_PER_100 = 1.0
TARGET_READY_MB = 300.0
READY_TIMEOUT_S = 300.0


def worker_rss_mb(pids: dict[str, int]) -> dict[str, float]:
    """RSS (MB) of the env workers ``pids`` (name -> pid: the hub's ``local_pids()``) now (Linux ``/proc``). A
    worker forked from the hub's warm process counts the pages it shares with it, as one started on its own."""
    rss: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue  # gone meanwhile
        kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        rss[name] = round(kb / 1024, 1)
    return dict(sorted(rss.items()))


async def at_ready(args: argparse.Namespace) -> dict[str, Any]:
    """Open the job, run its worker hub alone (nothing is scheduled) until every worker is ready, read their RSS.
    Only long-standing names (``hub.run``, ``hub.workers``, ``hub.local_pids``): ``regress.py`` runs this against
    older commits too."""
    from orchestrator.app import Orchestrator
    from orchestrator.commands.demo import with_sim_servers

    with tempfile.TemporaryDirectory(prefix="soak-workers-") as tmp:
        cfg = load_config(args.config, [*args.set, "run.max_steps=1", f'run.output_dir="{tmp}"'])
        expected = sum(e.workers for e in cfg.env)
        async with with_sim_servers(cfg) as cfg, Orchestrator.open(cfg) as orch:
            hub = orch.hub
            run = asyncio.ensure_future(hub.run())
            try:
                async with asyncio.timeout(READY_TIMEOUT_S):
                    while sum(w.ready for w in hub.workers.values()) < expected:
                        await asyncio.wait([run], timeout=0.05)  # a hub that fails raises here
                        if run.done():
                            run.result()
                return ready_fields(worker_rss_mb(hub.local_pids()))
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)


def ready_fields(ready: dict[str, float]) -> dict[str, Any]:
    worst = max(ready.values(), default=float("nan"))
    return {"worker_rss_ready_mb": ready, "max_worker_rss_ready_mb": worst,
            "meets_ready_target": bool(ready) and worst <= TARGET_READY_MB}


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    from orchestrator.app import Orchestrator
    from orchestrator.commands.demo import with_sim_servers
    from orchestrator.testing.worker_memory import rss_growth, worker_rss_series
    from orchestrator.trainer.reference import ReferenceTrainer

    with tempfile.TemporaryDirectory(prefix="soak-workers-") as tmp:
        probe = load_config(args.config, args.set)
        per_step = probe.scheduler.batch_size or 64
        steps = math.ceil(args.rollouts / per_step) + 1
        cfg = load_config(args.config, [*args.set, f"run.max_steps={steps}", f'run.output_dir="{tmp}"'])
        metrics: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        async with with_sim_servers(cfg) as cfg, Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=steps, checkpoint_dir=Path(tmp) / "ckpt")

            def on_step(m: dict[str, Any]) -> None:
                metrics.append(m)
                if len(metrics) % 10 == 0 or len(metrics) == steps:
                    workers = m["scheduler"]["workers"]
                    rss = ", ".join(f"{k} {w['rss_mb']:.0f} MB" for k, w in workers.items() if w["rss_mb"])
                    print(f"soak-workers: step {len(metrics)}/{steps}, {sum(x['rollouts'] for x in metrics)} "
                          f"rollouts, {rss}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

            orch.on_step = on_step
            async with asyncio.TaskGroup() as tg:
                tg.create_task(trainer.run())
                await orch.run()
    series = worker_rss_series(metrics)
    growth = [g for name, pts in sorted(series.items()) if (g := rss_growth(name, pts, args.warmup)) is not None]
    worst = max((g.mb_per_100 for g in growth), default=float("nan"))
    return {
        "rollouts": sum(m["rollouts"] for m in metrics), "steps": len(metrics),
        "wall_s": round(time.perf_counter() - t0, 1), "warmup_rollouts": args.warmup,
        "workers": {g.worker: {"points": g.points, "rollouts": g.rollouts, "start_mb": g.start_mb,
                               "end_mb": g.end_mb, "growth_mb": round(g.growth_mb, 1),
                               "mb_per_100": round(g.mb_per_100, 3),
                               "slope_mb_per_100": round(g.slope_mb_per_100, 3)} for g in growth},
        "worker_rss_growth_mb_per_100": round(worst, 3),
        "orchestrator_rss_first_mb": metrics[0]["rss_mb"], "orchestrator_rss_last_mb": metrics[-1]["rss_mb"],
        "meets_growth_target": bool(growth) and worst <= TARGET_MB_PER_100,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=2000, help="rollouts in all (default 2000)")
    p.add_argument("--warmup", type=int, default=200, help="rollouts per worker left out of the measure")
    p.add_argument("--config", default="configs/demo.toml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--ready-only", action="store_true", help="only the workers' RSS at ready (no rollouts)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args()
    if Path(args.config).exists():
        args.config = str(Path(args.config).resolve())
    with contextlib.chdir(Path(__file__).resolve().parents[2]):  # configs/ paths resolve from the repo root
        result = run_async(at_ready(args))
        if not args.ready_only:  # the soak's own workers get rollouts the moment they are ready: other processes
            result.update(run_async(soak(args)))
            result["meets_target"] = result["meets_growth_target"] and result["meets_ready_target"]
    ready = ", ".join(f"{name} {mb:.0f} MB" for name, mb in result["worker_rss_ready_mb"].items())
    print(f"soak-workers: RSS at ready: {ready or 'no worker found'} (target <= {TARGET_READY_MB:.0f})",
          file=sys.stderr)
    if args.ready_only:
        if args.json:
            print(json.dumps(with_machine(result)))
        return 0 if result["meets_ready_target"] else 1
    for name, w in result["workers"].items():
        print(f"soak-workers: {name}: {w['start_mb']:.0f} -> {w['end_mb']:.0f} MB over {w['rollouts']:.0f} rollouts "
              f"({w['mb_per_100']:+.2f} MB per 100, slope {w['slope_mb_per_100']:+.2f})", file=sys.stderr)
    print(f"soak-workers: {result['rollouts']} rollouts in {result['wall_s']} s; worst worker "
          f"{result['worker_rss_growth_mb_per_100']:+.2f} MB per 100 rollouts (target <= {TARGET_MB_PER_100})",
          file=sys.stderr)
    if args.json:
        print(json.dumps(with_machine(result)))
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
