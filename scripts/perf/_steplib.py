"""Shared by replay_step.py, bench_step.py and synth_step.py: one step through the orchestrator's own step
pipeline (``orchestrator.steps.phases.StepPipeline``, the object ``app.Orchestrator`` runs every step), phase
by phase, on a loop whose lag is sampled every millisecond, with synthetic background traffic. ``StepRunner``
is the pipeline's host here, as the orchestrator is in a run:

- ``advantage``, ``filter``, ``assemble``: StepBuilder's phases (a worker thread each)
- ``send``: ``BatchSender.send`` (encode + ZMQ over ipc://, on the loop as in the orchestrator), until a real
  ``BatchReceiver`` in a child process (the trainer's side) has decoded the batch
- ``dump``: ``write_dump`` (a worker thread), only when asked
- ``gc``, ``metrics``, ``write``: gc.collect + malloc_trim, ``step_metrics`` (pandas), the two JSONL files
  (a worker thread each)

Off the loop (the default) each blocking phase runs in ``asyncio.to_thread`` as in the orchestrator (its step
thread); ``inline`` runs them on the loop (the baseline). A phase's lag samples are those whose sleep overlapped
it.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import io
import pstats
import random
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from orchestrator.config import JobConfig, load_config, to_toml
from orchestrator.contracts.rows import RolloutRow
from orchestrator.contracts.wire import Batch
from orchestrator.lagmon import LagMonitor, LagStats
from orchestrator.procs import terminate
from orchestrator.steps.boundary import StepBuilder, StepResult
from orchestrator.steps.dump import DumpInfo, ReplayGroup, StepDump, load_dump, write_dump
from orchestrator.steps.outputs import StepOutputs
from orchestrator.steps.phases import StepPipeline
from orchestrator.testing.steps import synthetic_config, synthetic_groups
from orchestrator.transport import BatchSender, encode

T = TypeVar("T")
SETTLE_S = 0.003  # after each phase: lets the lag sampler record a stall the phase caused
DEFAULT_VOCAB = 2**17
THREAD_PHASES = ("advantage", "filter", "assemble", "dump", "gc", "metrics", "write")  # the rest: on the loop


# ------------------------------------------------------------------------------------------------ input


@dataclass
class StepInput:
    """What one replayed step consumes: its finished groups and the pipeline config to build them with."""

    groups: list[ReplayGroup]
    cfg: JobConfig
    vocab_size: int
    step: int = 0
    dump: StepDump | None = None  # set when replaying a dump: its batch is compared with the rebuilt one
    label: str = ""

    @property
    def rollouts(self) -> int:
        return sum(len(g.records) for g in self.groups)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for g in self.groups for r in g.records)


def synthetic_input(rollouts: int, turns: int, tokens: int, layers: int, top_k: int, *, group_size: int = 8,
                    seed: int = 0) -> StepInput:
    groups = synthetic_groups(rollouts, turns, tokens, layers, top_k, group_size=group_size, seed=seed)
    return StepInput(groups, synthetic_config(rollouts, group_size), DEFAULT_VOCAB,
                     label=f"synthetic:{rollouts},{turns},{tokens},{layers},{top_k}")


def dump_input(path: Path) -> StepInput:
    dump = load_dump(path)
    if dump.config_toml is not None:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.toml").write_text(dump.config_toml)
            cfg = load_config(Path(tmp) / "config.toml")
    else:
        cfg = synthetic_config(sum(len(g.records) for g in dump.groups), run=dump.run)
    return StepInput(dump.groups, cfg, dump.vocab_size or DEFAULT_VOCAB, dump.step, dump, label=str(path))


def parse_synthetic(spec: str) -> tuple[int, int, int, int, int]:
    """``synthetic:R,T,N,L,K`` -> (rollouts, turns, tokens per rollout, layers, top_k)."""
    body = spec.removeprefix("synthetic").removeprefix(":")
    parts = [int(x) for x in body.split(",")]
    if len(parts) != 5 or min(parts[:3]) < 1 or min(parts[3:]) < 0:
        raise ValueError(f"expected synthetic:R,T,N,L,K (rollouts, turns, tokens, layers, top_k), got {spec!r}")
    r, t, n, layers, k = parts
    return r, t, n, layers, k


def build_and_dump(inp: StepInput, out: Path) -> tuple[Path, int, Batch]:
    """Build ``inp`` with the real StepBuilder and write it as a dump at ``out`` (synth_step.py)."""
    builder = StepBuilder(inp.cfg.pipeline, inp.cfg.env, inp.cfg.run.name, inp.vocab_size)
    result = builder.build(inp.step, inp.groups)
    info = write_dump(out, inp.step, inp.groups, result.batch, result.rows, run=inp.cfg.run.name,
                      vocab_size=inp.vocab_size, config_toml=to_toml(inp.cfg))
    return info.path, info.nbytes, result.batch


# ------------------------------------------------------------------------------------------ measuring


class TimelineLag(LagMonitor):
    """A LagMonitor that also keeps every sample: wake-up time (perf_counter s), lag, and the loop thread's
    CPU and run-queue wait during it (ms, from LagMonitor's schedstat clock). Never logs."""

    def __init__(self, interval_s: float = 0.001) -> None:
        super().__init__(interval_s, window=1 << 24, warn_ms=1e12, error_ms=1e12)
        self.times: list[float] = []
        self.lags: list[float] = []
        self.cpus: list[float] = []
        self.waits: list[float] = []

    def record(self, lag_ms: float, cpu_ms: float = 0.0, wait_ms: float = 0.0) -> None:
        super().record(lag_ms, cpu_ms, wait_ms)
        self.times.append(time.perf_counter())
        self.lags.append(max(lag_ms, 0.0))
        self.cpus.append(cpu_ms)
        self.waits.append(wait_ms)

    def select(self, spans: Sequence[tuple[float, float]]) -> np.ndarray:
        """Indices of the samples whose sleep (wake - interval - lag .. wake) overlapped any of ``spans``."""
        n = len(self.times)
        t = np.asarray(self.times[:n])
        begin = t - self.interval_s - np.asarray(self.lags[:n]) / 1e3
        m = np.zeros(n, dtype=bool)
        for start, end in spans:
            m |= (begin < end) & (t > start)
        return np.asarray(np.flatnonzero(m), dtype=np.int64)

    def window(self, spans: Sequence[tuple[float, float]]) -> np.ndarray:
        out: np.ndarray = np.asarray(self.lags)[self.select(spans)]
        return out

    def summary(self, spans: Sequence[tuple[float, float]]) -> dict[str, float]:
        """Max and p99 lag over ``spans``, and how the loop thread spent those samples: running (the loop's
        own code: callbacks, background tasks), runnable without a core (a busy host), or neither (blocked:
        waiting for the GIL another thread holds, or idle in the selector)."""
        idx = self.select(spans)
        out = lag_summary(np.asarray(self.lags)[idx])
        if idx.size:
            total = float(np.sum(np.asarray(self.lags)[idx] + self.interval_s * 1e3))
            run = float(np.sum(np.asarray(self.cpus)[idx])) / total
            wait = float(np.sum(np.asarray(self.waits)[idx])) / total
            out.update(loop_run_share=round(min(run, 1.0), 3), loop_runqueue_share=round(min(wait, 1.0), 3),
                       loop_blocked_share=round(max(1.0 - run - wait, 0.0), 3))
        return out


def lag_summary(samples: np.ndarray) -> dict[str, float]:
    if samples.size == 0:
        return {"max_lag_ms": 0.0, "p99_lag_ms": 0.0, "samples": 0}
    return {"max_lag_ms": round(float(samples.max()), 3), "p99_lag_ms": round(float(np.percentile(samples, 99)), 3),
            "samples": int(samples.size)}


def burn(seconds: float) -> None:
    """Hold the CPU (and the GIL) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Traffic:
    """``tasks`` background tasks on the loop; each burns ``burn_ms`` of CPU, then sleeps a seeded
    uniform(``sleep_ms``) ms, until cancelled. Produces nothing; stands in for the scheduler, hub and pool."""

    def __init__(self, tasks: int, burn_ms: float = 0.3, sleep_ms: tuple[float, float] = (0.5, 2.0),
                 seed: int = 0) -> None:
        self.tasks, self.burn_s, self.sleep_ms, self.seed = tasks, burn_ms / 1e3, sleep_ms, seed
        self.bursts = 0

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for i in range(self.tasks):
                tg.create_task(self._one(random.Random(self.seed * 1_000_003 + i)))

    async def _one(self, rng: random.Random) -> None:
        lo, hi = self.sleep_ms
        while True:
            burn(self.burn_s)
            self.bursts += 1
            await asyncio.sleep(rng.uniform(lo, hi) / 1e3)


RECEIVER = """
import asyncio, sys
from orchestrator.transport import BatchReceiver

async def main():
    receiver = BatchReceiver(sys.argv[1])
    print("ready", flush=True)
    while True:
        batch = await receiver.recv()
        assert all(c.shape[0] == batch.num_tokens for c in batch.columns.values())
        print(batch.step, flush=True)

asyncio.run(main())
"""


class ReceiverProcess:
    """The trainer's side, in its own process as a real trainer is: a ``BatchReceiver`` that decodes each
    batch and prints its step; ``run()`` hands each step to ``received`` until the child exits."""

    def __init__(self, address: str, received: asyncio.Queue[int]) -> None:
        self.address, self.received = address, received
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", RECEIVER, self.address,
                                                         stdout=asyncio.subprocess.PIPE)
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        if line.strip() != b"ready":
            raise RuntimeError(f"the receiver process printed {line!r}, not 'ready'")

    async def run(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.received.put_nowait(int(line))
        if await self.proc.wait():
            raise RuntimeError(f"the receiver process exited with {self.proc.returncode}")

    async def stop(self) -> None:
        if self.proc is not None:
            await terminate(self.proc, 5)


# ------------------------------------------------------------------------------------------ the step


@dataclass
class PhaseSpan:
    name: str
    start: float
    end: float
    run: int  # which step run (repeat) it belongs to

    @property
    def wall_s(self) -> float:
        return self.end - self.start


@dataclass
class StepRunner:
    """Runs one input through the phases, as many times as asked (each run sends the next step number)."""

    inp: StepInput
    workdir: Path
    timeline: TimelineLag
    sender: BatchSender
    received: asyncio.Queue[int]
    profile: str | None = None
    spans: list[PhaseSpan] = field(default_factory=list)
    profiles: dict[str, cProfile.Profile] = field(default_factory=dict)
    batch_matches_dump: bool | None = None
    dump_mb: float = 0.0
    runs: int = 0

    _run: int = 0
    _inline: bool = False
    _t0: float = 0.0

    async def step(self, step: int, *, inline: bool = False, dump: bool = False) -> list[PhaseSpan]:
        """One step through every phase (the orchestrator's ``StepPipeline``, with this runner as its host);
        returns its spans (also kept in ``spans``)."""
        self._run, self._inline = self.runs, inline
        self.runs += 1
        first = len(self.spans)
        cfg = self.inp.cfg
        pipeline = StepPipeline(StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, self.inp.vocab_size), self)
        await pipeline.run(step, self._take, dump_to=self.workdir / "dumps" / f"step_{step:06d}" if dump else None)
        if dump:
            await asyncio.to_thread(_remove_tree, self.workdir / "dumps")
        return self.spans[first:]

    # ------------------------------------------------------------- the step pipeline's host (steps/phases.py)

    async def _take(self, step: int) -> tuple[Sequence[Any], Sequence[Any]]:
        self._t0 = time.perf_counter()
        return self.inp.groups, ()

    async def phase(self, name: str, fn: Callable[[], T]) -> T:
        """A blocking phase in a worker thread (``inline``: on the loop), profiled when asked, then SETTLE_S."""
        work = self._profiled(name, fn)
        start = time.perf_counter()
        result = work() if self._inline else await asyncio.to_thread(work)
        self.spans.append(PhaseSpan(name, start, time.perf_counter(), self._run))
        if isinstance(result, DumpInfo):
            self.dump_mb = result.nbytes / 2**20
        await asyncio.sleep(SETTLE_S)
        return result

    async def send(self, batch: Batch) -> bool:
        """``BatchSender.send``, until the receiver process has decoded the batch."""
        prof = self._profiler("send")
        start = time.perf_counter()
        if prof is not None:
            prof.enable()
        try:
            sent = await self.sender.send(batch)
            got = await asyncio.wait_for(self.received.get(), 120)
        finally:
            if prof is not None:
                prof.disable()
        if got != batch.step:
            raise RuntimeError(f"the receiver got step {got}, sent {batch.step}")
        self.spans.append(PhaseSpan("send", start, time.perf_counter(), self._run))
        await asyncio.sleep(SETTLE_S)
        if self.inp.dump is not None and batch.step == self.inp.step and self.batch_matches_dump is None:
            frames = encode(batch)  # outside every phase: not what the orchestrator runs
            self.batch_matches_dump = await asyncio.to_thread(_frames_equal, frames, self.inp.dump.batch_frames)
        return sent

    def sent(self, step: int, result: StepResult[Any], sent: bool) -> dict[str, Any]:
        return {"samples": result.num_samples, "filters": result.filter_counts}

    def lag(self) -> LagStats:
        return _lag_stats(self.timeline.window([(self._t0, time.perf_counter())]))

    async def samples(self, step: int, rows: list[RolloutRow], shown: Sequence[Any]) -> list[dict[str, Any]]:
        return []

    def write(self, step: int, rows: list[RolloutRow], metrics: dict[str, Any],
              samples: list[dict[str, Any]]) -> None:
        StepOutputs(self.workdir).write(rows, metrics)

    def _profiler(self, name: str) -> cProfile.Profile | None:
        if self.profile != name:
            return None
        return self.profiles.setdefault(name, cProfile.Profile())

    def _profiled(self, name: str, fn: Callable[[], T]) -> Callable[[], T]:
        prof = self._profiler(name)
        if prof is None:
            return fn

        def run() -> T:
            prof.enable()  # profiles the thread that runs the phase
            try:
                return fn()
            finally:
                prof.disable()

        return run

    def profile_text(self, top: int = 25) -> str:
        out = io.StringIO()
        for name, prof in self.profiles.items():
            out.write(f"== cProfile of phase {name!r}, top {top} by cumulative time\n")
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
        return out.getvalue()


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _frames_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    if len(a) != len(b):
        return False
    return all(memoryview(x).cast("B") == memoryview(y).cast("B") for x, y in zip(a, b, strict=True))


def _lag_stats(samples: np.ndarray) -> LagStats:
    if samples.size == 0:
        return LagStats(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    q = np.percentile(samples, [0, 50, 90, 99, 100])
    return LagStats(int(samples.size), *(float(x) for x in q))


# ------------------------------------------------------------------------------------------ results


def summarize(spans: Sequence[PhaseSpan], lag: TimelineLag) -> dict[str, Any]:
    """Per phase (wall median over runs, lag over all runs) and for the whole step (wall median per run)."""
    phases: dict[str, Any] = {}
    for name in dict.fromkeys(s.name for s in spans):
        mine = [s for s in spans if s.name == name]
        phases[name] = {"wall_s": round(float(np.median([s.wall_s for s in mine])), 5),
                        **lag.summary([(s.start, s.end) for s in mine])}
    runs = sorted({s.run for s in spans})
    walls = [max(s.end for s in spans if s.run == r) - min(s.start for s in spans if s.run == r) for r in runs]
    whole = lag.summary([(s.start, s.end) for s in spans])
    return {"phases": phases, "max_lag_ms": whole["max_lag_ms"], "p99_lag_ms": whole["p99_lag_ms"],
            "wall_s": round(float(np.median(walls)), 4) if walls else 0.0, "runs": len(runs)}


def plot(path: Path, spans: Sequence[PhaseSpan], lag: TimelineLag, title: str) -> Path:
    """Lag timeline with each phase's span shaded, and a per-phase bar chart (wall ms and max lag ms)."""
    from orchestrator.commands.report import new_figure

    fig = new_figure(figsize=(12, 8), layout="constrained")  # raises with the install command without matplotlib
    from matplotlib import colormaps

    summary = summarize(spans, lag)["phases"]
    names = list(summary)
    colors = {n: colormaps["tab10"](i % 10) for i, n in enumerate(names)}
    t0 = min(s.start for s in spans) - 0.1
    t1 = max(s.end for s in spans) + 0.1
    t = np.asarray(lag.times)
    keep = (t >= t0) & (t <= t1)
    ax1, ax2 = fig.subplots(2, 1, height_ratios=[3, 2])
    seen: set[str] = set()
    for s in spans:
        ax1.axvspan(s.start - t0, s.end - t0, color=colors[s.name], alpha=0.25,
                    label=s.name if s.name not in seen else None)
        seen.add(s.name)
    ax1.plot(t[keep] - t0, np.asarray(lag.lags)[keep], color="black", lw=0.6, label="loop lag")
    ax1.set(xlabel="time (s)", ylabel="loop lag (ms), sampled every 1 ms", title=title)
    ax1.legend(loc="upper right", fontsize=8, ncol=2)
    x = np.arange(len(names))
    ax2.bar(x - 0.2, [summary[n]["wall_s"] * 1e3 for n in names], 0.4, label="wall (ms)",
            color=[colors[n] for n in names])
    ax2.bar(x + 0.2, [summary[n]["max_lag_ms"] for n in names], 0.4, label="max lag (ms)", color="gray")
    ax2.set_xticks(x, names)
    ax2.set_yscale("symlog", linthresh=1.0)
    ax2.set(ylabel="ms")
    ax2.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    return path


@contextlib.asynccontextmanager
async def session(inp: StepInput, workdir: Path, *, traffic: Traffic | None = None, lag_interval_s: float = 0.001,
                  profile: str | None = None) -> AsyncIterator[StepRunner]:
    """A StepRunner with its sender, the receiver process, the lag sampler and the background traffic
    (one TaskGroup owns the sampler, the traffic and the receiver's reader)."""
    lag = TimelineLag(lag_interval_s)
    received: asyncio.Queue[int] = asyncio.Queue()
    async with BatchSender.open(f"ipc://{workdir}/trainer.sock", hwm=2) as sender:
        receiver = ReceiverProcess(sender.address, received)
        try:
            await receiver.start()
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(lag.run()), tg.create_task(receiver.run())]
                if traffic is not None and traffic.tasks:
                    tasks.append(tg.create_task(traffic.run()))
                try:
                    await asyncio.sleep(0.3)  # the receiver connects; the traffic settles
                    yield StepRunner(inp, workdir, lag, sender, received, profile)
                finally:
                    for task in tasks:
                        task.cancel()
        finally:
            await receiver.stop()


def add_traffic_arguments(p: Any) -> None:
    p.add_argument("--burn-ms", type=float, default=0.3, help="background task: CPU burst per wake (default: 0.3)")
    p.add_argument("--sleep-ms", default="0.5,2.0", help="background task: sleep range LO,HI ms (default: 0.5,2.0)")
    p.add_argument("--seed", type=int, default=0, help="seeds synthetic input and traffic (default: 0)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for this run: how long a thread waiting for the GIL waits before "
                        "it asks the holder to drop it (Python's default: 5 ms)")


def traffic_from(args: Any, tasks: int) -> Traffic:
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    lo, hi = (float(x) for x in str(args.sleep_ms).split(","))
    return Traffic(tasks, args.burn_ms, (lo, hi), args.seed)
