"""``orchestrator sim-inference``: serve the simulated inference server until interrupted.

``--profile`` picks the real server it plays (vllm-0.26, vllm-0.31, vllm-0.32, vllm-0.33, prime-rl);
``--no-dev-mode`` plays a vLLM started without ``VLLM_SERVER_DEV_MODE=1`` (no admin routes), ``--no-scale-out``
one started without ``--enable-scale-out`` (0.31: no generate route; 0.32+: 403). ``GET /sim/log`` on the
printed address's root says what the server saw. Like a real vLLM, the process exits (status 1) shortly after
its engine dies: a weight load failed, then a request reached the engine (``orchestrator.sim.engine``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from orchestrator.cli import run_async
from orchestrator.sim.config import SimConfig

HELP = "run the simulated inference server, playing vLLM or prime-rl (prints its base URL on stdout)"
DEAD_EXIT_S = 1.0  # how long the process outlives its engine (a real vLLM 0.31: ~1-3 s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from orchestrator.sim.kv import KVModel
    from orchestrator.sim.policy import LOGPROBS_MODES
    from orchestrator.sim.profiles import DEFAULT_PROFILE, PROFILE_NAMES

    d = SimConfig()
    p.add_argument("--profile", choices=PROFILE_NAMES, default=DEFAULT_PROFILE,
                   help=f"the real server to play (default: {DEFAULT_PROFILE})")
    p.add_argument("--dev-mode", action=argparse.BooleanOptionalAction, default=d.dev_mode,
                   help="vLLM profiles: serve the admin routes, as VLLM_SERVER_DEV_MODE=1 does (default: on)")
    p.add_argument("--scale-out", action=argparse.BooleanOptionalAction, default=d.scale_out,
                   help="vLLM 0.31+ profiles: serve POST /inference/v1/generate, as --enable-scale-out does "
                   "(default: on; --no-scale-out plays a server started without it: 0.31 404, 0.32+ 403)")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=d.logprobs_mode,
                   help="which logprobs replies report, as vLLM's --logprobs-mode: raw_logprobs (the log-softmax of "
                   "the unscaled logits; vLLM's default) or processed_logprobs (those of the distribution "
                   f"sampled from) (default: {d.logprobs_mode})")
    p.add_argument("--weight-transfer", choices=["gloo"], default=None,
                   help="receive weights over the wire with this engine, as vLLM started with --weight-transfer-config "
                        "does (0.31+ profiles; needs torch); default: none")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)")
    p.add_argument("--model", default="sim-model", help="model name served (default: sim-model)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of sampling and faults")
    p.add_argument("--policy-seed", type=int, default=None,
                   help="start from another tiny policy, drawn from this seed (a teacher for on-policy distillation; "
                   "default: the initial policy every simulated server starts from)")
    p.add_argument("--layers", type=int, default=d.layers, help="MoE layers of routed experts (0: none)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts per token of routed experts")
    p.add_argument("--num-experts", type=int, default=d.num_experts,
                   help="experts per layer (<= 65535; above 256: uint16 ids)")
    p.add_argument("--latency-ms", type=float, default=d.latency_ms, help="added latency per request")
    p.add_argument("--latency-max-ms", type=float, default=None, help="upper end of a random latency range")
    p.add_argument("--error-rate", type=float, default=0.0, help="fraction of requests answered with HTTP 500")
    p.add_argument("--hang-rate", type=float, default=0.0, help="fraction of requests never answered")
    p.add_argument("--malformed-rate", type=float, default=0.0, help="fraction of malformed replies")
    p.add_argument("--drop-rate", type=float, default=0.0, help="fraction of connections dropped")
    p.add_argument("--record-replies", action="store_true",
                   help="keep each reply's token ids and routed experts in GET /sim/log (tests; memory grows)")
    p.add_argument("--max-model-len", type=int, default=4096, help="context length on the model card (default: 4096)")
    kv = KVModel(capacity_tokens=4096)
    p.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="simulate a KV cache of this many tokens: replies take as long as continuous batching under "
                   "it decodes them, preempting when it is full, and GET /metrics shows the load (default: off; "
                   "at least --max-model-len)")
    p.add_argument("--kv-block-tokens", type=int, default=kv.block_tokens, help="tokens per KV block (default: 16)")
    p.add_argument("--kv-max-running", type=int, default=kv.max_running,
                   help=f"requests decoded at once, vLLM's max_num_seqs (default: {kv.max_running})")
    p.add_argument("--kv-step-ms", type=float, default=kv.step_ms,
                   help=f"one decode iteration, a token for every running request (default: {kv.step_ms})")
    p.add_argument("--kv-prefill-ms-per-1k", type=float, default=kv.prefill_ms_per_1k,
                   help=f"added to an iteration per 1k context tokens (re)computed (default: {kv.prefill_ms_per_1k})")


def main(args: argparse.Namespace) -> int:
    from orchestrator.sim.kv import KVModel
    from orchestrator.sim.server import Faults

    for name in ("error_rate", "hang_rate", "malformed_rate", "drop_rate"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            print(f"sim-inference: --{name.replace('_', '-')} must be within [0, 1]", file=sys.stderr)
            return 2
    if (args.layers == 0) != (args.top_k == 0):
        print("sim-inference: set --layers and --top-k both (routed experts) or neither", file=sys.stderr)
        return 2
    if not 1 <= args.num_experts <= 65535 or args.top_k > args.num_experts:
        print("sim-inference: --num-experts must be within [1, 65535] and at least --top-k", file=sys.stderr)
        return 2
    kv = None
    if args.kv_capacity_tokens is not None:
        try:
            kv = KVModel(args.kv_capacity_tokens, args.kv_block_tokens, args.kv_max_running, args.kv_step_ms,
                         args.kv_prefill_ms_per_1k)
        except ValueError as e:
            print(f"sim-inference: {e}", file=sys.stderr)
            return 2
        if kv.capacity_tokens < args.max_model_len:
            print(f"sim-inference: --kv-capacity-tokens {kv.capacity_tokens} cannot hold one request of "
                  f"--max-model-len {args.max_model_len}", file=sys.stderr)
            return 2
    faults = Faults(latency_ms=args.latency_ms, latency_max_ms=args.latency_max_ms, error_rate=args.error_rate,
                    hang_rate=args.hang_rate, malformed_rate=args.malformed_rate, drop_rate=args.drop_rate)
    return run_async(_serve(args, faults, kv))


async def _serve(args: argparse.Namespace, faults: object, kv: object) -> int:
    from orchestrator.sim.server import SimServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with SimServer.open(args.host, args.port, profile=args.profile, dev_mode=args.dev_mode, model=args.model,
                              seed=args.seed, layers=args.layers, top_k=args.top_k, num_experts=args.num_experts,
                              faults=faults, record_replies=args.record_replies, scale_out=args.scale_out,
                              logprobs_mode=args.logprobs_mode, max_model_len=args.max_model_len, kv=kv,
                              policy_seed=args.policy_seed, weight_transfer=args.weight_transfer) as server:
        print(server.url, flush=True)
        if await _first_set(stop, server.engine.died) is server.engine.died:
            # the real process exits a second or three after its engine died (observed on vLLM 0.31.0); until
            # then its API server answers (/health 503, generate 500): so does this one
            await asyncio.sleep(DEAD_EXIT_S)
            print("sim-inference: its engine died (a weight load failed, then a request reached it); exiting, as "
                  "vLLM does", file=sys.stderr)
            return 1
    return 0


async def _first_set(*events: asyncio.Event) -> asyncio.Event:
    """The first of ``events`` to be set (every wait has ended before this returns)."""
    async with asyncio.TaskGroup() as tg:
        waits = {tg.create_task(e.wait()): e for e in events}
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
    return waits[next(iter(done))]
