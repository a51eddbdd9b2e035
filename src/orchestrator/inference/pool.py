"""The inference pool: which server a group runs on, which servers are healthy, and weight sync.

- **Choice and pinning.** ``async with pool.lease(n) as server:`` picks the in-rotation server with the
  fewest rollouts in flight and counts ``n`` more on it until the block exits: a group of ``n`` rollouts
  leases once, so the whole group is pinned to one server.
- **Health.** ``report_failure`` / ``report_success`` come from whoever talked to the server (the pool's
  own ``generate`` or env workers). ``failures_to_evict`` consecutive failures take a server out of
  rotation; ``run()`` probes servers out of rotation every ``probe_interval_s`` and puts them back when
  ``/health`` answers and they serve the current weights. With no server in rotation, ``lease`` waits
  (one warning per ``no_server_warn_interval_s``) and resumes when one returns.
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from orchestrator.config import InferenceConfig
from orchestrator.errors import InferenceError, MalformedReply
from orchestrator.inference.replies import Generation, parse_generate_reply

log = logging.getLogger(__name__)


@dataclass
class Server:
    """One inference server as the pool sees it."""

    url: str  # OpenAI-style base URL, ending in /v1
    in_rotation: bool = True
    inflight: int = 0
    failures: int = 0  # consecutive
    version: int = 0  # weights it serves, as far as the pool knows
    last_error: str = ""

    @property
    def root(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


@dataclass
class WeightSyncResult:
    step: int
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # url -> reason


class InferencePool:
    def __init__(self, cfg: InferenceConfig, session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.servers = [Server(url) for url in cfg.servers]
        self._session = session
        self._rotation_changed = asyncio.Event()
        self.target_version = 0
        self.metrics: Counter[str] = Counter()  # evictions, rejoins, failures by reason, malformed...

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, cfg: InferenceConfig) -> AsyncIterator[InferencePool]:
        """The pool with its own HTTP session (closed on exit)."""
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            yield cls(cfg, session)

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
        """Like ``lease`` for a holder that outlives a block (a group): pair with ``release``."""
        server = await self._choose()
        server.inflight += n
        return server

    def release(self, server: Server, n: int = 1) -> None:
        server.inflight -= n

    async def _choose(self) -> Server:
        warned_at = -float("inf")
        while True:
            live = [s for s in self.servers if s.in_rotation]
            if live:
                return min(live, key=lambda s: s.inflight)
            now = time.monotonic()
            if now - warned_at >= self.cfg.no_server_warn_interval_s:
                log.warning("no inference server in rotation (%d out: %s); work waits until one returns",
                            len(self.servers), "; ".join(f"{s.url}: {s.last_error}" for s in self.servers))
                warned_at = now
            self._rotation_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rotation_changed.wait(), self.cfg.no_server_warn_interval_s)

    # ------------------------------------------------------------------------------------------ health

    def report_success(self, server: Server) -> None:
        server.failures = 0

    def report_failure(self, server: Server, reason: str) -> None:
        """Count a failed request; evict the server after ``failures_to_evict`` in a row."""
        server.failures += 1
        server.last_error = reason
        self.metrics[f"failed:{reason.split(':')[0]}"] += 1
        if server.in_rotation and server.failures >= self.cfg.failures_to_evict:
            self._set_rotation(server, False, f"{server.failures} failures in a row, last: {reason}")

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

        A server answering ``/health`` rejoins if it serves ``target_version``; one that answers with older
        weights is updated first. Runs until cancelled (owned by the caller's TaskGroup)."""
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)
            out = [s for s in self.servers if not s.in_rotation]
            if out:
                await asyncio.gather(*(self._probe(s) for s in out))

    async def _probe(self, server: Server) -> None:
        try:
            health = await self._call(server, "GET", "/health", None, self.cfg.probe_interval_s * 5)
            version = health.get("weight_version", server.version)
            if version != self.target_version:
                await self._sync_one(server, self.target_version, None)
            server.version = self.target_version
            self._set_rotation(server, True, "healthy on probe")
        except (InferenceError, TimeoutError) as e:
            server.last_error = str(e)

    # ------------------------------------------------------------------------------------------- calls

    async def _call(self, server: Server, method: str, path: str, body: Any, timeout_s: float) -> Any:
        url = server.root + path
        data = orjson.dumps(body) if body is not None else None
        try:
            async with asyncio.timeout(timeout_s), self._session.request(
                method, url, data=data, headers={"Content-Type": "application/json"}
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise InferenceError(f"{method} {url}: HTTP {resp.status}: {raw[:200]!r}")
                return orjson.loads(raw) if path != "/inference/v1/generate" else raw
        except TimeoutError:
            raise InferenceError(f"timeout: {method} {url} took more than {timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise InferenceError(f"connection: {method} {url}: {type(e).__name__}: {e}") from None
        except orjson.JSONDecodeError:
            raise MalformedReply(f"{method} {url}: reply is not valid JSON") from None

    async def generate(self, server: Server, prompt_ids: list[int], sampling: dict[str, Any]) -> Generation:
        """One generate call on ``server`` with ``max_retries`` retries; failures are counted and reported.

        Raises InferenceError (or MalformedReply) when every attempt failed."""
        body = {"model": sampling.get("model", "sim-model"), "token_ids": prompt_ids,
                "sampling_params": {k: v for k, v in sampling.items() if k != "model"}}
        last: InferenceError | None = None
        for _attempt in range(self.cfg.max_retries + 1):
            try:
                raw = await self._call(server, "POST", "/inference/v1/generate", body, self.cfg.request_timeout_s)
                gen = parse_generate_reply(raw, len(prompt_ids))
            except MalformedReply as e:
                self.metrics["malformed"] += 1
                log.warning("malformed reply from %s: %s", server.url, e)
                self.report_failure(server, f"malformed: {e}")
                last = e
            except InferenceError as e:
                log.warning("generate on %s failed: %s", server.url, e)
                self.report_failure(server, str(e))
                last = e
            else:
                self.report_success(server)
                if gen.weight_version is not None:
                    server.version = gen.weight_version
                return gen
            if not server.in_rotation:
                break
        assert last is not None
        raise last

    # ------------------------------------------------------------------------------------- weight sync

    async def update_weights(self, step: int, path: str | None = None) -> WeightSyncResult:
        """Pause, load weights ``step`` (from ``path``) and resume on every server at once."""
        self.target_version = step
        result = WeightSyncResult(step)
        outcomes = await asyncio.gather(*(self._sync_one(s, step, path) for s in self.servers),
                                        return_exceptions=True)
        for server, outcome in zip(self.servers, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, InferenceError | TimeoutError):
                    raise outcome
                result.failed[server.url] = str(outcome)
                server.last_error = f"weight sync to step {step} failed: {outcome}"
                self._set_rotation(server, False, server.last_error)
            else:
                server.version = step
                result.updated.append(server.url)
        if result.failed:
            log.warning("weight sync to step %d failed on %d of %d servers: %s", step, len(result.failed),
                        len(self.servers), result.failed)
        return result

    async def _sync_one(self, server: Server, step: int, path: str | None) -> None:
        t = self.cfg.weight_sync_timeout_s
        await self._call(server, "POST", "/pause", {}, t)
        try:
            await self._call(server, "POST", "/update_weights", {"step": step, "path": path}, t)
        finally:
            await self._call(server, "POST", "/resume", {}, t)
