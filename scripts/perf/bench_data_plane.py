"""Benchmark: the data plane (issue #20). Column bytes through the orchestrator (``data_plane = "through"``)
against column bytes that stay in the env workers' pools (``"direct"``), in one run, interleaved passes, medians.

Every orchestrator pass is real processes: ``orchestrator run`` (the process measured: its CPU and RSS from
/proc, its loop lag from its own per-step metrics, sampled every 1 ms unless said otherwise), two synthetic env
workers (``orchestrator.testing.synthetic_worker``: the real worker, record path and column pool, with rollouts
of a fixed shape instead of environments and inference) admitted as remote workers, a trainer that takes each
step as zero-copy views (``recv_view``) and acknowledges it, and one simulated inference server the
orchestrator checks at start. Lag is reported over the machine's idle floor: an empty uvloop loop with the same
1 ms monitor, in a probe process during the pass (bench_scheduler.lag_probe). The workers run at local workers'
default niceness (``scheduler.worker_nice = 5``), and so does the trainer, which stands in for another host, as
the simulated server does. Workers pace their rollouts, so every length runs at the same rate and per-second
costs (heartbeats, the lag sampler) weigh the same per rollout.

1. Scaling: rollouts of 1k, 8k and 64k tokens with routed experts 48 x 8 (0.4, 3.2 and 25 MB each), both
   paths: the orchestrator's peak RSS and CPU per rollout. ``rss_ratio_64k_to_1k`` / ``cpu_ratio_64k_to_1k``
   are the direct path's (target <= 1.1 both); ``through_*`` the old path's, same run. These passes sample the
   loop's lag every 100 ms (``monitor.lag_interval_s``'s default), not every 1 ms: a sampler costs CPU of its
   own every second, which the CPU figure would count (at 10 ms its 100 wakeups were most of the orchestrator's
   cost per second). Costs per second (the sampler, heartbeats, timers) weigh the same per rollout only at the
   same rate, so ``rate_ratio_64k_to_1k`` reports the rollouts/s the direct 64k passes achieved over the 1k
   ones' (a warning below 0.95: the CPU ratio then counts those costs over fewer rollouts). A 64k-token rollout
   costs a worker ~4.5 ms of copying; its pool is faulted in when it is made (``--prefault``), as a long-running
   worker's is, since first touching its pages (~350 page faults, 2-3 ms) would fall on the rollouts of a short
   pass and slow the workers further below the rate. ``unwritten_cpu_ratio_64k_to_1k``: the same direct 64k pass
   with workers that write nothing into their spans (``--no-write``): the orchestrator gets the same messages,
   without the workers' 3 GB/s of copying competing for the rate, the cores and the shared cache.
2. 1,024 buffered 64k-token rollouts (direct; one step of 1,024): the orchestrator's peak RSS,
   ``rss_mb_64k_1024`` (target < 300). The workers reserve their spans without writing them
   (``--no-write``): 25 GB of columns do not fit in this machine, and the orchestrator never reads them.
3. Bytes, same node: a 1M-token step with routed experts (393 MB in 128 rollouts) written by the workers into
   their pools, its manifest built, encoded and decoded, and the trainer's views of it, against one memcpy of
   the same bytes: the rollouts' arrays, where they are, copied once into one buffer
   (``same_node_ratio_to_memcpy``, target >= 0.8). Also against one memcpy of a single 393 MB block
   (``same_node_ratio_to_block_memcpy``: its source and destination are one huge-page-backed array each, which
   no rollout's columns are), and with the copy of ``StepView.gather`` added
   (``same_node_gather_ratio_to_memcpy``). Across loopback TCP: ``SpanClient.fetch`` (the reader's) from a
   worker's span server process against raw pyzmq (ROUTER/DEALER, the same frames, ``copy=False``) from a
   process (``tcp_ratio_to_raw``, >= 0.9); the two alternate which goes first.
4. Step boundary under the orchestrator's own load: direct, records at ``--rate`` (1,000 rollouts/s) of 1k
   tokens, steps of ``--step-batch``: ``step_max_lag_over_idle_ms`` (the worst 1 ms lag sample of the measured
   steps over the idle floor, target <= 2) and ``step_wall_ratio_to_idle``: the step's build (its phases
   between the wait for rollouts and the send, which waits for the trainer's window) against the same step at
   ``--idle-rate`` rollouts/s (target <= 1.5).
5. Ceiling: direct, unpaced workers and paced ones at ``--ceiling-rates``: ``max_records_per_s``, the highest
   rate achieved with lag max over the floor <= 5 ms.

    .venv/bin/python scripts/perf/bench_data_plane.py --json
    .venv/bin/python scripts/perf/bench_data_plane.py --repeats 1 --quick --json   # a smoke run, ~3 min
    .venv/bin/python scripts/perf/bench_data_plane.py --sections scale,bytes --json

Progress goes to stderr, one line per pass. Last line with --json: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _machine import with_machine
from bench_scheduler import lag_probe

from orchestrator.cli import run_async
from orchestrator.procs import terminate
from orchestrator.sim.process import sim_process
from orchestrator.testing.synthetic_worker import job_toml as synthetic_job
from orchestrator.testing.synthetic_worker import worker_command

LAYERS, TOP_K = 48, 8
LENGTHS = (1024, 8192, 65536)
TRAINER = """
import sys
import uvloop
from orchestrator.trainer.receiver import BatchReceiver

