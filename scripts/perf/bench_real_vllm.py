"""Benchmark the orchestrator against a real vLLM: does it keep a server as busy as a direct client does, and what
does a weight sync cost over vLLM's own reload?

One real vLLM server (the real stack's dense model, float32) on core 1 only (``taskset`` and vLLM's OpenMP
binding); this process and everything it starts on core 0. So the ratio measures whether the orchestrator keeps
the server busy, as on a GPU fleet where the server's compute is not ours, and not who wins the CPU.

- **Throughput**, ``--repeats`` interleaved pairs:
  - *direct*: a minimal client (aiohttp on one loop) sends the arithmetic taskset's prompts, rendered with the
    model's chat template, straight to ``/inference/v1/generate``: ``--group-size`` requests per task,
    ``--inflight`` at once, ``--max-tokens`` sampled tokens each (``ignore_eos``), ``--rollouts`` in all;
  - *orchestrator*: ``orchestrator run`` (2 env workers, the same prompts, sampling and in-flight bound, steps of
    ``--batch-size``) with ``orchestrator receive`` as the trainer (no checkpoints: no weight syncs), as real
    processes; its rate is the steady state: the rollouts and wall time of every step after the first.
  ``ratio_to_direct`` = median orchestrator rollouts/s over median direct rollouts/s (target >= 0.9).
- **Weight sync**, ``--syncs`` interleaved pairs: the orchestrator's ``InferencePool.update_weights`` (checks the
  checkpoint, pause keep, ``reload_weights``, ``update_weight_version``, resume) against the bare
  ``POST /collective_rpc reload_weights`` of the same directory; ``sync_overhead_ms`` = the difference of the
  medians (target <= 50).

Needs the real stack (``bash scripts/real-stack.sh``). ``--json`` prints one JSON object as the last line.

    .venv/bin/python scripts/perf/bench_real_vllm.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from _machine import with_machine

from orchestrator.config import load_config
from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.envs.arithmetic import problems
from orchestrator.inference.pool import InferencePool
from orchestrator.realstack.install import StackPaths
from orchestrator.realstack.server import ServeOptions, vllm_server
from orchestrator.testing.procs import orchestrator_process
from orchestrator.testing.real_job import RealJob

SERVER_CPU, OWN_CPU = "1", 0


def prompts(model: Path, n: int) -> list[list[int]]:
    """The arithmetic taskset's first ``n`` prompts as the env workers send them: the chat template's rendering."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for prompt, _ in itertools.islice(problems(), n):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        out.append(list(tok.encode(str(text), add_special_tokens=False)))
    return out


async def direct_pass(url: str, tasks: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """``args.rollouts`` generate requests, ``args.group_size`` per task, at most ``args.inflight`` at once."""
    gate = asyncio.Semaphore(args.inflight)
    tokens = 0
    root = url.removesuffix("/v1")

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        nonlocal tokens
        body = {"model": "tiny", "token_ids": prompt, "cache_salt": "0",
                "sampling_params": {"max_tokens": args.max_tokens, "temperature": 1.0, "logprobs": 1,
                                    "ignore_eos": True}}
        async with gate, session.post(root + "/inference/v1/generate", json=body) as reply:
            data = await reply.json()
            if reply.status != 200:
                raise RuntimeError(f"direct client: HTTP {reply.status}: {data}")
            tokens += len(prompt) + len(data["choices"][0]["token_ids"])

    n_tasks = -(-args.rollouts // args.group_size)
    jobs = [p for p in tasks[:n_tasks] for _ in range(args.group_size)][:args.rollouts]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in jobs))
        wall = time.perf_counter() - t0
    return {"rollouts_per_s": len(jobs) / wall, "tokens_per_s": tokens / wall, "wall_s": wall}


async def orchestrator_pass(url: str, model: Path, root: Path, args: argparse.Namespace) -> dict[str, float]:
    """A job of ``args.steps`` steps as real processes; the steady state after its first step."""
    out = Path(tempfile.mkdtemp(prefix="orch-", dir=root))
    job = RealJob(out, model, (url,), steps=args.steps, envs=("arith",), batch_size=args.batch_size,
                  max_inflight=args.inflight, group_size=args.group_size, max_tokens=args.max_tokens, workers=2,
                  max_async_level=args.steps, sampling={"extra_body": {"ignore_eos": True}},
                  pipeline={"gates": []})  # as recorded: groups of equal rewards are filtered
    path = out / "job.toml"
    path.write_text(job.config_text())
    cpu0 = _children_cpu_s()
    async with orchestrator_process("receive", job.trainer_address, "--no-announce", "--steps", str(args.steps)), \
            orchestrator_process("run", str(path)) as run:
        code = await asyncio.wait_for(run.wait(), 900)
    if code != 0:
        raise RuntimeError(f"orchestrator run exited with {code} ({out})")
    rows = [orjson.loads(line) for line in (out / "out" / "metrics.jsonl").read_bytes().splitlines()]
    steady = rows[1:]
    wall = sum(r["wall_s"] for r in steady)
    rollouts = sum(r["rollouts"] for r in steady)
    # the CPU of every process of the pass (orchestrator, env workers, trainer; start-up included) per rollout
    cpu_ms = (_children_cpu_s() - cpu0) * 1e3 / sum(r["rollouts"] for r in rows)
    return {"rollouts_per_s": rollouts / wall, "tokens_per_s": sum(r["tokens"] for r in steady) / wall, "wall_s": wall,
            "cpu_ms_per_rollout": cpu_ms}


