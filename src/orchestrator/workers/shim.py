"""``GenerateShim``: a loopback HTTP hop, in the env worker, between verifiers' client and the inference servers.

verifiers 0.4.0 offers no hook for its client (``verifiers/v1/clients/client.py`` ``resolve_client`` is a closed
switch; its interception server sees replies already parsed), but it takes a ``base_url`` per server. The worker
gives it ``url_for(server)``, a base on this shim, which passes every request on to that server unchanged and
every reply back, except a 200 reply of ``POST /inference/v1/generate``:

- it is adapted to what verifiers reads (adapter.py: vLLM 0.32/0.33 logprobs entries, ``.npy`` routed experts);
- the versions it reports (vLLM 0.32+ ``weight_versions``) are kept under the request's ``X-Session-ID`` (verifiers
  sends the rollout's trace id: ``verifiers/v1/interception/server.py``), keyed by where the completion lies in the
  sample (prompt length, completion tokens); ``take(trace_id)`` hands a finished rollout's to the worker, which
  attributes them to the tokens of its samples (``columns.versions.TokenVersions``).

A generate request that vLLM 0.33 refuses because generation is paused (HTTP 503 "Generation is paused. Please
retry after it resumes.", ``v033:v1/engine/core.py`` ``_reject_add_while_paused``; only during an ``abort`` or
``wait`` pause, the orchestrator's own ``keep`` pauses queue requests) is sent again, after 50 ms doubling to 1 s,
until it is accepted or the client gives up: it waits for the resume, as under a keep pause. A server that cannot
be reached, or drops the connection, makes the shim drop the client's connection too, so verifiers sees the same
connection error as without it. The client's own timeouts bound everything (a client that goes away cancels the
upstream request, which vLLM then aborts); the shim adds none.

Bounds: the kept versions of at most MAX_SESSIONS rollouts (least recently used first out: a cancelled rollout's
are never taken), each a few spans per call. Only the worker's own process reaches the shim (127.0.0.1, a port
the kernel picks), and it reaches only the servers the worker was assigned; it adds no credentials of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from orchestrator.columns.versions import CallKey, CallSpans, call_key
from orchestrator.workers.adapter import Reply, Request, adapt_reply

log = logging.getLogger(__name__)

GENERATE = "/inference/v1/generate"
SESSION_HEADER = "X-Session-ID"
MAX_SESSIONS = 4096
PAUSED = b"Generation is paused"  # vLLM 0.33's 503 while paused (abort or wait mode)
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 1.0
OFF_LOOP_BYTES = 1 << 20  # a reply this large is adapted in a thread, not on the worker's loop
# request headers the hop sets itself; response headers that describe the upstream connection or body encoding
_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding",
                  "content-encoding", "upgrade", "te", "trailer", "proxy-connection"})

Calls = dict[CallKey, list[CallSpans]]


class GenerateShim:
    """See the module docstring. ``open()`` serves it; ``url_for(server)`` is the base verifiers is given."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.port = 0
        self.max_sessions = max_sessions
        self.counts: Counter[str] = Counter()  # adapted, retried_paused, upstream_errors, sessions_evicted
        self._upstreams: list[str] = []  # index -> scheme://host:port of a server
        self._index: dict[str, int] = {}
        self._sessions: OrderedDict[str, Calls] = OrderedDict()
        self._adapted: set[int] = set()  # upstreams whose replies needed adapting (logged once each)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, max_sessions: int = MAX_SESSIONS) -> AsyncIterator[GenerateShim]:
        shim = cls(max_sessions)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/u/{index:\\d+}/{tail:.*}", shim._forward)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                         auto_decompress=True) as session:
            shim._session = session
            try:
                await site.start()
                shim.port = runner.addresses[0][1]
                yield shim
            finally:
                await runner.cleanup()

    def url_for(self, server: str) -> str:
        """The base URL verifiers gets for ``server`` (its path kept: ``.../v1`` stays ``.../v1``)."""
        parts = urlsplit(server)
        root = f"{parts.scheme}://{parts.netloc}"
        index = self._index.get(root)
        if index is None:
            index = self._index[root] = len(self._upstreams)
            self._upstreams.append(root)
        return f"http://127.0.0.1:{self.port}/u/{index}{parts.path.rstrip('/')}"

    def take(self, session: str) -> Calls:
        """The versions kept for rollout ``session`` (its trace id), forgotten here."""
        return self._sessions.pop(session, {})

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        """One request of verifiers' client, passed on to its server; the server's reply passed back (a generate
        reply adapted: ``_generated``, in a thread for a large one). Waits on the server; while it refuses a
        generate request because it is paused (0.33), sends it again; the client going away cancels it."""
        index = int(request.match_info["index"])
        if index >= len(self._upstreams):
            return web.json_response({"error": f"no inference server {index} behind this shim"}, status=404)
        tail = "/" + request.match_info["tail"]
        url = self._upstreams[index] + tail + (f"?{request.query_string}" if request.query_string else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        generate = request.method == "POST" and tail == GENERATE
        assert self._session is not None
        delay = RETRY_FIRST_S
        while True:
            try:
                async with self._session.request(request.method, url, data=body, headers=headers) as reply:
                    raw = await reply.read()
                    status, content_type = reply.status, reply.headers.get("Content-Type", "application/json")
            except (aiohttp.ClientError, OSError) as e:
                self.counts["upstream_errors"] += 1
                log.debug("shim: %s %s failed: %s: %s", request.method, url, type(e).__name__, e)
                return _drop(request)
            if not (generate and status == 503 and PAUSED in raw):
                break
            self.counts["retried_paused"] += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
        if generate and status == 200:
            # routed experts of a long reply are megabytes of base64 to convert: then in a thread, not on this loop
            adapted = await asyncio.to_thread(_adapt, body, raw) if len(raw) > OFF_LOOP_BYTES else _adapt(body, raw)
            if adapted is not None:
                raw = self._keep(index, *adapted, request.headers.get(SESSION_HEADER))
        return web.Response(body=raw, status=status, headers={"Content-Type": content_type})

    def _keep(self, index: int, req: Request, reply: Reply, session: str | None) -> bytes:
        """An adapted generate reply's bytes; its versions kept under ``session``."""
        if reply.changed:
            self.counts["adapted"] += 1
            if index not in self._adapted:
                self._adapted.add(index)
                log.info("replies of %s are adapted to what verifiers 0.4.0 reads (vLLM 0.32+ logprobs, or "
                         "routed experts as .npy)", self._upstreams[index])
        if session and reply.spans is not None and reply.token_ids is not None:
            calls = self._sessions.pop(session, None) or {}
            calls.setdefault(call_key(req.prompt_tokens, reply.token_ids), []).append(reply.spans)
            self._sessions[session] = calls  # most recently used last
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
                self.counts["sessions_evicted"] += 1
        return reply.body


def _adapt(body: bytes, raw: bytes) -> tuple[Request, Reply] | None:
    """A generate reply as verifiers reads it (None: the request was not one: passed back as it is)."""
    req = Request.of(body)
    return None if req is None else (req, adapt_reply(raw, req))


def _drop(request: web.Request) -> web.Response:
    """Close the client's connection without an answer: it sees a connection error, as from the server itself."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=502)  # never reaches the client: the connection is gone
