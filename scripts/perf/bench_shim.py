"""What the env worker's shim costs a generate call (workers/shim.py): CPU in the worker process, per call.

A fixed vLLM 0.32-shaped reply (``--tokens`` output tokens with logprobs, ``weight_versions``, and with ``--layers``
> 0 routed experts as vLLM's base64 ``.npy``) is served by a bare aiohttp server in a subprocess. This process is the
env worker: an aiohttp client (verifiers' is httpx; the hop is what is measured) posts ``--calls`` generate requests,
``--concurrency`` at a time, straight to that server (the baseline) or through a ``GenerateShim`` in this process,
which adapts each reply and keeps its versions, as a worker's does. Passes alternate (baseline, shim, baseline, ...)
``--repeats`` times; the medians of this process's CPU seconds per call are compared. ``--json`` prints one JSON
object as the last line.

    .venv/bin/python scripts/perf/bench_shim.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import signal
import statistics
import sys
import time
from typing import Any

import aiohttp
import numpy as np
import orjson

from orchestrator.workers.shim import GenerateShim

PROMPT = list(range(10, 522))


def reply_body(tokens: int, layers: int, top_k: int) -> bytes:
    """A 0.32.0 reply (the key order a real one has) with ``tokens`` output tokens, two version spans."""
    ids = [(7 * i) % 1000 + 3 for i in range(tokens)]
    routed = None
    if layers:
        buf = io.BytesIO()
        np.save(buf, np.random.default_rng(0).integers(0, 64, (len(PROMPT) + tokens - 1, layers, top_k), np.uint8))
        routed = base64.b64encode(buf.getvalue()).decode()
    content = [{"token_id": t, "logprob": -1.25, "rank": 3,
                "top_logprobs": [{"token_id": t, "logprob": -1.25, "rank": 3}]} for t in ids]
    choice = {"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": ids, "routed_experts": routed,
              "sampling_mask": None, "weight_versions": [{"version": "3", "start": 0, "end": tokens // 2},
                                                         {"version": "4", "start": tokens // 2, "end": tokens}],
              "logprobs": {"content": content}}
    return orjson.dumps({"request_id": "generate-tokens-1", "model": "m", "created": 0, "usage": None,
                         "output_mode": "tokens", "choices": [choice]})


def serve(tokens: int, layers: int, top_k: int) -> None:
    """The upstream (child process): one fixed reply; prints its base URL."""
    from aiohttp import web

    body = reply_body(tokens, layers, top_k)

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def main() -> None:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_post("/inference/v1/generate", handler)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        print(f"http://127.0.0.1:{runner.addresses[0][1]}/v1", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())


async def calls(session: aiohttp.ClientSession, root: str, n: int, concurrency: int) -> float:
    """CPU seconds of this process per call, ``n`` calls ``concurrency`` at a time."""
    body = orjson.dumps({"model": "m", "token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "logprobs": 1}})
    url, left = root + "/inference/v1/generate", [n]

    async def loop(session_id: str) -> None:
        while left[0] > 0:
            left[0] -= 1
            async with session.post(url, data=body, headers={"Content-Type": "application/json",
                                                              "X-Session-ID": session_id}) as r:
                assert r.status == 200, r.status
                await r.read()

    t0 = time.process_time()
    async with asyncio.TaskGroup() as tg:
        for i in range(concurrency):
            tg.create_task(loop(f"s{i}"))
    return (time.process_time() - t0) / n


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--serve", "--tokens", str(args.tokens),
                                                "--layers", str(args.layers), "--top-k", str(args.top_k),
                                                stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        upstream = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        direct, shimmed = [], []
        async with GenerateShim.open() as shim, aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=args.concurrency)) as session:
            via = shim.url_for(upstream).removesuffix("/v1")
            await calls(session, via, args.concurrency, args.concurrency)  # warm both paths
            await calls(session, upstream.removesuffix("/v1"), args.concurrency, args.concurrency)
            for _ in range(args.repeats):
                direct.append(await calls(session, upstream.removesuffix("/v1"), args.calls, args.concurrency))
                shimmed.append(await calls(session, via, args.calls, args.concurrency))
                for i in range(args.concurrency):
                    shim.take(f"s{i}")  # as the worker does when a rollout ends
            adapted = shim.counts["adapted"]
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
    d, s = statistics.median(direct), statistics.median(shimmed)
    return {"bench": "shim", "tokens": args.tokens, "layers": args.layers, "top_k": args.top_k,
            "reply_kb": round(len(reply_body(args.tokens, args.layers, args.top_k)) / 1024, 1),
            "calls": args.calls, "repeats": args.repeats, "adapted": adapted,
            "direct_cpu_ms_per_call": round(d * 1e3, 3), "shim_cpu_ms_per_call": round(s * 1e3, 3),
            "added_cpu_ms_per_call": round((s - d) * 1e3, 3), "ratio_to_direct": round(s / d, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512, help="output tokens per reply (default: 512)")
    p.add_argument("--layers", type=int, default=0, help="routed-expert layers; 0: none (default)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--calls", type=int, default=200, help="calls per pass (default: 200)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="interleaved passes of each path (default: 5)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.tokens, args.layers, args.top_k)
        return 0
    out = asyncio.run(bench(args))
    if args.json:
        print(orjson.dumps(out).decode())
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
