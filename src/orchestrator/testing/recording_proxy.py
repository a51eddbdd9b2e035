"""A loopback HTTP proxy in front of an inference server that keeps what each generate call sent and got back.

``async with RecordingProxy.open(upstream) as proxy:`` serves ``proxy.url`` (``.../v1`` like the upstream's); every
request goes on to ``upstream`` unchanged and every reply comes back unchanged. For each 200 reply of ``POST
/inference/v1/generate`` it keeps a ``Generated``: the prompt's token ids, the first choice's completion and its
``weight_versions`` as the server sent them. A test puts it between a job and a real server to check what the job
made of the replies (the versions column against the server's own spans) without trusting the job's own record.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"})


@dataclass(frozen=True)
class Generated:
    prompt: list[int]
    completion: list[int]
    weight_versions: Any  # as sent (a list of {"version", "start", "end"}; absent before vLLM 0.32: None)


class RecordingProxy:
    def __init__(self, upstream: str) -> None:
        self.root = upstream.removesuffix("/v1")
        self.url = ""
        self.generated: list[Generated] = []
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, upstream: str) -> AsyncIterator[RecordingProxy]:
        proxy = cls(upstream)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", proxy._forward)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            proxy._session = session
            try:
                await web.TCPSite(runner, "127.0.0.1", 0).start()
                proxy.url = f"http://127.0.0.1:{runner.addresses[0][1]}" + upstream[len(proxy.root):]
                yield proxy
            finally:
                await runner.cleanup()

    def by_tokens(self) -> dict[tuple[int, ...], Generated]:
        """Every kept call by its prompt and completion, one after the other."""
        return {(*g.prompt, *g.completion): g for g in self.generated}

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        url = self.root + request.rel_url.path_qs
        async with self._session.request(request.method, url, data=body, headers=headers) as reply:
            raw, status = await reply.read(), reply.status
            content_type = reply.headers.get("Content-Type", "application/json")
        if request.method == "POST" and request.path == "/inference/v1/generate" and status == 200:
            sent, got = orjson.loads(body), orjson.loads(raw)
            choice = got["choices"][0]
            self.generated.append(Generated(list(sent["token_ids"]), list(choice["token_ids"]),
                                            choice.get("weight_versions")))
        return web.Response(body=raw, status=status, headers={"Content-Type": content_type})
