"""Start a real vLLM server on a model of the real stack, wait until it answers, stop it by its pid.

``async with vllm_server(paths, ServeOptions(model_dir)) as server:`` serves ``server.url`` (``.../v1``) until the
block exits; ``await server.kill()`` ends it at once (SIGKILL: a crash) and ``await server.start()`` starts it again
on the same port. The command line is the one REAL-VLLM.md checked on CPUs:

``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --host 127.0.0.1 --port P --served-model-name NAME --dtype float32
--enforce-eager --enable-scale-out --logprobs-mode MODE --generation-config vllm``

- dev mode: the pause, resume, ``collective_rpc`` (``reload_weights``) and ``/server_info`` routes;
- ``--enable-scale-out``: without it 0.31 has no ``/inference/v1/generate`` route (404), the one env workers use;
- ``--enforce-eager``: no torch.compile (a start takes 35-60 s instead of 54-230 s);
- ``--generation-config vllm``: the model directory's sampling defaults do not override what a request leaves
  unset;
- ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE=30``: vLLM closes an idle connection after 5 s, exactly when verifiers' httpx
  pool (keepalive expiry 5 s) may still pick it for a request, which then fails as "Connection error." (the likely
  cause of a lone such failure in a CI run of the demo, after a weight sync had left the connections idle); with a
  longer server keep-alive the client always drops an idle connection first;
- ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) and, with ``cpus``, ``taskset`` plus ``VLLM_CPU_OMP_THREADS_BIND``
  so the server computes on those cores only (the benchmark gives it one core, everything else the other);
- with ``weight_transfer`` (``"gloo"``), ``--weight-transfer-config '{"backend": "gloo"}'``: it receives weights
  over the wire from the trainer (``orchestrator.transfer``, installed in the server's venv by the setup), and
  still reloads checkpoints from disk.

The server runs in a process group of its own (API server, engine core and worker processes), all ended by its
pid's group; the API server is asked for SIGKILL when its parent dies, so a crashed test leaves no server behind.
It stays in its starter's session and runs at nice NICE: a GPU server does not compute on the orchestrator's cores,
and a CPU one that does should not starve it. In a session of its own (``setsid``) it was a scheduling group of its
own where the kernel groups by session (``kernel.sched_autogroup_enabled``, on in our CI machines), which took half
the CPUs whatever the orchestrator needed: its event loop waited up to 4.5 s for a core
(tests/real/test_vllm_concurrency.py, where timely polls and dispatch are the subject).
Its output goes to ``DIR/logs/vllm-PORT.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from orchestrator.procs import PR_SET_PDEATHSIG
from orchestrator.realstack.install import SetupError, StackPaths

NICE = 5  # the server's niceness: the job's own processes come first
START_TIMEOUT_S = 300.0  # a cold start on a loaded 2-core machine; a warm one takes 35-60 s
SERVED_NAME = "tiny"


@dataclass(frozen=True)
class ServeOptions:
    """How to serve a model (the defaults: exact float32 parity, vLLM's default raw logprobs)."""

    model_dir: Path
    name: str = SERVED_NAME
    dtype: str = "float32"
    logprobs_mode: str = "raw_logprobs"  # vLLM's default; "processed_logprobs": the sampled distribution's
    scale_out: bool = True  # --enable-scale-out
    max_model_len: int = 2048
    kv_cache_gib: float = 1.0
    cpus: str | None = None  # e.g. "1": the cores the server may use (taskset and OpenMP binding)
    weight_transfer: str | None = None  # e.g. "gloo": a weight transfer engine (weights over the wire)
    extra: tuple[str, ...] = ()  # more `vllm serve` arguments
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, paths: StackPaths, port: int) -> list[str]:
        argv = [str(paths.vllm), "serve", str(self.model_dir), "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", self.name, "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--enforce-eager", "--logprobs-mode", self.logprobs_mode, "--generation-config", "vllm",
                "--enable-scale-out" if self.scale_out else "--no-enable-scale-out", *self.extra]
        if self.weight_transfer is not None:
            argv += ["--weight-transfer-config", json.dumps({"backend": self.weight_transfer})]
        return ["taskset", "-c", self.cpus, *argv] if self.cpus else argv

    def environment(self, paths: StackPaths) -> dict[str, str]:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CACHE_ROOT": str(paths.cache),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "30",
               **self.env}
        if self.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        env.pop("PYTHONPATH", None)  # the server's venv, not ours
        return env


class VLLMServer:
    """One real vLLM server process group (see the module docstring)."""

    def __init__(self, paths: StackPaths, options: ServeOptions, port: int | None = None) -> None:
        if not paths.vllm.exists():
            raise SetupError(f"no vLLM in {paths.venv}: run `orchestrator real-stack setup --dir {paths.root}` "
                             "(or bash scripts/real-stack.sh) first")
        self.paths = paths
        self.options = options
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = paths.logs / f"vllm-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the server (again, on the same port) and wait until ``/health`` answers 200; SetupError naming
        the log when it exits or does not answer in time."""
        if self.running:
            raise RuntimeError(f"vLLM server {self.url} is already running")
        self._spawn()
        try:
            await self._wait_healthy(timeout_s)
        except BaseException:
            await self.kill()
            raise

    def _spawn(self) -> None:
        """Start the process group. On this thread, not a worker thread's: the parent-death signal fires when the
        thread that started the child ends."""
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        argv = self.options.argv(self.paths, self.port)
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== start {self.starts + 1}: {' '.join(argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, process_group=0,
                                         env=self.options.environment(self.paths), preexec_fn=_in_child)
        self.starts += 1

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                if not self.running:
                    code = self.proc.returncode if self.proc else None
                    raise SetupError(f"vLLM server on port {self.port} exited with {code} while starting: "
                                     f"{self.tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(self.root + "/health") as reply:
                        if reply.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise SetupError(f"vLLM server on port {self.port} did not answer /health within "
                                     f"{timeout_s:.0f} s: {self.tail()}")
                await asyncio.sleep(0.5)

    async def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """End the server's process group (SIGKILL: a crash; SIGTERM: vLLM's own shutdown, SIGKILL after 30 s)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), 30.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
        with contextlib.suppress(ProcessLookupError):  # the engine core and worker, if they outlived the API server
            os.killpg(proc.pid, signal.SIGKILL)

    def tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log_path})"
        return f"the end of {self.log_path}:\n  " + "\n  ".join(text)


@contextlib.asynccontextmanager
async def vllm_server(paths: StackPaths, options: ServeOptions, port: int | None = None) -> AsyncIterator[VLLMServer]:
    """A started server, killed with its process group on exit."""
    server = VLLMServer(paths, options, port)
    try:
        await server.start()
        yield server
    finally:
        await server.kill(signal.SIGTERM)


async def start_all(servers: Sequence[VLLMServer]) -> None:
    """Start several servers at once (each start is mostly waiting for imports and the engine)."""
    async with asyncio.TaskGroup() as tg:
        for s in servers:
            tg.create_task(s.start())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _in_child() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies (Linux), and a lower priority than
    the job's own processes (NICE)."""
    import ctypes

    os.nice(NICE)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
