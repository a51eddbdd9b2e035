"""Benchmark: concurrency that follows the KV cache (``[scheduler.concurrency] adaptive``) against static caps.

One simulated inference server with a KV model (a subprocess: ``sim-inference --kv-capacity-tokens``, vLLM 0.31's
scheduler as sim/kv.py models it: continuous batching, recompute preemption of the youngest request) serves
multi-turn rollouts of the built-in guess-the-number environment, whose contexts grow turn by turn. Each pass is
a whole ``Orchestrator`` job in this process with two local env workers and the reference trainer, under one
setting: a static ``max_inflight`` (``--static``) or the adaptive cap (with ``max_inflight`` the highest static one
as its ceiling). The default caps, for the default cache: 8 too low; 20 about right (the highest that stays
within the preemption budget); 24 just past it (~1% of requests preempted); 64 too high (~15%). Together they
draw the frontier a cap can reach: how much throughput each step past "right" buys with preemptions. Passes are
interleaved and repeated (``--repeats``); figures are medians.

Measured over each pass's steady state (from the end of its first third of steps to its end): tokens/s and
rollouts/s of the rollouts trained (rollouts.jsonl's ok rows of those steps over that wall time: a rollout the
controller cancelled is work lost, counted as ``cancelled``), and the preemption rate: the server's
``vllm:num_preemptions_total`` over the window (read every 0.2 s from its ``/metrics``) per generate request (the
rows' turns), and how full the setting kept the cache (``kv_usage_mean`` and ``kv_usage_p90`` of the same readings),
and how busy the machine's CPUs were (``cpu_busy``, /proc/stat: near 1, the cores set the pace, not the cache), and
how much longer than modelled the sim's engine iterations took (``engine_slowdown``, sim/kv.py: past ~1.1 the
machine did not keep the simulated speed, and the pass ran a slower engine than ``--step-ms`` says). Prints
``adaptive_to_best_static`` and ``adaptive_to_worst_static`` (tokens/s ratios; targets >= 0.85 and >= 1.5),
``adaptive_to_best_unpreempted_static`` (against the best static cap whose preemption rate kept within
PREEMPTION_BUDGET; target >= 0.95), ``steady_preemption_rate`` (adaptive; target <= 0.01) and ``warmup_cancelled``
(rollouts the adaptive cap cancelled in the first third of its passes' steps, summed; target 0). ``--json``: one
JSON object as the last line, with each setting's medians (``passes``), each figure's passes and spread
(``spread``), each adaptive pass's cap changes (``adaptive_caps``: from its log, each new cap in order, how many
each rule made, the lowest and highest over the steady window; printed per pass too), and the machine (cores, load
average). The issue's targets hold at the default step time and at half and double it: ``--step-ms 2.5``,
``--step-ms 10``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
from _machine import with_machine

from orchestrator.cli import run_async
from orchestrator.config import JobConfig, load_config
from orchestrator.errors import ConfigError
from orchestrator.inference.load import ServerLoad, parse_load
from orchestrator.sim.process import sim_process
from orchestrator.testing.jobs import write_job_toml

PREEMPTION_BUDGET = 0.01  # preemptions per generate request at steady state (the target)


def guess_env(max_tokens: int) -> dict[str, Any]:
    """Guess-the-number, 6 turns of exactly ``max_tokens`` each (``min_tokens``: the sim's tiny policy would end
    its turn after ~15): contexts grow turn by turn and within a reply, as long reasoning rollouts' do."""
    return {"taskset": "orchestrator-guess-number", "group_size": 4, "workers": 2, "args": {"max_turns": 6},
            "sampling": {"max_tokens": max_tokens, "extra_body": {"min_tokens": max_tokens}}}


def kv_flags(args: argparse.Namespace) -> list[str]:
    return ["--kv-capacity-tokens", str(args.kv_tokens), "--kv-block-tokens", "16", "--kv-step-ms",
            str(args.step_ms), "--kv-prefill-ms-per-1k", str(args.prefill_ms_per_1k), "--max-model-len",
            str(args.kv_tokens), "--seed", "0"]


