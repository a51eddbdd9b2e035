"""The interface to one inference server (a Protocol) and its aiohttp implementation for vLLM-compatible HTTP.

The pool owns timeouts, retries and health; an ``InferenceServer`` only makes calls. Calls raise
``InferenceError`` (HTTP status other than 200, refused or dropped connection) or ``MalformedReply``
(a reply that does not match the protocol). Fakes for tests implement the same Protocol.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import aiohttp
import orjson

from orchestrator.errors import InferenceError, MalformedReply
from orchestrator.inference.replies import Generation, parse_generate_reply

GENERATE_PATH = "/inference/v1/generate"
_JSON = {"Content-Type": "application/json"}


class InferenceServer(Protocol):
    """One vLLM-compatible inference server, as the pool uses it."""

    url: str  # OpenAI-style base URL, ending in /v1 (what env workers' clients are given)

    async def generate(self, prompt_ids: Sequence[int], sampling: Mapping[str, Any]) -> Generation:
        """Sample a completion of ``prompt_ids``; the reply is validated strictly."""
        ...

    async def health(self) -> int | None:
        """Raise unless the server is healthy; return the weight version it reports (None: not reported)."""
        ...

    async def call_admin(self, action: str, body: Mapping[str, Any]) -> None:
        """``pause``, ``update_weights`` (body ``{"step", "path"}``) or ``resume``."""
        ...


class HttpInferenceServer:
    """``InferenceServer`` over HTTP with a shared ``aiohttp.ClientSession`` (owned by the caller)."""

    def __init__(self, url: str, session: aiohttp.ClientSession, model: str = "sim-model") -> None:
        self.url = url
        self.root = url.rstrip("/").removesuffix("/v1")
        self.model = model
        self._session = session

    async def generate(self, prompt_ids: Sequence[int], sampling: Mapping[str, Any]) -> Generation:
        params = {k: v for k, v in sampling.items() if k != "model"}
        body = {"model": sampling.get("model", self.model), "token_ids": list(prompt_ids), "sampling_params": params}
        raw = await self._request("POST", GENERATE_PATH, body)
        return parse_generate_reply(raw, len(prompt_ids))

    async def health(self) -> int | None:
        reply = _json_object(await self._request("GET", "/health", None), "/health")
        version = reply.get("weight_version")
        return version if isinstance(version, int) else None

    async def call_admin(self, action: str, body: Mapping[str, Any]) -> None:
        if action not in ("pause", "update_weights", "resume"):
            raise ValueError(f"unknown admin action {action!r}")
        await self._request("POST", "/" + action, dict(body))

    async def _request(self, method: str, path: str, body: Any) -> bytes:
        url = self.root + path
        data = orjson.dumps(body) if body is not None else None
        try:
            async with self._session.request(method, url, data=data, headers=_JSON) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise InferenceError(f"{method} {url}: HTTP {resp.status}: {raw[:200]!r}")
                return raw
        except (aiohttp.ClientError, OSError) as e:
            raise InferenceError(f"{method} {url}: {type(e).__name__}: {e}") from None


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        reply = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise MalformedReply(f"{what} reply is not valid JSON ({len(raw)} bytes)") from None
    if not isinstance(reply, dict):
        raise MalformedReply(f"{what} reply is not a JSON object")
    return reply
