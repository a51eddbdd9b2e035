"""A simulated vLLM-compatible inference server: real HTTP on loopback, no GPU.

It speaks the subset of vLLM that verifiers and the orchestrator use:

- ``GET /v1/models`` (with ``max_model_len``), ``GET /health``
- ``POST /inference/v1/generate``: prompt token ids in; sampled token ids, ``token_id:<id>`` logprobs,
  ``finish_reason`` and (with ``layers``/``top_k`` set) base64 ``routed_experts`` ``[rows, layers, top_k]`` out
- ``POST /v1/chat/completions``: plain chat for evaluation clients
- ``POST /pause``, ``POST /update_weights`` (``{"step": int, "path": str}``), ``POST /resume``: while paused,
  generate requests wait (they are not failed)
- ``POST /sim/faults``: change the injected faults at run time (tests)

Every reply names the weight version that produced it, in the ``X-Weight-Version`` header and the
``weight_version`` field. Sampling is deterministic under ``seed`` for a given order of requests: one
generator draws every reply. Tokens come from the built-in tokenizer's vocabulary; the weight version
shifts the token distribution so different policies sample differently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import orjson
import pybase64
from aiohttp import web

from orchestrator.sim.vocab import SimVocab

log = logging.getLogger(__name__)

MALFORMED_KINDS = ("bad_token", "nan_logprob", "bad_routed_shape", "truncated_json")


@dataclass(frozen=True)
class Faults:
    """Injected faults; each rate is the fraction of generate/chat requests it hits."""

    latency_ms: float = 0.0
    latency_max_ms: float | None = None  # set: latency drawn uniformly from [latency_ms, latency_max_ms]
    error_rate: float = 0.0  # HTTP 500
    hang_rate: float = 0.0  # never answered
    malformed_rate: float = 0.0  # one of MALFORMED_KINDS, chosen at random
    drop_rate: float = 0.0  # connection closed without a reply
    down: bool = False  # every endpoint, /health included, answers 503 (a server that is down)


@dataclass
class Counters:
    requests: int = 0
    generated_tokens: int = 0
    errors: int = 0
    hangs: int = 0
    malformed: int = 0
    drops: int = 0
    down: int = 0  # generate/chat requests refused with 503 while ``faults.down`` (health probes are not counted)


class SimServer:
    """The server's state and handlers. ``open()`` serves it on ``host:port`` (port 0: a free one)."""

    def __init__(self, *, model: str = "sim-model", seed: int = 0, layers: int = 0, top_k: int = 0,
                 num_experts: int = 64, max_model_len: int = 4096, faults: Faults = Faults()) -> None:
        if (layers == 0) != (top_k == 0) or not 1 <= num_experts <= 256:
            raise ValueError("set layers and top_k both or neither; num_experts in 1..256")
        self.model = model
        self.layers, self.top_k, self.num_experts = layers, top_k, num_experts
        self.max_model_len = max_model_len
        self.faults = faults
        self.vocab = SimVocab.load()
        self.rng = np.random.default_rng(seed)
        self.version = 0
        self.weights_path: str | None = None
        self.counters = Counters()
        self._running = asyncio.Event()
        self._running.set()
        self._hung: set[asyncio.Future[None]] = set()
        self.url = ""

    # ------------------------------------------------------------------------------------------- serving

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> AsyncIterator[SimServer]:
        """Serve until the block exits; ``server.url`` is the OpenAI-style base URL (ending in ``/v1``)."""
        server = cls(**kwargs)
        runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port, reuse_address=True)
            await site.start()
            sock = site._server.sockets[0]  # type: ignore[union-attr]
            bound_host, bound_port = sock.getsockname()[:2]
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            server.url = f"http://{shown}:{bound_port}/v1"
            yield server
        finally:
            server.release_hung()
            await runner.cleanup()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_post("/update_weights", self.update_weights)
        app.router.add_post("/sim/faults", self.set_faults)
        return app

    def release_hung(self) -> None:
        """Fail every request the server is holding unanswered (on shutdown, or when a test says so)."""
        for fut in self._hung:
            if not fut.done():
                fut.set_exception(ConnectionAbortedError("hung request released"))
        self._hung.clear()

    def _json(self, body: Any, status: int = 200) -> web.Response:
        return web.Response(body=orjson.dumps(body), status=status, content_type="application/json",
                            headers={"X-Weight-Version": str(self.version)})

    # ------------------------------------------------------------------------------------------ handlers

    async def models(self, _request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "owned_by": "sim", "max_model_len": self.max_model_len}
        return self._json({"object": "list", "data": [card]})

    async def health(self, _request: web.Request) -> web.Response:
        if self.faults.down:
            return self._json({"status": "down"}, status=503)
        return self._json({"status": "ok", "weight_version": self.version, "paused": not self._running.is_set()})

    async def pause(self, _request: web.Request) -> web.Response:
        self._running.clear()
        return self._json({"status": "paused", "weight_version": self.version})

    async def resume(self, _request: web.Request) -> web.Response:
        self._running.set()
        return self._json({"status": "running", "weight_version": self.version})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        step = body.get("step") if isinstance(body, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return self._json({"error": "update_weights needs {'step': int >= 0, 'path': str}"}, status=400)
        self.version = step
        self.weights_path = body.get("path")
        log.info("sim server %s: weights updated to step %d", self.url, step)
        return self._json({"status": "ok", "weight_version": self.version})

    async def set_faults(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        try:
            self.faults = replace(self.faults, **body)
        except TypeError as e:
            return self._json({"error": f"unknown fault: {e}"}, status=400)
        return self._json(asdict(self.faults))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("token_ids"), list):
            return self._json({"error": "generate needs {'token_ids': [int, ...], 'sampling_params': {...}}"},
                              status=400)
        fault = await self._fault(request)
        if fault is not None:
            return fault
        await self._running.wait()
        prompt = body["token_ids"]
        sp = body.get("sampling_params") or {}
        ids, logprobs, finish = self._sample(sp, len(prompt))
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": ids.tolist(),
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                     for t, lp in zip(ids.tolist(), logprobs.tolist(), strict=True)]},
            "finish_reason": finish,
        }
        if self.layers:
            start = int(sp.get("routed_experts_prompt_start", body.get("routed_experts_prompt_start", 0)) or 0)
            rows = max(len(prompt) + len(ids) - start, 0)
            experts = self.rng.integers(0, self.num_experts, (rows, self.layers, self.top_k), dtype=np.uint8)
            choice["routed_experts"] = {"data": pybase64.b64encode(experts.tobytes()).decode(),
                                        "shape": [rows, self.layers, self.top_k], "start": start}
        reply = {"request_id": f"sim-{self.counters.requests}", "choices": [choice],
                 "prompt_token_ids": prompt, "weight_version": self.version,
                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}}
        return self._maybe_malformed(reply)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return self._json({"error": "chat/completions needs {'messages': [...]}"}, status=400)
        fault = await self._fault(request)
        if fault is not None:
            return fault
        await self._running.wait()
        ids, _, finish = self._sample(body, 0)
        text = self.vocab.decode(ids)
        return self._json({
            "id": f"chatcmpl-sim-{self.counters.requests}", "object": "chat.completion", "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 0, "completion_tokens": len(ids), "total_tokens": len(ids)},
            "weight_version": self.version,
        })

    # ------------------------------------------------------------------------------------------ sampling

    def _sample(self, sp: dict[str, Any], prompt_len: int) -> tuple[np.ndarray, np.ndarray, str]:
        """Sample up to max_tokens ids (all at once, then cut at the first stop token)."""
        self.counters.requests += 1
        max_tokens = int(sp.get("max_tokens") or sp.get("max_completion_tokens") or 16)
        max_tokens = max(1, min(max_tokens, self.max_model_len - prompt_len))
        temperature = float(sp.get("temperature", 1.0))
        probs = self.vocab.distribution(self.version, temperature)
        ids = self.rng.choice(probs.size, size=max_tokens, p=probs)
        stops = set(sp.get("stop_token_ids") or []) | {self.vocab.eos_id}
        hit = np.flatnonzero(np.isin(ids, list(stops)))
        finish = "length"
        if hit.size:
            ids = ids[: hit[0] + 1]
            finish = "stop"
        logprobs = np.log(probs[ids]).astype(np.float64)
        self.counters.generated_tokens += int(ids.size)
        return ids.astype(np.int64), logprobs, finish

    # ------------------------------------------------------------------------------------------- faults

    async def _fault(self, request: web.Request) -> web.StreamResponse | None:
        """Apply latency, then maybe a 500, a hang or a dropped connection (None: answer normally)."""
        f = self.faults
        if f.down:
            self.counters.down += 1
            return self._json({"error": "server is down"}, status=503)
        if f.latency_ms or f.latency_max_ms:
            hi = f.latency_max_ms if f.latency_max_ms is not None else f.latency_ms
            await asyncio.sleep(float(self.rng.uniform(f.latency_ms, hi)) / 1e3)
        roll = float(self.rng.random())
        if roll < f.error_rate:
            self.counters.errors += 1
            return self._json({"error": "injected server error"}, status=500)
        roll -= f.error_rate
        if roll < f.hang_rate:
            self.counters.hangs += 1
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._hung.add(fut)
            await fut  # answered never; released with an error at shutdown
        roll -= f.hang_rate
        if roll < f.drop_rate:
            self.counters.drops += 1
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)  # never reaches the client: the connection is gone
        return None

    def _maybe_malformed(self, reply: dict[str, Any]) -> web.Response:
        if self.faults.malformed_rate <= 0 or float(self.rng.random()) >= self.faults.malformed_rate:
            return self._json(reply)
        self.counters.malformed += 1
        kind = MALFORMED_KINDS[int(self.rng.integers(len(MALFORMED_KINDS)))]
        choice = reply["choices"][0]
        content = choice["logprobs"]["content"]
        if kind == "bad_token" and content:
            content[0]["token"] = "tok:" + content[0]["token"]
        elif kind == "nan_logprob" and content:
            content[0]["logprob"] = "__nan__"  # orjson writes no NaN: patched into the bytes below
        elif kind == "bad_routed_shape":
            choice["routed_experts"] = {"data": "AAAA", "shape": [9999, max(self.layers, 1), max(self.top_k, 1)],
                                        "start": 0}
        else:
            body = orjson.dumps(reply, option=orjson.OPT_SERIALIZE_NUMPY)
            return web.Response(body=body[: len(body) // 2], content_type="application/json",
                                headers={"X-Weight-Version": str(self.version)})
        body = orjson.dumps(reply).replace(b'"__nan__"', b"NaN")
        return web.Response(body=body, content_type="application/json", headers={"X-Weight-Version": str(self.version)})


async def _read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except ConnectionResetError:  # the client gave up (timeout, cancelled rollout): nothing to answer
        raise web.HTTPBadRequest(text="client went away") from None
    if not raw:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise web.HTTPBadRequest(text="request body is not valid JSON") from None