async def load(http: aiohttp.ClientSession, url: str) -> ServerLoad:
    async with http.get(url.removesuffix("/v1") + "/metrics") as resp:
        return parse_load(await resp.text())


def job_config(url: str, out: Path, args: argparse.Namespace, max_inflight: int, adaptive: bool) -> JobConfig:
    """One pass's job; the adaptive one with ``--set`` applied as ``orchestrator run --set`` would (ConfigError)."""
    steps, batch = args.steps, args.batch
    concurrency = {"adaptive": True, "poll_s": 0.5} if adaptive else {}
    path = write_job_toml(out, run={"name": "bench", "max_steps": steps},
                          inference={"servers": [url], "request_timeout_s": 600.0},
                          scheduler={"batch_size": batch, "max_inflight": max_inflight, "max_async_level": 2,
                                     "max_off_policy_steps": 4, "max_buffered_rollouts": 4 * max(batch, max_inflight),
                                     "concurrency": concurrency},
                          pipeline={"gates": []}, env=[guess_env(args.max_tokens)])
    return load_config(path, [f"scheduler.concurrency.{s}" for s in args.setting] if adaptive else ())


class CapTrace(logging.Handler):
    """The adaptive cap's changes, from its log (rollouts/concurrency.py says each at INFO: "cap 17 -> 18 (grow;
    ..."): the rule and the new cap, with the wall time. Its warnings are printed as they come."""

    CHANGE = re.compile(r"cap (\d+) -> (\d+) \((\w+);")
    FIRST = re.compile(r"first cap (\d+) rollouts")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.changes: list[tuple[float, str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:  # on the controller's loop: must not raise into it
            self._take(record)
        except Exception:
            self.handleError(record)

    def _take(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING:
            print(msg, file=sys.stderr)
        elif m := self.CHANGE.search(msg):
            self.changes.append((time.perf_counter(), m[3], int(m[2])))
        elif m := self.FIRST.search(msg):
            self.changes.append((time.perf_counter(), "start", int(m[1])))

    def summary(self, t0: float) -> dict[str, Any]:
        """The rules that moved the cap (all pass long), and its caps once the steady window began at ``t0``."""
        caps = [cap for t, _, cap in self.changes if t >= t0]
        before = [cap for t, _, cap in self.changes if t < t0]
        steady = ([before[-1]] if before else []) + caps
        return {"rules": dict(Counter(rule for _, rule, _ in self.changes)),
                "caps": [cap for _, _, cap in self.changes],
                "steady_cap_min": min(steady, default=None), "steady_cap_max": max(steady, default=None)}


async def one_pass(url: str, out: Path, args: argparse.Namespace, max_inflight: int, adaptive: bool
                   ) -> dict[str, Any]:
    steps = args.steps
    cfg = job_config(url, out, args, max_inflight, adaptive)
    marks: list[tuple[float, tuple[int, int]]] = []  # wall time and the machine's CPU ticks at each step's end
    polled: list[tuple[float, ServerLoad]] = []
    timings: list[asyncio.Task[dict[str, float]]] = []
    trace, logger = CapTrace(), logging.getLogger("orchestrator.rollouts.concurrency")
    level = logger.level
    if adaptive:
        logger.setLevel(logging.INFO)
        logger.addHandler(trace)
    try:
        await run_job(url, out, cfg, marks, polled, timings)
    finally:
        logger.removeHandler(trace)
        logger.setLevel(level)
    first = steps // 3
    (t0, ticks0), (t1, ticks1) = marks[first - 1], marks[-1]
    kv0, kv1 = timings[first - 1].result(), timings[-1].result()
    rows = [orjson.loads(line) for line in (Path(cfg.run.output_dir) / "rollouts.jsonl").read_bytes().splitlines()]
    window = [r for r in rows if r["step"] >= first]
    warmup = [r for r in rows if r["step"] < first]
    before = max((p.preemptions for t, p in polled if t <= t0), default=polled[0][1].preemptions)
    after = max(p.preemptions for _, p in polled)
    usage = [p.usage for t, p in polled if t0 <= t <= t1]  # how full this cap kept the cache
    trained = [r for r in window if r["ok"]]  # a cancelled (kv_pressure) rollout's tokens are work thrown away
    requests = sum(r.get("turns") or 0 for r in window)
    return {"tokens_per_s": sum(r["tokens"] for r in trained) / (t1 - t0),
            "rollouts_per_s": len(trained) / (t1 - t0), "preemptions": after - before,
            "requests": requests, "preemption_rate": (after - before) / max(requests, 1),
            "cancelled": sum(r["failure"] == "kv_pressure" for r in window),
            "warmup_cancelled": sum(r["failure"] == "kv_pressure" for r in warmup),
            "kv_usage_mean": statistics.fmean(usage), "kv_usage_p90": float(np.percentile(usage, 90)),
            "cpu_busy": (ticks1[0] - ticks0[0]) / max(ticks1[1] - ticks0[1], 1),
            "engine_slowdown": (kv1["wall_s"] - kv0["wall_s"]) / max(kv1["modeled_s"] - kv0["modeled_s"], 1e-9),
            **({"cap": trace.summary(t0)} if adaptive else {})}


async def run_job(url: str, out: Path, cfg: JobConfig, marks: list[tuple[float, tuple[int, int]]],
                  polled: list[tuple[float, ServerLoad]], timings: list[asyncio.Task[dict[str, float]]]) -> None:
    """The job, with the reference trainer. Appends, at each step's end, the wall time and CPU ticks to ``marks``
    and a task reading the engine's timing to ``timings``; and the server's load every 0.2 s to ``polled``."""
    from orchestrator.app import Orchestrator
    from orchestrator.trainer.reference import ReferenceTrainer

    async with aiohttp.ClientSession() as http:
        async def poll() -> None:
            while True:
                polled.append((time.perf_counter(), await load(http, url)))
                await asyncio.sleep(0.2)

        async with Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=cfg.run.max_steps,
                                       checkpoint_dir=out / "ckpt")
            async with asyncio.TaskGroup() as tg:
                def step_done(_m: object) -> None:
                    marks.append((time.perf_counter(), cpu_ticks()))
                    timings.append(tg.create_task(kv_timing(http, url)))

                orch.on_step = step_done
                poller = tg.create_task(poll())
                tg.create_task(trainer.run())
                await orch.run()
                poller.cancel()


async def kv_timing(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The sim's engine iterations so far: their modelled durations and the wall time they took (sim/log.py)."""
    async with http.get(url.removesuffix("/v1") + "/sim/log") as resp:
        kv: dict[str, float] = (await resp.json())["kv"]
        return kv


def cpu_ticks() -> tuple[int, int]:
    """The machine's CPU time so far, busy and in all (clock ticks, /proc/stat): near 1 busy over a pass, the
    cores, not the simulated cache, set its pace, and caps that differ only in the cache's use cannot be told
    apart by their throughput."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    settings = [(f"static_{n}", n, False) for n in args.static] + [("adaptive", max(args.static), True)]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in settings}
    caps: list[dict[str, Any]] = []  # the adaptive passes' cap changes (CapTrace.summary)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HOME"] = tmp  # verifiers writes ~/.cache/verifiers
        async with sim_process(kv_flags(args)) as sim:
            for rep in range(args.repeats):
                for name, cap, adaptive in settings:
                    got = await one_pass(sim.url, Path(tmp) / f"{name}-{rep}", args, cap, adaptive)
                    if adaptive:
                        caps.append(summary := got.pop("cap"))
                        print(f"adaptive (pass {rep + 1}): caps {' '.join(map(str, summary['caps']))}; rules "
                              f"{summary['rules']}", file=sys.stderr)
                    results[name].append(got)
                    print(f"{name} (pass {rep + 1}): {got['tokens_per_s']:.0f} tokens/s, "
                          f"{got['rollouts_per_s']:.2f} rollouts/s, preemptions {got['preemptions']} of "
                          f"{got['requests']} requests, {got['cancelled']} rollouts cancelled "
                          f"({got['warmup_cancelled']} in warm-up), KV usage mean {got['kv_usage_mean']:.2f} "
                          f"p90 {got['kv_usage_p90']:.2f}, CPUs {got['cpu_busy']:.0%} busy, engine iterations "
                          f"{got['engine_slowdown']:.2f}x their modelled time", file=sys.stderr)
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    # per setting, each figure's passes in order, then its spread: (max - min) / median
    spread = {name: {k: {"passes": [round(r[k], 4) for r in runs],
                         "spread": round((max(r[k] for r in runs) - min(r[k] for r in runs)) / med[name][k], 3)
                         if med[name][k] else 0.0}
                     for k in ("tokens_per_s", "preemption_rate", "kv_usage_mean", "cpu_busy", "engine_slowdown")}
              for name, runs in results.items()}
    statics = [med[name]["tokens_per_s"] for name, _, adaptive in settings if not adaptive]
    # the best static cap that kept to the preemption budget: what a user tuning by hand for no preemption gets
    unpreempted = {name: med[name]["tokens_per_s"] for name, _, adaptive in settings
                   if not adaptive and med[name]["preemption_rate"] <= PREEMPTION_BUDGET}
    best_unpreempted = max(unpreempted, key=unpreempted.__getitem__, default=None)
    ours = med["adaptive"]
    return {"passes": {n: {k: round(v, 4) for k, v in m.items()} for n, m in med.items()}, "spread": spread,
            "adaptive_to_best_static": round(ours["tokens_per_s"] / max(statics), 3),
            "best_unpreempted_static": best_unpreempted,
            "adaptive_to_best_unpreempted_static": round(ours["tokens_per_s"] / unpreempted[best_unpreempted], 3)
            if best_unpreempted else None,
            # the most any cap within the budget reached, against the best cap of all: the ceiling the first
            # ratio has while steady_preemption_rate keeps to the budget
            "best_unpreempted_to_best_static": round(unpreempted[best_unpreempted] / max(statics), 3)
            if best_unpreempted else None,
            "adaptive_to_worst_static": round(ours["tokens_per_s"] / min(statics), 3),
            "steady_preemption_rate": round(ours["preemption_rate"], 4),
            # rollouts the adaptive cap cancelled in the first third of its passes' steps, summed over passes
            "warmup_cancelled": sum(r["warmup_cancelled"] for r in results["adaptive"]),
            "adaptive_caps": caps,
            "repeats": args.repeats, "step_ms": args.step_ms, "steps": args.steps, "settings": args.setting,
            "machine": machine()}


def machine() -> dict[str, Any]:
    """What the figures were measured on: they are only comparable within one run."""
    return {"cpus": os.cpu_count(), "load_avg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "python": platform.python_version(), "node": platform.node()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--static", type=int, nargs="+", default=[8, 20, 24, 64],
                   help="static caps, in rollouts (default: 8 20 24 64; groups of 4)")
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--batch", type=int, default=32, help="rollouts per step (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per turn (default 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-tokens", type=int, default=8192, help="the sim server's KV cache (tokens; default 8192)")
    p.add_argument("--step-ms", type=float, default=5.0, help="one decode iteration of the sim server: the machine's "
                   "speed (default 5; the targets hold at 2.5 and 10 too)")
    p.add_argument("--prefill-ms-per-1k", type=float, default=50.0, help="(re)computing 1k tokens of context")
    p.add_argument("--set", dest="setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a [scheduler.concurrency] setting for the adaptive passes, as orchestrator run --set "
                        "scheduler.concurrency.KEY=VALUE takes it (e.g. --set trim_above=0.9); repeatable")
    p.add_argument("--quick", action="store_true", help="one repeat of 6 steps: does it run")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:  # a bad --set is said now, not after the static passes
        try:
            job_config("http://127.0.0.1:1/v1", Path(tmp), args, max(args.static), True)
        except ConfigError as e:
            p.error(str(e))
    if args.quick:
        args.repeats, args.steps = 1, 6
    result = run_async(main_async(args))
    if not args.json:
        print(f"adaptive / best static {result['adaptive_to_best_static']}, / worst static "
              f"{result['adaptive_to_worst_static']}, steady preemption rate {result['steady_preemption_rate']}")
    print(json.dumps(with_machine(result)))


if __name__ == "__main__":
    main()
