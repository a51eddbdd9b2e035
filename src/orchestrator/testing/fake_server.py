"""An in-memory ``InferenceServer`` (no HTTP) for unit tests of code built on ``InferencePool(cfg, [fake, ...])``.

It answers the admin routes of both backends as the real servers do (``/pause``, ``/resume``, prime-rl's
``/update_weights {"weight_dir"}``, vLLM's ``/collective_rpc reload_weights`` and ``/update_weight_version``),
``/health`` with an empty body, a 2-token ``/inference/v1/generate`` reply (what the pool's probe sends),
``/metrics`` with ``metrics_text`` (404 while it is None), and records every call in ``calls``; ``fail_with``
makes every call raise it, ``fail_paths`` makes calls to those paths raise (before they are recorded: as if
nothing answered), ``hang_paths`` makes calls to those paths wait until ``release()``, ``slow_paths`` answer calls
to those paths after so many seconds.
For HTTP-level fidelity use the simulated server (``orchestrator.testing.sim``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import orjson

from orchestrator.errors import InferenceError
from orchestrator.inference.server import HttpStatusError


class FakeInferenceServer:
    def __init__(self, url: str = "http://fake.invalid/v1") -> None:
        self.url = url
        self.paused = False
        self.weights_path: str | None = None
        self.fail_with: InferenceError | None = None  # set: every call raises it
        self.fail_paths: dict[str, InferenceError] = {}  # path -> what a call to it raises (the call not recorded)
        self.calls: list[tuple[str, str, dict[str, str], Any]] = []  # method, path, query, body
        self.hang_paths: set[str] = set()
        self.slow_paths: dict[str, float] = {}  # path -> seconds before a call to it is answered
        self.metrics_text: str | None = None  # what GET /metrics answers (None: 404, as a server without metrics)
        self._released = asyncio.Event()

    def release(self) -> None:
        """End the hang of every call waiting on ``hang_paths`` (each then raises, as a cut connection does)."""
        self._released.set()
        self._released = asyncio.Event()

    async def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None,
                      body: Any = None) -> bytes:
        if path in self.fail_paths:
            raise self.fail_paths[path]
        self.calls.append((method, path, dict(query or {}), body))
        if self.fail_with is not None:
            raise self.fail_with
        if path in self.hang_paths:
            await self._released.wait()
            raise InferenceError(f"{method} {path}: the connection was cut")
        await asyncio.sleep(self.slow_paths.get(path, 0.0))
        if path == "/inference/v1/generate":
            n = len(body.get("token_ids") or []) if isinstance(body, dict) else 0
            return orjson.dumps({"choices": [{"index": 0, "token_ids": [5, 6], "finish_reason": "length",
                                              "logprobs": {"content": [{"token": "token_id:5", "logprob": -1.0},
                                                                       {"token": "token_id:6", "logprob": -0.5}]}}],
                                 "prompt_token_ids": list(range(n))})
        if path == "/metrics" and self.metrics_text is not None:
            return self.metrics_text.encode()
        if path == "/pause":
            self.paused = True
        elif path == "/resume":
            self.paused = False
        elif path == "/update_weights" and isinstance(body, dict) and "weight_dir" in body:
            self.weights_path = body["weight_dir"]
        elif path == "/collective_rpc" and isinstance(body, dict) and body.get("method") == "reload_weights":
            self.weights_path = body["kwargs"]["weights_path"]
        elif path not in ("/health", "/update_weight_version"):
            raise HttpStatusError(f"{method} {path}: HTTP 404", 404, b'{"detail":"Not Found"}')
        return b"" if path == "/health" else b'{"status":"ok"}'
