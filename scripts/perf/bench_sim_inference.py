"""Benchmark the simulated inference server: generate requests/s on loopback, against a bare baseline.

Each server runs in its own subprocess (as in the demo); this process is the client, with ``--concurrency``
requests in flight over one aiohttp session, for ``--seconds`` after a short warm-up. The baseline is a bare
aiohttp handler returning a fixed generate-shaped body, measured in the same run the same way, so the ratio
``sim / baseline`` says how much the simulation itself costs. ``--json`` prints one JSON object as the last line.

    .venv/bin/python scripts/perf/bench_sim_inference.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import orjson
from _machine import with_machine

from orchestrator.procs import terminate

PROMPT = list(range(10, 42))
FIXED = orjson.dumps({"choices": [{"index": 0, "token_ids": [5, 6, 7], "finish_reason": "stop", "logprobs": {
    "content": [{"token": f"token_id:{t}", "logprob": -1.0} for t in (5, 6, 7)]}}]})


def serve_baseline() -> None:
    """A bare aiohttp server (child process): one fixed body, prints its base URL like sim-inference."""
    from aiohttp import web

    async def handler(_request: web.Request) -> web.Response:
        await _request.read()
        return web.Response(body=FIXED, content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", handler)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"http://127.0.0.1:{port}/v1", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await runner.cleanup()

    _run(main())


@contextlib.asynccontextmanager
async def server_process(argv: Sequence[str]) -> AsyncIterator[str]:
    """Start a server subprocess that prints its base URL; stop it (SIGTERM, by pid) on exit."""
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        if not line.startswith("http"):
            raise RuntimeError(f"{argv} printed {line!r}, not its address")
        yield line.removesuffix("/v1")
    finally:
        await terminate(proc)


async def measure(root: str, seconds: float, concurrency: int, max_tokens: int) -> dict[str, float]:
    """Requests/s of ``concurrency`` client loops, each posting generate requests back to back."""
    body = orjson.dumps({"model": "sim-model", "token_ids": PROMPT,
                         "sampling_params": {"max_tokens": max_tokens, "logprobs": 1}})
    url = root + "/inference/v1/generate"
    headers = {"Content-Type": "application/json"}
    counts = {"ok": 0, "bad": 0}
    measuring = False

    async def client(session: aiohttp.ClientSession, deadline: float) -> None:
        while time.monotonic() < deadline:
            async with session.post(url, data=body, headers=headers) as resp:
                raw = await resp.read()
            if measuring:
                counts["ok" if resp.status == 200 and raw else "bad"] += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        warm = time.monotonic() + min(0.5, seconds / 4)
        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(client(session, warm))
        measuring = True
        start = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(client(session, start + seconds))
        elapsed = time.monotonic() - start
    return {"requests": counts["ok"], "errors": counts["bad"], "seconds": round(elapsed, 3),
            "requests_per_s": round(counts["ok"] / elapsed, 1)}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    sim_argv = [sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "sim-inference", "--port", "0",
                "--layers", str(args.layers), "--top-k", str(args.top_k)]
    base_argv = [sys.executable, __file__, "--serve-baseline"]
    async with server_process(base_argv) as root:
        baseline = await measure(root, args.seconds, args.concurrency, args.max_tokens)
    async with server_process(sim_argv) as root:
        sim = await measure(root, args.seconds, args.concurrency, args.max_tokens)
    return {"bench": "sim_inference", "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "layers": args.layers, "top_k": args.top_k, "sim": sim, "baseline": baseline,
            "sim_requests_per_s": sim["requests_per_s"], "baseline_requests_per_s": baseline["requests_per_s"],
            "ratio": round(sim["requests_per_s"] / max(baseline["requests_per_s"], 1e-9), 3),
            "target_requests_per_s": 1000, "meets_target": sim["requests_per_s"] >= 1000 and sim["errors"] == 0}


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0, help="measured time per server (default: 3)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens per reply: short replies (default: 8)")
    p.add_argument("--layers", type=int, default=2, help="routed-experts layers (0: none; default: 2)")
    p.add_argument("--top-k", type=int, default=2, help="routed-experts top-k (default: 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--serve-baseline", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_baseline:
        serve_baseline()
        return 0
    result = _run(bench(args))
    print(f"sim server:   {result['sim_requests_per_s']:8.1f} generate requests/s ({result['sim']['errors']} errors)")
    print(f"bare aiohttp: {result['baseline_requests_per_s']:8.1f} requests/s")
    verdict = "met" if result["meets_target"] else "NOT met"
    print(f"ratio sim/baseline: {result['ratio']:.3f}; target >= 1000/s: {verdict}")
    if args.json:
        print(orjson.dumps(with_machine(result)).decode())
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
