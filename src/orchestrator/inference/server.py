"""The interface to one inference server (a Protocol) and its aiohttp implementation.

An ``InferenceServer`` only makes calls; the pool owns timeouts, health and rotation, the weight-sync
backends (weights.py) know which calls a server kind takes, preflight (preflight.py) checks a server before
a run. ``request`` raises ``InferenceError`` for a refused or dropped connection or an HTTP status other
than 200 (``kind`` PROVIDER; ``status`` holds the HTTP status, None for no answer). Fakes for tests
implement the same Protocol (``orchestrator.testing.fake_server.FakeInferenceServer``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

import aiohttp
import orjson

from orchestrator.errors import InferenceError

_JSON = {"Content-Type": "application/json"}


class HttpStatusError(InferenceError):
    """The server answered with an HTTP status other than 200."""

    def __init__(self, message: str, status: int, body: bytes) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class InferenceServer(Protocol):
    """One vLLM-compatible inference engine, as the orchestrator uses it."""

    url: str  # OpenAI-style base URL, ending in /v1 (what env workers' clients are given)

    async def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None,
                      body: Any = None) -> bytes:
        """``method`` ``path`` (relative to the server's root, e.g. ``/pause``) with a JSON ``body``; the reply's
        bytes when the status is 200, else HttpStatusError (an InferenceError if nothing answered)."""
        ...


class HttpInferenceServer:
    """``InferenceServer`` over HTTP with a shared ``aiohttp.ClientSession`` (owned by the caller)."""

    def __init__(self, url: str, session: aiohttp.ClientSession, api_key: str | None = None) -> None:
        self.url = url
        self.root = url.rstrip("/").removesuffix("/v1")
        self._session = session
        self._headers = {**_JSON, **({"Authorization": f"Bearer {api_key}"} if api_key else {})}

    async def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None,
                      body: Any = None) -> bytes:
        url = self.root + path
        data = orjson.dumps(body) if body is not None else None
        try:
            async with self._session.request(method, url, params=query, data=data, headers=self._headers) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise HttpStatusError(f"{method} {url}: HTTP {resp.status}: {raw[:300]!r}", resp.status, raw)
                return raw
        except (aiohttp.ClientError, OSError) as e:
            raise InferenceError(f"{method} {url}: {type(e).__name__}: {e}") from None


def api_key(env_var: str | None) -> str | None:
    """The servers' API key from ``inference.api_key_env`` (None when unset or empty)."""
    return os.environ.get(env_var) or None if env_var else None