def _children_cpu_s() -> float:
    """User + system CPU of this process's ended children (and theirs, once waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def sync_pairs(url: str, model: Path, root: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Interleaved: the pool's whole weight sync, and the bare reload call, of the same checkpoint directory."""
    job = RealJob(root / "sync", model, (url,))
    job.out.mkdir(parents=True, exist_ok=True)
    (job.out / "job.toml").write_text(job.config_text())
    cfg = load_config(job.out / "job.toml")
    out: dict[str, list[float]] = {"pool_ms": [], "reload_ms": []}
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(model)}}
    async with InferencePool.open(cfg.inference, "tiny") as pool, aiohttp.ClientSession() as session:
        for i in range(args.syncs):
            t0 = time.perf_counter()
            result = await pool.update_weights(Checkpoint(i + 1, str(model)))
            out["pool_ms"].append((time.perf_counter() - t0) * 1e3)
            if result.failed:
                raise RuntimeError(f"weight sync failed: {result.failed}")
            t0 = time.perf_counter()
            async with session.post(url.removesuffix("/v1") + "/collective_rpc", json=body) as reply:
                await reply.read()
                if reply.status != 200:
                    raise RuntimeError(f"reload_weights: HTTP {reply.status}")
            out["reload_ms"].append((time.perf_counter() - t0) * 1e3)
    return out


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    os.sched_setaffinity(0, {OWN_CPU})  # this process and every child it starts: core 0
    paths = StackPaths(args.stack.resolve())
    model = paths.model("dense")
    tasks = prompts(model, -(-args.rollouts // args.group_size))
    options = ServeOptions(model, cpus=SERVER_CPU)
    direct: list[dict[str, float]] = []
    orch: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-real-vllm-") as tmp:
        root = Path(tmp)
        async with vllm_server(paths, options) as server:
            await direct_pass(server.url, tasks[:4], argparse.Namespace(**{**vars(args), "rollouts": 32}))  # warm
            for r in range(args.repeats):
                for kind in (("direct", "orch") if r % 2 == 0 else ("orch", "direct")):
                    if kind == "direct":
                        direct.append(await direct_pass(server.url, tasks, args))
                        row = direct[-1]
                    else:
                        orch.append(await orchestrator_pass(server.url, model, root, args))
                        row = orch[-1]
                    print(f"repeat {r} {kind}: {row['rollouts_per_s']:.1f} rollouts/s, "
                          f"{row['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
            syncs = await sync_pairs(server.url, model, root, args)
    pool_ms, reload_ms = statistics.median(syncs["pool_ms"]), statistics.median(syncs["reload_ms"])
    return {
        "direct_rollouts_per_s": round(med(direct, "rollouts_per_s"), 2),
        "orchestrator_rollouts_per_s": round(med(orch, "rollouts_per_s"), 2),
        "direct_tokens_per_s": round(med(direct, "tokens_per_s"), 1),
        "orchestrator_tokens_per_s": round(med(orch, "tokens_per_s"), 1),
        "ratio_to_direct": round(med(orch, "rollouts_per_s") / med(direct, "rollouts_per_s"), 3),
        # the orchestrator side's CPU per rollout, and the share of its one core that rate needs: near 1, the side
        # is CPU-bound (verifiers in the env workers), not waiting on the server
        "orchestrator_side_cpu_ms_per_rollout": round(med(orch, "cpu_ms_per_rollout"), 1),
        "orchestrator_side_core_use": round(med(orch, "cpu_ms_per_rollout") * med(orch, "rollouts_per_s") / 1e3, 2),
        "sync_ms": round(pool_ms, 2), "reload_ms": round(reload_ms, 2),
        "sync_overhead_ms": round(pool_ms - reload_ms, 2),
        "repeats": args.repeats, "syncs": args.syncs,
        "passes": {"direct": direct, "orchestrator": orch},
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stack", type=Path, default=Path(".real-stack"), help="the real stack (default: .real-stack)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved direct/orchestrator pairs (default: 3)")
    p.add_argument("--rollouts", type=int, default=512, help="rollouts of a direct pass (default: 512)")
    p.add_argument("--steps", type=int, default=5, help="steps of an orchestrator pass (default: 5)")
    p.add_argument("--batch-size", type=int, default=128, help="rollouts per step (default: 128)")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per task (default: 8)")
    p.add_argument("--inflight", type=int, default=64, help="requests in flight, both ways (default: 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="sampled tokens per rollout (default: 64)")
    p.add_argument("--syncs", type=int, default=9, help="interleaved weight-sync pairs (default: 9)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    result = asyncio.run(main(args))
    for key in ("direct_rollouts_per_s", "orchestrator_rollouts_per_s", "ratio_to_direct", "sync_ms", "reload_ms",
                "sync_overhead_ms"):
        print(f"{key}: {result[key]}", file=sys.stderr)
    if args.json:
        print(orjson.dumps(with_machine(result)).decode())