async def main():
    receiver = BatchReceiver(sys.argv[1])  # each step acknowledged by the next call
    while True:
        await receiver.recv_view()  # views of the workers' pools (direct) or of the frames (through): no copy

uvloop.run(main())
"""
PASS_GUARD_S = 600.0  # a pass takes seconds; this only bounds a hang
NICE = 5  # the default scheduler.worker_nice: what local env workers get
SCALE_LAG_S = 0.1  # the scaling passes' lag sampling: monitor.lag_interval_s's default (see the docstring)
SECTIONS = ("scale", "buffered", "step", "ceiling", "bytes")  # the module docstring's 1, 2, 4, 5, 3; bytes last


@dataclass(frozen=True)
class Pass:
    mode: str  # through | direct
    tokens: int
    rate: float | None  # rollouts/s over both workers; None: as fast as they run
    batch: int
    steps: int
    warm: int = 2  # steps before the measured window
    buffered: int = 0  # scheduler.max_buffered_rollouts (0: 2 x batch)
    write: bool = True
    pool_mb: int = 0  # per worker (0: sized from the shape)
    section: str = ""
    lag_interval_s: float = 0.001
    prefault: bool = False  # the workers fault their pools in when they make them

    @property
    def name(self) -> str:
        rate = "max" if self.rate is None else f"{self.rate:g}/s"
        unwritten = "" if self.write else " unwritten"
        return f"{self.section} {self.mode} {self.tokens // 1024}k x{self.batch} @{rate}{unwritten}"


def rollout_bytes(tokens: int) -> int:
    return tokens * (4 + 1 + 4 + LAYERS * TOP_K)


def job_toml(out: Path, sim_url: str, p: Pass) -> str:
    pool_mb = p.pool_mb or (8 * p.batch + 64) * rollout_bytes(p.tokens) // 2 // 2**20 + 64  # room: no throttling
    monitor = {"lag_interval_s": p.lag_interval_s, "lag_window": 200000, "lag_warn_ms": 1000.0,
               "lag_error_ms": 10000.0}
    return synthetic_job(out, sim_url, data_plane=p.mode, batch=p.batch, steps=p.steps, workers=2, pool_mb=pool_mb,
                         buffered=p.buffered or None, monitor=monitor)


def proc_cpu_s(pid: int) -> float:
    """CPU time of every live thread of ``pid`` (ns resolution: /proc's utime ticks are 10 ms)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def proc_status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


async def wait_for(path: Path, proc: asyncio.subprocess.Process, what: str, timeout_s: float = 120.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not path.exists():  # noqa: ASYNC240 - a stat every 20 ms while nothing is measured
            if proc.returncode is not None:
                raise RuntimeError(f"the orchestrator exited ({proc.returncode}) before {what}")
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def processes(*cmds: list[str], stdout: int = asyncio.subprocess.DEVNULL
                    ) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Start ``cmds`` (stdout discarded unless ``stdout`` says otherwise); each is ended by its pid when the
    block ends."""
    procs = []
    try:
        for cmd in cmds:
            procs.append(await asyncio.create_subprocess_exec(*cmd, stdout=stdout))
        yield procs
    finally:
        for proc in procs:
            await terminate(proc, 10)


async def orchestrator_pass(tmp: Path, sim_url: str, p: Pass, index: int) -> dict[str, Any]:
    """One pass (see the module docstring): the orchestrator's figures over steps ``warm`` .. ``steps - 2``."""
    out = tmp / f"p{index}"
    out.mkdir()
    cfg = out / "job.toml"
    cfg.write_text(job_toml(out, sim_url, p))
    py = [sys.executable, "-m", "orchestrator", "--log-level", "WARNING"]
    workers = [worker_command(f"ipc://{out}/workers.sock", f"syn-{i}", tokens=p.tokens, layers=LAYERS, top_k=TOP_K,
                              rate=None if p.rate is None else p.rate / 2, write=p.write, prefault=p.prefault,
                              seed=i) for i in range(2)]
    metrics = out / "metrics.jsonl"
    async with processes([*py, "run", str(cfg)]) as (orch,):
        await wait_for(out / "workers.sock", orch, "binding its worker address")
        async with processes(*workers, [sys.executable, "-c", TRAINER, f"ipc://{out}/trainer.sock"]) as others, \
                lag_probe(True) as idle:
            for proc in others:  # workers at local workers' niceness (scheduler.worker_nice); the trainer stands
                os.setpriority(os.PRIO_PROCESS, proc.pid, NICE)  # in for another host

            marks: dict[int, tuple[float, float, float]] = {}  # step lines seen -> (wall, cpu, rss)
            async with asyncio.timeout(PASS_GUARD_S):
                while (seen := len(metrics.read_bytes().splitlines()) if metrics.exists() else 0) < p.steps - 1:
                    if orch.returncode is not None:
                        raise RuntimeError(f"the orchestrator exited ({orch.returncode}) in pass {p.name}: "
                                           f"see {out}")
                    if seen not in marks:
                        marks[seen] = (time.perf_counter(), proc_cpu_s(orch.pid), proc_status_mb(orch.pid, "VmRSS"))
                    await asyncio.sleep(0.005)
                end = (time.perf_counter(), proc_cpu_s(orch.pid), proc_status_mb(orch.pid, "VmHWM"))
                await orch.wait()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    first = min(k for k in marks if k >= p.warm)  # p.warm, unless a loaded host's 5 ms polls missed that count
    window = rows[first:p.steps - 1]
    start = marks[first]
    rollouts = sum(m["rollouts"] for m in window)
    lag_max = max(m["lag"]["max"] for m in window)
    build = [sum(v for k, v in m["phase_s"].items() if k not in ("wait", "send")) for m in window]
    return {"pass": p.name, "rollouts": rollouts, "rollouts_per_s": rollouts / (end[0] - start[0]),
            "cpu_ms_per_rollout": (end[1] - start[1]) * 1e3 / rollouts, "peak_rss_mb": end[2],
            "lag_max_ms": lag_max, "lag_p99_ms": max(m["lag"]["p99"] for m in window),
            "idle_max_ms": idle.get("max", 0.0), "lag_max_over_idle_ms": lag_max - idle.get("max", 0.0),
            "step_build_s": statistics.median(build),
            "step_send_s": statistics.median(m["phase_s"]["send"] for m in window)}


def step_samples(tokens: int, rollouts: int, seed: int = 0) -> list[Any]:
    """``rollouts`` distinct one-sample rollouts of ``tokens // rollouts`` tokens with routed experts 48 x 8."""
    import numpy as np

    from orchestrator.columns.samples import Sample

    rng = np.random.default_rng(seed)
    n = tokens // rollouts
    return [Sample(rng.integers(0, 32_000, n, dtype=np.int32), np.ones(n, np.uint8),
                   rng.uniform(-3, 0, n).astype(np.float32),
                   rng.integers(0, 256, (n, LAYERS, TOP_K), dtype=np.uint8)) for _ in range(rollouts)]


async def same_node_bytes(tmp: Path, tokens: int, rollouts: int, repeats: int) -> dict[str, Any]:
    """Section 3, same node: see the module docstring. Medians over ``repeats`` interleaved passes."""
    import numpy as np

    from orchestrator.columns.layout import span_layout
    from orchestrator.columns.memfd import serve_pool
    from orchestrator.columns.store import ColumnStore
    from orchestrator.contracts.manifest import build_manifest, decode_manifest, encode_manifest
    from orchestrator.contracts.protocol import PoolInfo, RolloutHeader, RolloutRecord
    from orchestrator.trainer.reader import PoolMaps

    samples = step_samples(tokens, rollouts)
    span = span_layout(samples[0].num_tokens, LAYERS, TOP_K, "uint8").nbytes
    total = sum(s.token_ids.nbytes + s.loss_mask.nbytes + s.logprobs.nbytes + s.routed_experts.nbytes
                for s in samples)
    block, dst = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8), np.empty(total, np.uint8)
    parts = [a.reshape(-1).view(np.uint8) for s in samples
             for a in (s.token_ids, s.loss_mask, s.logprobs, s.routed_experts)]

    def memcpy_parts() -> None:  # one copy of the same arrays, where they are, into one buffer
        at = 0
        for part in parts:
            dst[at:at + part.size] = part
            at += part.size
    store = ColumnStore(span * rollouts)
    maps = PoolMaps()
    ours, gathered, memcpy, memcpy_block = [], [], [], []
    async with serve_pool(store, str(tmp / "bytes.pool")) as path:
        info = PoolInfo(id=store.id, size=store.capacity, host=socket.gethostname(), path=path)
        headers = [RolloutHeader(rid=f"r{r}", group="g", env="e", task=0, policy_step=0, worker="w", server="s",
                                 ok=True, reward=0.0, samples=[(s.num_tokens, LAYERS, TOP_K)], tokens=s.num_tokens)
                   for r, s in enumerate(samples)]  # a worker makes its headers on either path: not timed
        for i in range(repeats + 1):  # the first pass faults the pool's pages in (and maps it): not measured
            t = time.perf_counter()
            np.copyto(dst, block)
            t0 = time.perf_counter()
            memcpy_parts()
            t1 = time.perf_counter()
            for h, s in zip(headers, samples, strict=True):
                h.span = store.put(h.rid, [s])
            trained = [(RolloutRecord(h, []), 0.5) for h in headers]
            manifest = decode_manifest(encode_manifest(build_manifest("bench", i, trained, {"w": info})))
            view = maps.view(manifest) if i else await asyncio.to_thread(maps.view, manifest)  # i=0 maps the pool
            t2 = time.perf_counter()
            batch = view.gather()
            t3 = time.perf_counter()
            assert batch.columns["token_ids"].size == tokens, "the step's tokens"
            del view, batch
            store.release(h.rid for h in headers)
            if i:
                memcpy_block.append(t0 - t)
                memcpy.append(t1 - t0)
                ours.append(t2 - t1)
                gathered.append(t3 - t1)
    maps.close()
    store.close()
    m, o, g = statistics.median(memcpy), statistics.median(ours), statistics.median(gathered)
    mb = statistics.median(memcpy_block)
    return {"same_node_bytes_mb": round(total / 2**20, 1), "memcpy_gbps": round(total / m / 1e9, 2),
            "memcpy_block_gbps": round(total / mb / 1e9, 2), "same_node_gbps": round(total / o / 1e9, 2),
            "same_node_ratio_to_memcpy": round(m / o, 3), "same_node_ratio_to_block_memcpy": round(mb / o, 3),
            "same_node_gather_ratio_to_memcpy": round(m / g, 3)}


SERVER = """
import asyncio, json, sys
import uvloop, zmq
sys.path.insert(0, sys.argv[4])
from bench_data_plane import step_samples
from orchestrator.trainer.fetch import SpanServer
from orchestrator.columns.layout import span_layout
from orchestrator.columns.store import ColumnStore

kind, tokens, rollouts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
samples = step_samples(tokens, rollouts)
store = ColumnStore(span_layout(samples[0].num_tokens, 48, 8, "uint8").nbytes * rollouts)
spans = [store.put(f"r{i}", [s]) for i, s in enumerate(samples)]
frames = [store.buffer()[s.offset:s.offset + s.nbytes] for s in spans]
if kind == "raw":  # plain pyzmq: a ROUTER answering each request with the same frames, copy=False
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(json.dumps({"address": f"tcp://127.0.0.1:{port}"}), flush=True)
    while True:
        ident, _ = sock.recv_multipart()
        sock.send_multipart([ident, b"ok", *frames], copy=False)
else:
    async def main():
        async with SpanServer.open(store, "tcp://127.0.0.1:0") as server:
            print(json.dumps({"address": server.address, "pool": store.id,
                              "spans": [[s.offset, s.nbytes] for s in spans]}), flush=True)
            await asyncio.Event().wait()
    uvloop.run(main())
"""


async def tcp_bytes(tokens: int, rollouts: int, repeats: int) -> dict[str, Any]:
    """Section 3, across loopback TCP: ``SpanClient.fetch`` from a span server process against raw pyzmq."""
    import zmq

    from orchestrator.trainer.fetch import SpanClient

    here = str(Path(__file__).resolve().parent)  # noqa: ASYNC240 - before anything is measured
    cmds = [[sys.executable, "-c", SERVER, kind, str(tokens), str(rollouts), here] for kind in ("raw", "span")]
    async with processes_piped(*cmds) as (raw_line, span_line):
        raw, span = json.loads(raw_line), json.loads(span_line)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(raw["address"])
        client = SpanClient(ctx)  # what the trainer library's reader fetches with: one connection per worker
        total = sum(n for _, n in span["spans"])

        def raw_pass() -> float:
            t = time.perf_counter()
            dealer.send(b"go")
            got = dealer.recv_multipart(copy=False)
            t = time.perf_counter() - t
            assert sum(len(f.buffer) for f in got[1:]) == total, "bytes received"
            return t

        def fetch_pass() -> float:
            t = time.perf_counter()
            bufs = client.fetch(span["address"], span["pool"], span["spans"], timeout_s=60.0)
            t = time.perf_counter() - t
            assert sum(len(b) for b in bufs) == total, "bytes fetched"
            return t

        ours, base = [], []
        for i in range(repeats + 2):  # the first two passes warm connections and buffers: not measured
            first, second = (raw_pass, fetch_pass) if i % 2 else (fetch_pass, raw_pass)  # neither always first
            a, b = first(), second()
            if i >= 2:
                base.append(a if first is raw_pass else b)
                ours.append(b if first is raw_pass else a)
        dealer.close()
        client.close()
        ctx.term()
    b, o = statistics.median(base), statistics.median(ours)
    return {"tcp_raw_gbps": round(total / b / 1e9, 2), "tcp_fetch_gbps": round(total / o / 1e9, 2),
            "tcp_ratio_to_raw": round(b / o, 3)}


@contextlib.asynccontextmanager
async def processes_piped(*cmds: list[str]) -> AsyncIterator[list[str]]:
    """``processes`` yielding the first stdout line of each (what it says when it is ready)."""
    async with processes(*cmds, stdout=asyncio.subprocess.PIPE) as procs:
        lines = []
        for cmd, proc in zip(cmds, procs, strict=True):
            assert proc.stdout is not None
            async with asyncio.timeout(120):
                line = await proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{cmd[:3]} exited ({await proc.wait()}) before it was ready")
            lines.append(line.decode())
        yield lines


def plan(args: argparse.Namespace) -> dict[str, list[Pass]]:
    """The orchestrator passes of one repeat, by section."""
    lengths = LENGTHS[:2] if args.quick else LENGTHS
    scale = [Pass(mode, n, args.scale_rate, 32, 12, section="scale", lag_interval_s=SCALE_LAG_S,
                  prefault=mode == "direct") for n in lengths for mode in ("direct", "through")]
    scale.append(Pass("direct", lengths[-1], args.scale_rate, 32, 12, section="scale", lag_interval_s=SCALE_LAG_S,
                      write=False))
    buffered_64k = 16 if args.quick else 1024
    buffered = [Pass("direct", 65536, None, buffered_64k, 3, warm=1, buffered=buffered_64k, write=False,
                     pool_mb=4 * buffered_64k * rollout_bytes(65536) // 2 // 2**20 + 64, section="buffered")]
    step = [Pass(mode, 1024, rate, args.step_batch, 10 if rate == args.rate else 5, section="step")
            for mode, rate in (("direct", args.rate), ("direct", args.idle_rate), ("through", args.rate))]
    ceiling = [Pass("direct", 1024, rate, args.step_batch, 10, section="ceiling")
               for rate in [*args.ceiling_rates, None]]
    return {"scale": scale, "buffered": buffered, "step": step, "ceiling": ceiling}


def medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pass name, the median of each figure over the repeats."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by.setdefault(r["pass"], []).append(r)
    return {name: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]
                   if isinstance(rs[0][k], int | float)} for name, rs in by.items()}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    passes = plan(args)
    results: list[dict[str, Any]] = []
    byte_runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bdp-") as tmp:
        async with sim_process(["--seed", "0"]) as sim:
            os.setpriority(os.PRIO_PROCESS, sim.pid, 5)  # it stands in for GPU servers; the sim does no work here
            index = 0
            for rep in range(args.repeats):
                for section in [s for s in SECTIONS[:-1] if s in args.sections]:
                    for p in passes[section]:
                        r = await orchestrator_pass(Path(tmp), sim.url, p, index)
                        index += 1
                        results.append(r)
                        print(f"bench_data_plane: repeat {rep + 1}/{args.repeats} {p.name}: "
                              f"{r['rollouts_per_s']:.0f} rollouts/s, {r['cpu_ms_per_rollout']:.3f} ms CPU each, "
                              f"peak RSS {r['peak_rss_mb']:.0f} MB, lag max {r['lag_max_ms']:.1f} ms "
                              f"(idle {r['idle_max_ms']:.1f}), step build {r['step_build_s'] * 1e3:.1f} ms "
                              f"[{time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
                if "bytes" not in args.sections:
                    continue
                bytes_dir = Path(tmp) / f"bytes{rep}"
                bytes_dir.mkdir()
                byte_runs.append({**await same_node_bytes(bytes_dir, args.step_tokens, 128, 7),
                                  **await tcp_bytes(args.step_tokens, 128, 5)})
                print(f"bench_data_plane: repeat {rep + 1}/{args.repeats} bytes: {byte_runs[-1]}", file=sys.stderr,
                      flush=True)
    return summarize(args, passes, medians(results), byte_runs)


def summarize(args: argparse.Namespace, passes: dict[str, list[Pass]], med: dict[str, dict[str, Any]],
              byte_runs: list[dict[str, Any]]) -> dict[str, Any]:
    def of(p: Pass) -> dict[str, Any]:
        return med[p.name]

    out: dict[str, Any] = {}
    if "scale" in args.sections:
        scale = {(p.mode, p.tokens): of(p) for p in passes["scale"] if p.write}
        lo, hi = min(n for _, n in scale), max(n for _, n in scale)
        for mode, prefix in (("direct", ""), ("through", "through_")):
            out[f"{prefix}rss_ratio_64k_to_1k"] = round(scale[mode, hi]["peak_rss_mb"]
                                                         / scale[mode, lo]["peak_rss_mb"], 3)
            out[f"{prefix}cpu_ratio_64k_to_1k"] = round(scale[mode, hi]["cpu_ms_per_rollout"]
                                                         / scale[mode, lo]["cpu_ms_per_rollout"], 3)
        out["rate_ratio_64k_to_1k"] = round(scale["direct", hi]["rollouts_per_s"]
                                            / scale["direct", lo]["rollouts_per_s"], 3)
        unwritten = next(of(p) for p in passes["scale"] if not p.write)
        out["unwritten_cpu_ratio_64k_to_1k"] = round(unwritten["cpu_ms_per_rollout"]
                                                      / scale["direct", lo]["cpu_ms_per_rollout"], 3)
        if out["rate_ratio_64k_to_1k"] < 0.95:
            print(f"bench_data_plane: warning: the direct {hi // 1024}k passes ran at "
                  f"{out['rate_ratio_64k_to_1k']:.2f} x the 1k ones' rate (the workers did not keep up): "
                  "cpu_ratio_64k_to_1k counts the orchestrator's per-second costs over fewer rollouts",
                  file=sys.stderr, flush=True)
    if "buffered" in args.sections:
        out["rss_mb_64k_1024"] = round(of(passes["buffered"][0])["peak_rss_mb"], 1)
        out["buffered_rollouts"] = passes["buffered"][0].batch
    if "step" in args.sections:
        out.update(step_figures(*(of(p) for p in passes["step"])))
    if "ceiling" in args.sections:
        fits = [of(p)["rollouts_per_s"] for p in passes["ceiling"] if of(p)["lag_max_over_idle_ms"] <= 5.0]
        out["max_records_per_s"] = round(max(fits), 1) if fits else 0.0
    for k in byte_runs[0] if byte_runs else ():
        out[k] = statistics.median(r[k] for r in byte_runs)
    out["repeats"] = args.repeats
    out["passes"] = med
    return out


def step_figures(busy: dict[str, Any], idle: dict[str, Any], through: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["step_max_lag_over_idle_ms"] = round(busy["lag_max_over_idle_ms"], 3)
    out["step_wall_ratio_to_idle"] = round(busy["step_build_s"] / idle["step_build_s"], 3)
    out["step_build_ms"] = round(busy["step_build_s"] * 1e3, 2)
    out["step_build_idle_ms"] = round(idle["step_build_s"] * 1e3, 2)
    out["through_step_max_lag_over_idle_ms"] = round(through["lag_max_over_idle_ms"], 3)
    out["through_step_build_ms"] = round(through["step_build_s"] * 1e3, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every pass (default 3)")
    p.add_argument("--quick", action="store_true", help="1k and 8k only, 16 buffered: a smoke run")
    p.add_argument("--scale-rate", type=float, default=128.0, help="scaling passes: rollouts/s (default 128)")
    p.add_argument("--rate", type=float, default=1000.0, help="step boundary: rollouts/s under load (default 1000)")
    p.add_argument("--idle-rate", type=float, default=128.0, help="step boundary: the idle pass's rate (default 128)")
    p.add_argument("--step-batch", type=int, default=256, help="step boundary and ceiling: batch size (default 256)")
    p.add_argument("--ceiling-rates", type=float, nargs="*", default=[1000.0, 2000.0, 4000.0],
                   help="ceiling: paced rates tried, besides unpaced workers")
    p.add_argument("--step-tokens", type=int, default=1 << 20, help="bytes section: tokens in the step (1M)")
    p.add_argument("--sections", type=lambda t: t.split(","), default=list(SECTIONS),
                   help=f"comma-separated, of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args()
    if unknown := set(args.sections) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(unknown)}; expected some of {','.join(SECTIONS)}")
    result = run_async(main_async(args))
    if not args.json:
        for k, v in result.items():
            if k != "passes":
                print(f"{k}: {v}")
    print(json.dumps(with_machine(result)))


if __name__ == "__main__":
    main()
