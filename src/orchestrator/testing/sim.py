"""Simulated inference servers for tests: in-process (controllable, killable) or as real subprocesses.

- ``sim_cluster(n, profile=..., **server_kwargs)`` starts ``n`` servers playing ``profile`` (``vllm-0.26``,
  ``vllm-0.31``: the default, ``vllm-0.32``, ``vllm-0.33`` or ``prime-rl``) in this process on 127.0.0.1 (free
  ports) and yields a ``SimCluster``: ``cluster.urls``, ``cluster[i]`` (the live ``SimServer``: change ``.faults``, read
  ``.counters``, ``.weights_path``/``.loads`` and ``.log``), ``await cluster.kill(i)`` (the port refuses
  connections, in-flight requests are cut) and ``await cluster.restart(i)`` (a fresh server on the same port:
  no weights loaded, as after a real crash). Every server is stopped on exit.
- ``FakeInferenceServer`` (``orchestrator.testing.fake_server``, re-exported here) implements the
  ``InferenceServer`` Protocol in memory, without HTTP.
- ``sim_servers(n, profile=...)`` is the simpler form yielding the list of ``SimServer``;
  ``sim_process(args, profile=..., dev_mode=...)`` runs ``python -m orchestrator sim-inference --port 0`` as a
  subprocess, reads the printed address and always stops it by its pid (re-exported from
  ``orchestrator.sim.process``, which the demo uses too); its ``GET /sim/log`` says what it saw.
- ``weights_dir(path)`` makes ``path`` a checkpoint directory the simulated servers load (the initial policy, or
  the one given): a directory without weights fails the load and kills the server's engine, as on vLLM.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from orchestrator.policy import Policy
from orchestrator.sim.process import SimProcess, sim_process, sim_servers
from orchestrator.sim.profiles import DEFAULT_PROFILE, PROFILE_NAMES, ProfileName
from orchestrator.sim.server import Faults, SimServer
from orchestrator.testing.fake_server import FakeInferenceServer

__all__ = ["PROFILE_NAMES", "FakeInferenceServer", "Faults", "ProfileName", "SimCluster", "SimProcess", "SimServer",
           "sim_cluster", "sim_process", "sim_servers", "weights_dir"]


@functools.cache
def _initial() -> Policy:
    return Policy.initial()  # 0.2 s to build: once per process


def weights_dir(path: Path, policy: Policy | None = None) -> Path:
    """``path`` (created) holding ``policy``'s weights file (default: the initial policy, which servers start
    with); returns ``path``."""
    (policy or _initial()).save(path)
    return path


class SimCluster:
    """Handles on in-process sim servers; each keeps its URL (host and port) across kill and restart."""

    def __init__(self, kwargs: list[dict[str, Any]]) -> None:
        self._kwargs = kwargs
        self.urls: list[str] = []
        self._servers: list[SimServer | None] = []
        self._runners: list[web.AppRunner | None] = []

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int) -> SimServer:
        server = self._servers[i]
        if server is None:
            raise LookupError(f"sim server {i} ({self.urls[i]}) is killed; restart it first")
        return server

    def set_faults(self, i: int, **faults: Any) -> None:
        """Replace server ``i``'s faults (``Faults`` fields; unnamed ones are off)."""
        self[i].faults = Faults(**faults)

    async def _start(self, i: int, port: int) -> None:
        server = SimServer(**self._kwargs[i])
        # shutdown_timeout 0 means "no limit" in aiohttp 3.14: kill() would wait for held (paused, hung) requests
        runner = web.AppRunner(server.app(), access_log=None, handle_signals=False, shutdown_timeout=0.01)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", port, reuse_address=True)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        server.url = f"http://127.0.0.1:{bound}/v1"
        if i == len(self.urls):
            self.urls.append(server.url)
            self._servers.append(server)
            self._runners.append(runner)
        else:
            self._servers[i], self._runners[i] = server, runner

    async def kill(self, i: int) -> None:
        """Stop server ``i`` now: its hung requests are released, open connections closed, the port refuses."""
        server, runner = self._servers[i], self._runners[i]
        self._servers[i] = self._runners[i] = None
        if server is not None:
            server.release_hung()
            server.transfer.close()  # its gloo connections close, as a crashed process's do
        if runner is not None:
            for conn in runner.server.connections if runner.server is not None else []:
                if conn.transport is not None:
                    conn.transport.abort()  # a crash: clients see the connection reset, not a reply
            await runner.cleanup()

    async def restart(self, i: int) -> SimServer:
        """Start a fresh server ``i`` on its old port (stopping the old one first if it still runs)."""
        await self.kill(i)
        port = urlsplit(self.urls[i]).port
        assert port is not None
        await self._start(i, port)
        return self[i]

    async def close(self) -> None:
        for i in range(len(self.urls)):
            await self.kill(i)


@contextlib.asynccontextmanager
async def sim_cluster(n: int = 1, *, profile: ProfileName = DEFAULT_PROFILE, seed: int = 0,
                      **kwargs: Any) -> AsyncIterator[SimCluster]:
    """Start ``n`` sim servers playing ``profile`` in this process (server ``i`` seeded ``seed + i``); all stop
    on exit. ``kwargs`` are the other ``SimServer`` arguments."""
    cluster = SimCluster([{**kwargs, "profile": profile, "seed": seed + i} for i in range(n)])
    try:
        for i in range(n):
            await cluster._start(i, 0)
        yield cluster
    finally:
        await cluster.close()
