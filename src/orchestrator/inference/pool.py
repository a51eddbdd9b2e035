"""The inference pool: which server a group runs on, which servers are healthy, and weight sync.

Use (the scheduler)::

    async with InferencePool.open(cfg.inference) as pool, asyncio.TaskGroup() as tg:
        tg.create_task(pool.run())                      # background probes: owned by the caller
        async with pool.lease(group_size) as server:    # or: server = await pool.acquire(n) ... pool.release(server, n)
            gen = await pool.generate(server, prompt_ids, {"max_tokens": 64})
        result = await pool.update_weights(step, path)  # WeightSyncResult(updated, failed)

- **Choice and pinning.** ``lease(n)`` / ``acquire(n)`` pick the in-rotation server with the fewest rollouts
  in flight and count ``n`` more on it until released: a group of ``n`` rollouts leases once, so the whole
  group is pinned to one server (``server.url`` is what its env worker talks to).
- **Health.** ``report_failure`` / ``report_success`` come from whoever talked to the server (the pool's own
  ``generate``, or the scheduler for env workers' calls). ``failures_to_evict`` consecutive failures, or one
  timeout, take a server out of rotation; ``run()`` probes servers out of rotation every ``probe_interval_s``
  and puts them back when ``/health`` answers and they serve the current weights. With no server in rotation,
  ``acquire`` waits (one warning per ``no_server_warn_interval_s`` for the whole pool) and resumes when one
  returns. Every change is logged and counted in ``metrics`` (``evictions``, ``rejoins``, ``failed:<kind>``,
  ``malformed``, ``timeouts``, ``weight_sync_failed``).
- **Weight sync.** ``update_weights(step, path)`` pauses, updates and resumes every server concurrently,
  each call under ``weight_sync_timeout_s``; a server that fails leaves rotation until a probe has brought
  it to the new weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from orchestrator.config import InferenceConfig
from orchestrator.errors import Failure, InferenceError, MalformedReply
from orchestrator.inference.replies import Generation
from orchestrator.inference.server import HttpInferenceServer, InferenceServer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class Server:
    """One inference server as the pool sees it: its client and its health, load and weight version."""

    api: InferenceServer
    in_rotation: bool = True
    inflight: int = 0  # rollouts leased on it
    failures: int = 0  # consecutive
    version: int = 0  # weights it serves: set by a successful sync (a reply's own version is in Generation)
    last_error: str = ""
    sync_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def url(self) -> str:
        return self.api.url


@dataclass
class WeightSyncResult:
    step: int
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # url -> reason


class InferencePool:
    def __init__(self, cfg: InferenceConfig, servers: Sequence[InferenceServer]) -> None:
        if not servers:
            raise ValueError("an inference pool needs at least one server (inference.servers)")
        self.cfg = cfg
        self.servers = [Server(api) for api in servers]
        self._rotation_changed = asyncio.Event()
        self._warned_at = -float("inf")
        self.target_version = 0
        self.target_path: str | None = None
        self.metrics: Counter[str] = Counter()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, cfg: InferenceConfig) -> AsyncIterator[InferencePool]:
        """The pool over ``cfg.servers`` over HTTP, with its own session (closed on exit)."""
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            yield cls(cfg, [HttpInferenceServer(url, session) for url in cfg.servers])

    # ------------------------------------------------------------------------------- choice and pinning

    @contextlib.asynccontextmanager
    async def lease(self, n: int = 1) -> AsyncIterator[Server]:
        """The least-loaded server in rotation, with ``n`` rollouts counted on it until the block exits."""
        server = await self.acquire(n)
        try:
            yield server
        finally:
            self.release(server, n)

    async def acquire(self, n: int = 1) -> Server:
        """Like ``lease`` for a holder that outlives a block (a group): pair with ``release(server, n)``.

        Waits while no server is in rotation; woken by a server rejoining."""
        while True:
            live = [s for s in self.servers if s.in_rotation]
            if live:
                server = min(live, key=lambda s: s.inflight)
                server.inflight += n
                return server
            self._warn_no_server()
            self._rotation_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.no_server_warn_interval_s):  # wait_for can lose a cancel
                    await self._rotation_changed.wait()

    def release(self, server: Server, n: int = 1) -> None:
        server.inflight -= n

    def _warn_no_server(self) -> None:
        now = time.monotonic()
        if now - self._warned_at < self.cfg.no_server_warn_interval_s:
            return
        self._warned_at = now
        self.metrics["no_server_waits"] += 1
        log.warning("no inference server in rotation (%d out: %s); work waits until one returns",
                    len(self.servers), "; ".join(f"{s.url}: {s.last_error}" for s in self.servers))

    # ------------------------------------------------------------------------------------------ health

    def report_success(self, server: Server) -> None:
        server.failures = 0

    def report_failure(self, server: Server, kind: Failure, detail: str, *, evict: bool = False) -> None:
        """Count a failed request; evict the server after ``failures_to_evict`` in a row (or now: ``evict``)."""
        server.failures += 1
        server.last_error = f"{kind}: {detail}"
        self.metrics[f"failed:{kind}"] += 1
        if server.in_rotation and (evict or server.failures >= self.cfg.failures_to_evict):
            self._set_rotation(server, False, f"{server.failures} failure(s) in a row, last: {server.last_error}")

    def _set_rotation(self, server: Server, on: bool, why: str) -> None:
        if server.in_rotation == on:
            return
        server.in_rotation = on
        self.metrics["rejoins" if on else "evictions"] += 1
        if on:
            server.failures = 0
            log.info("inference server %s rejoins rotation (%s)", server.url, why)
        else:
            log.warning("inference server %s leaves rotation: %s", server.url, why)
        self._rotation_changed.set()

    async def run(self) -> None:
        """Probe servers out of rotation every ``probe_interval_s``; consumes nothing, produces rejoins.

        Waits on a timer only. A server answering ``/health`` rejoins if it serves ``target_version``; one that
        answers with other weights is updated first. Runs until cancelled (owned by the caller's TaskGroup)."""
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)
            out = [s for s in self.servers if not s.in_rotation]
            if out:
                await asyncio.gather(*(self._probe(s) for s in out))

    async def _probe(self, server: Server) -> None:
        try:
            probe_timeout_s = min(self.cfg.request_timeout_s, max(5 * self.cfg.probe_interval_s, 1.0))
            version = await self._timed(server.api.health(), probe_timeout_s, f"/health of {server.url}")
            if version is not None and version != self.target_version:
                await self._sync_one(server, self.target_version, self.target_path)
            server.version = self.target_version
            self._set_rotation(server, True, f"healthy on probe, weights of step {server.version}")
        except InferenceError as e:
            server.last_error = str(e)
            log.debug("probe of %s failed: %s", server.url, e)

    @staticmethod
    async def _timed(call: Awaitable[T], timeout_s: float, what: str) -> T:
        try:
            async with asyncio.timeout(timeout_s):
                return await call
        except TimeoutError:
            raise InferenceError(f"{what} took more than {timeout_s:g} s", Failure.TIMEOUT) from None

    # ------------------------------------------------------------------------------------------- calls

    async def generate(self, server: Server, prompt_ids: Sequence[int], sampling: Mapping[str, Any]) -> Generation:
        """One generate call on ``server`` with ``max_retries`` retries on it, each under ``request_timeout_s``.

        Every failure is logged, counted and reported (a timeout evicts at once). Raises the last
        ``InferenceError`` (``MalformedReply`` for a bad reply) when every attempt failed; never anything else
        for a server's misbehaviour."""
        last: InferenceError | None = None
        for _attempt in range(self.cfg.max_retries + 1):
            try:
                gen = await self._timed(server.api.generate(prompt_ids, sampling), self.cfg.request_timeout_s,
                                        f"generate on {server.url}")
            except MalformedReply as e:
                self.metrics["malformed"] += 1
                log.warning("malformed reply from %s: %s", server.url, e)
                self.report_failure(server, e.kind, str(e))
                last = e
            except InferenceError as e:
                timeout = e.kind is Failure.TIMEOUT
                self.metrics["timeouts"] += timeout
                log.warning("generate on %s failed: %s", server.url, e)
                self.report_failure(server, e.kind, str(e), evict=timeout)
                last = e
            else:
                self.report_success(server)
                if gen.weight_version is not None and gen.weight_version != server.version:
                    # sampled before a sync finished, or by a server that lost its weights (restarted)
                    self.metrics["version_mismatch"] += 1
                    log.debug("reply from %s sampled by step %d; pool expects step %d", server.url,
                              gen.weight_version, server.version)
                return gen
            if not server.in_rotation:
                break
        assert last is not None
        raise last

    # ------------------------------------------------------------------------------------- weight sync

    async def update_weights(self, step: int, path: str | None = None) -> WeightSyncResult:
        """Pause, load weights ``step`` (from ``path``) and resume on every server at once.

        A server that fails any of the three calls leaves rotation (and is counted in ``failed``); the probe
        in ``run()`` updates it and brings it back."""
        self.target_version, self.target_path = step, path
        result = WeightSyncResult(step)
        outcomes = await asyncio.gather(*(self._sync_one(s, step, path) for s in self.servers),
                                        return_exceptions=True)
        for server, outcome in zip(self.servers, outcomes, strict=True):
            if isinstance(outcome, InferenceError):
                result.failed[server.url] = str(outcome)
                self.metrics["weight_sync_failed"] += 1
                server.last_error = f"weight sync to step {step} failed: {outcome}"
                self._set_rotation(server, False, server.last_error)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                result.updated.append(server.url)
        if result.failed:
            log.warning("weight sync to step %d failed on %d of %d servers: %s", step, len(result.failed),
                        len(self.servers), result.failed)
        return result

    async def _sync_one(self, server: Server, step: int, path: str | None) -> None:
        """pause, update_weights, resume (resume also after a failed update); one sync per server at a time."""
        t = self.cfg.weight_sync_timeout_s
        async with server.sync_lock:
            try:  # pause inside: a pause cut short (cancelled at shutdown) may still have paused the server
                await self._timed(server.api.call_admin("pause", {}), t, f"pause on {server.url}")
                await self._timed(server.api.call_admin("update_weights", {"step": step, "path": path}), t,
                                  f"update_weights on {server.url}")
            finally:
                await self._timed(server.api.call_admin("resume", {}), t, f"resume on {server.url}")
            server.version = step
