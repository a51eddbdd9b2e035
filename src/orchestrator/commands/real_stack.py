"""``orchestrator real-stack setup|serve``: a real vLLM server and tiny real models here (docs/real-stack.md).

``setup`` makes (or checks: a second run takes seconds) the server's venv for each ``--vllm`` version (default: the
newest, 0.32.0), installs torch into this environment if it lacks it, and builds the tiny dense and MoE models.
``serve`` starts a server on one of them and prints its base URL (for ``[inference] servers``) until interrupted.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from orchestrator.cli import run_async
from orchestrator.realstack.install import (
    DEFAULT_VLLM,
    VLLM_VERSIONS,
    SetupError,
    StackPaths,
    ensure_torch,
    install_server_venv,
)

HELP = "set up a real vLLM server (CPU) and tiny real models on this machine, or serve one"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["setup", "serve"], help="setup: install and build (cached); serve: run a server")
    p.add_argument("--dir", type=Path, default=Path(".real-stack"),
                   help="where the server's venv, the models and the logs live (default: .real-stack)")
    p.add_argument("--vllm", action="append", choices=VLLM_VERSIONS, default=None,
                   help=f"the vLLM version (setup: may repeat, one venv each; default: {DEFAULT_VLLM})")
    p.add_argument("--no-models", action="store_true", help="setup: only the server's venv")
    p.add_argument("--model", default="dense",
                   help="serve: 'dense', 'moe' (the built models) or a model directory (default: dense)")
    p.add_argument("--port", type=int, default=0, help="serve: port (default: a free one)")
    p.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"], default="raw_logprobs",
                   help="serve: which logprobs vLLM reports (default: vLLM's own, raw_logprobs)")
    p.add_argument("--dtype", default="float32", help="serve: the server's dtype (default: float32, exact parity)")
    p.add_argument("--cpus", default=None, help="serve: cores the server may use, e.g. '1' (default: all)")
    p.add_argument("--weight-transfer", choices=["gloo"], default=None,
                   help="serve: take weights over the wire with this engine (--weight-transfer-config; the server "
                        "still reloads checkpoints from disk); default: none")


def main(args: argparse.Namespace) -> int:
    versions = args.vllm or [DEFAULT_VLLM]
    paths = StackPaths(args.dir.resolve(), versions[0])
    try:
        if args.action == "setup":
            setup(paths, versions, models=not args.no_models)
            return 0
        if len(versions) > 1:
            print("real-stack: serve runs one vLLM version: give --vllm once", file=sys.stderr)
            return 2
        return run_async(serve(paths, args))
    except SetupError as e:
        print(f"real-stack: {e}", file=sys.stderr)
        return 1


def setup(paths: StackPaths, versions: list[str], *, models: bool) -> None:
    t0 = time.monotonic()
    for version in dict.fromkeys(versions):
        install_server_venv(paths.with_vllm(version), _progress)
    if models:
        ensure_torch(_progress)
        from orchestrator.realstack.models import KINDS, build_model, built

        for kind in KINDS:
            directory = paths.model(kind)
            if built(directory, kind):
                _progress(f"model {kind}: ready ({directory})")
                continue
            _progress(f"model {kind}: building ...")
            _progress(f"model {kind}: {build_model(directory, kind):,} parameters ({directory})")
    _progress(f"real stack ready in {time.monotonic() - t0:.0f} s: {paths.root}")


async def serve(paths: StackPaths, args: argparse.Namespace) -> int:
    import asyncio

    from orchestrator.realstack.server import ServeOptions, vllm_server

    model = paths.model(args.model) if args.model in ("dense", "moe") else Path(args.model)
    options = ServeOptions(model.resolve(), dtype=args.dtype, logprobs_mode=args.logprobs_mode, cpus=args.cpus,
                           weight_transfer=args.weight_transfer)
    _progress(f"starting vLLM {paths.vllm_version} on {model} (35-60 s; log in {paths.logs}) ...")
    async with vllm_server(paths, options, args.port or None) as server:
        print(server.url, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        while not stop.is_set() and server.running:
            try:
                async with asyncio.timeout(1.0):
                    await stop.wait()
            except TimeoutError:
                pass
        if not server.running:
            print(f"real-stack: the server exited: {server.tail()}", file=sys.stderr)
            return 1
    return 0


def _progress(text: str) -> None:
    print(f"real-stack: {text}", file=sys.stderr, flush=True)
