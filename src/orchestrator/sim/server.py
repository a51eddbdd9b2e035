"""A simulated inference server that plays a real one (``profiles.py``): real HTTP on loopback, no GPU.

Routes, for every profile (its differences are in ``profiles.py``, ``admin.py`` and ``replies.py``):

- ``GET /health`` (200, empty body; 503 empty when down), ``GET /v1/models`` (``max_model_len`` on the card),
  ``GET /version``, ``POST /tokenize`` (the built-in tokenizer)
- ``POST /inference/v1/generate``: token ids in; sampled ids, logprobs, ``finish_reason``, ``usage`` and (with
  ``layers``/``top_k`` set) routed experts out; with ``sampling_params.prompt_logprobs`` each prompt token's raw
  logprob too (a teacher's scoring, replies.py)
- ``POST /v1/chat/completions``: plain chat for evaluation clients
- the profile's admin routes (``admin.py``): pause, resume, weight loads
- ``POST /sim/faults`` (change ``Faults`` at run time) and ``GET /sim/log`` (what the server saw: ``log.py``);
  no real server has these, and they are never faulted

No reply carries a weight version a real server would not send (no header, no ``weight_version`` field):
``weights_path`` and ``loads`` are the server's own record, for tests. Sampling is ``SimPolicy.sample``,
deterministic under ``seed`` for a given order of requests; injected faults draw from a separate generator, so
turning them on does not change the tokens of requests that still succeed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from orchestrator.policy import Policy
from orchestrator.sim import replies
from orchestrator.sim.admin import ADMIN_PATHS, admin_routes
from orchestrator.sim.engine import Engine, LoadFailed, dead_error, load_error_message, sanitize
from orchestrator.sim.gate import Gate
from orchestrator.sim.kv import KVLoad, KVModel
from orchestrator.sim.kv_process import KVProcess
from orchestrator.sim.log import AdminCall, Counters, GenerateCall, SimLog
from orchestrator.sim.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from orchestrator.sim.metrics import exposition
from orchestrator.sim.policy import Experts, SimPolicy, logprobs_mode_named
from orchestrator.sim.profiles import DEFAULT_PROFILE, get_profile
from orchestrator.sim.requests import GenerateRequest, SamplingParams, parse_generate
from orchestrator.sim.responses import (
    Refusal,
    empty_response,
    engine_error,
    error_body,
    fastapi_errors,
    json_response,
    model_not_found,
    read_json,
    read_json_body,
    validation_error,
)
from orchestrator.sim.segments import Generation
from orchestrator.sim.transfer import SimTransfer
from orchestrator.sim.vocab import SimVocab

log = logging.getLogger(__name__)

MAX_EXPERTS = 65535  # expert ids travel as uint16 above 256 experts
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
SCALE_OUT_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."


@dataclass(frozen=True)
class Faults:
    """Injected faults; each rate is the fraction of generate/chat requests it hits."""

    latency_ms: float = 0.0
    latency_max_ms: float | None = None  # set: latency drawn uniformly from [latency_ms, latency_max_ms]
    error_rate: float = 0.0  # HTTP 500
    hang_rate: float = 0.0  # never answered
    malformed_rate: float = 0.0  # one of replies.MALFORMED_KINDS, chosen at random
    drop_rate: float = 0.0  # connection closed without a reply
    down: bool = False  # every route but /sim/* answers 503 (/health with an empty body)
    hold: bool = False  # admitted generate/chat requests stay in flight (generating) until it is turned off
    transfer_stall: bool = False  # its weight transfer engine joins groups but receives nothing: a rank gone silent


class SimServer:
    """The server's state and handlers. ``open()`` serves it on ``host:port`` (port 0: a free one).

    - ``profile``: the real server played, one of ``profiles.PROFILE_NAMES`` (ValueError otherwise);
    - ``dev_mode``: vLLM profiles serve their admin routes only with it (``VLLM_SERVER_DEV_MODE=1``);
      prime-rl's server always has its own and never runs in dev mode, so it ignores this;
    - ``scale_out``: False plays a server started without ``--enable-scale-out``, on the profiles that have
      that flag (0.31: no generate route, 404; 0.32+: 403 ``PermissionDeniedError``); others ignore it;
    - ``logprobs_mode``: vLLM's ``--logprobs-mode``, ``raw_logprobs`` (its default) or ``processed_logprobs``:
      which logprobs replies report (policy.py); vLLM profiles in dev mode say it in ``GET /server_info``;
    - ``model``: the served name (other names: 404); ``max_model_len``: on the model card, and the
      default ``max_tokens`` is what remains of it after the prompt;
    - ``layers``/``top_k``/``num_experts`` (<= 65535): routed experts in replies when ``layers`` is set;
    - ``seed``: sampling, routing and faults are deterministic under it for a given order of requests;
    - ``policy_seed``: start from ``Policy.seeded(policy_seed)`` instead of ``Policy.initial()`` (another model:
      a teacher for on-policy distillation, which scores samples with ``sampling_params.prompt_logprobs``);
    - ``faults``: injected faults (assign ``server.faults`` to change them while it runs);
    - ``kv``: a KV-cache model (kv.py): generate replies then take as long as the engine needs to decode them
      under that capacity, preempting when it is full, in a process of its own (kv_process.py);
      ``kv_time_scale`` scales its clock. None: replies are answered after their injected latency alone.
    - ``weight_transfer``: ``"gloo"`` plays a server started with ``--weight-transfer-config '{"backend":
      "gloo"}'``: it receives weights over the wire (transfer.py; needs torch); None: without one.

    ``weights_path``/``loads`` say what was loaded, ``log``/``counters`` what the server saw, ``gate`` its
    pause state (tests wait on ``gate.wait_until``).
    """

    def __init__(self, *, profile: str = DEFAULT_PROFILE, dev_mode: bool = True, model: str = "sim-model",
                 seed: int = 0, layers: int = 0, top_k: int = 0, num_experts: int = 64, max_model_len: int = 4096,
                 faults: Faults = Faults(), record_replies: bool = False, scale_out: bool = True,
                 logprobs_mode: str = "raw_logprobs", kv: KVModel | None = None, kv_time_scale: float = 1.0,
                 policy_seed: int | None = None, weight_transfer: str | None = None) -> None:
        if (layers == 0) != (top_k == 0):
            raise ValueError("set layers and top_k both (routed experts) or neither")
        if not 1 <= num_experts <= MAX_EXPERTS or top_k > num_experts:
            raise ValueError(f"num_experts must be in 1..{MAX_EXPERTS} and at least top_k ({top_k})")
        if kv is not None and kv.capacity_tokens < max_model_len:  # vLLM refuses to start so, too
            raise ValueError(f"a KV cache of {kv.capacity_tokens} tokens cannot hold one request of max_model_len "
                             f"{max_model_len}: raise the capacity or lower max_model_len")
        self.profile = get_profile(profile)
        self.dev_mode = dev_mode  # vLLM profiles: serve the admin routes (prime-rl's server always has its own)
        self.scale_out = scale_out  # started with --enable-scale-out (profiles without the flag always serve)
        self.model = model
        self.layers, self.top_k, self.num_experts = layers, top_k, num_experts
        self.max_model_len = max_model_len
        self.vocab = SimVocab.load()
        self.policy = SimPolicy(self.vocab, seed, Experts(layers, top_k, num_experts) if layers else None,
                                logprobs_mode_named(logprobs_mode),
                                None if policy_seed is None else Policy.seeded(policy_seed))
        self.gate = Gate()
        self.faults = faults
        self.record_replies = record_replies  # the log keeps each reply's tokens and routed experts (tests)
        self.weight_version = "default"  # vLLM 0.31+'s engine version string (/update_weight_version)
        self.counters = Counters()
        self.engine = Engine()  # broken by a failed weight load, dead at the next request that reaches it
        self.kv = None if kv is None else KVProcess(kv, self.gate, kv_time_scale)
        if weight_transfer not in (None, "gloo"):
            raise ValueError(f"weight_transfer must be 'gloo' or None, not {weight_transfer!r}")
        self.transfer = SimTransfer(weight_transfer, self, sanitized=self.profile.sanitized_errors)
        self.log = SimLog()
        self._generating: set[Generation] = set()  # inside the engine, tokens not sampled yet (segments.py)
        self._fault_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2])
        self._created = int(time.time())
        self.url = ""

    @property
    def faults(self) -> Faults:
        """The injected faults; assign a new ``Faults`` to change them (``hold`` off releases held requests)."""
        return self._faults

    @faults.setter
    def faults(self, faults: Faults) -> None:
        self._faults = faults
        self.gate.set_holding(faults.hold)

    @property
    def weights_path(self) -> str | None:
        """The directory weights were last loaded from (None: none loaded since start)."""
        return self.policy.weights_path

    @property
    def loads(self) -> int:
        """How many times weights were loaded since start."""
        return self.policy.loads

    async def load(self, path: object, *, none_reloads: bool = False) -> None:
        """Load the weights in directory ``path`` (None with ``none_reloads``: the ones in hand, as vLLM's
        reload_weights without a path). A load that fails is a 500 with the worker's error and breaks the engine
        (engine.py): the next request that reaches it kills it."""
        if path is None and none_reloads:
            self.policy.install(None)
            return
        try:
            model, file_id = await asyncio.to_thread(self.policy.read, path)  # reading a file: off the loop
        except LoadFailed as e:
            self.engine.load_failed()
            message = load_error_message(str(e))
            log.warning("sim server %s: weight load of %s failed; its engine is broken", self.url, path)
            raise engine_error(500, sanitize(message) if self.profile.sanitized_errors else message) from None
        self.policy.install(str(path), model, file_id)
        log.info("sim server %s: weights loaded from %s (load %d)", self.url, path, self.loads)

    # ------------------------------------------------------------------------------------------- serving

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> AsyncIterator[SimServer]:
        """Serve until the block exits; ``server.url`` is the OpenAI-style base URL (ending in ``/v1``)."""
        server = cls(**kwargs)
        # shutdown_timeout 0 means "no limit" in aiohttp 3.14: exit would wait for held (paused, hung) requests
        # handler_cancellation: a client that goes away cancels its request, as vLLM's generate route does
        # (v031:entrypoints/scale_out/token_in_token_out/api_router.py, @with_cancellation): a cancelled rollout's
        # request leaves the KV cache at once instead of decoding to its end for nobody
        runner = web.AppRunner(server.app(), access_log=None, handle_signals=False, shutdown_timeout=0.01,
                               handler_cancellation=True)
        await runner.setup()
        async with asyncio.TaskGroup() as tg:  # the KV engine's iterations, while it serves
            if server.kv is not None:
                tg.create_task(server.kv.run())
            try:
                site = web.TCPSite(runner, host, port, reuse_address=True)
                await site.start()
                sock = site._server.sockets[0]  # type: ignore[union-attr]
                bound_host, bound_port = sock.getsockname()[:2]
                shown = f"[{bound_host}]" if ":" in bound_host else bound_host
                server.url = f"http://{shown}:{bound_port}/v1"
                yield server
            finally:
                if server.kv is not None:
                    server.kv.stop()
                server.transfer.close()
                server.release_hung()
                await runner.cleanup()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[self._outermost, fastapi_errors])
        app.add_routes([
            web.get("/health", self.health), web.get("/v1/models", self.models), web.get("/version", self.version),
            web.post("/tokenize", self.tokenize), *self._generate_route(),
            web.post("/v1/chat/completions", self.chat), web.get("/metrics", self.metrics), *admin_routes(self),
            web.post("/sim/faults", self.set_faults), web.get("/sim/log", self.get_log),
        ])
        return app

    def _generate_route(self) -> list[web.RouteDef]:
        """``POST /inference/v1/generate``, or what a server started without ``--enable-scale-out`` has in its
        place: nothing on 0.31 (the route is not registered: v031:entrypoints/scale_out/factories.py; observed
        404 ``{"detail": "Not Found"}``), a 403 on 0.32+ (observed on 0.32, REAL-VLLM.md)."""
        flag = self.profile.scale_out_flag
        if flag is None or self.scale_out:
            return [web.post("/inference/v1/generate", self.generate)]
        if flag == "refused":
            return [web.post("/inference/v1/generate", self._scale_out_refused)]
        return []

    async def _scale_out_refused(self, _request: web.Request) -> web.Response:
        self._log_generate(403, None, self.gate.mode)
        return json_response(error_body(SCALE_OUT_DISABLED, "PermissionDeniedError", 403), 403)

    def release_hung(self) -> None:
        """Fail every request the server is holding unanswered (on shutdown, or when a test says so)."""
        self.gate.release_hung()

    def log_json(self) -> dict[str, Any]:
        """``GET /sim/log``'s body (schema in ``log.py``)."""
        version = self.weight_version if self.profile.weight_version_routes else None
        return {"profile": self.profile.name, "dev_mode": self.dev_mode, "weights_path": self.weights_path,
                "loads": self.loads, "weight_version": version,
                "pause_mode": self.gate.mode, "counters": asdict(self.counters), "kv": self._kv_timing(),
                **self.log.to_json()}

    def _kv_timing(self) -> dict[str, float] | None:
        if self.kv is None:
            return None
        return {"iterations": self.kv.iterations, "modeled_s": self.kv.modeled_s, "wall_s": self.kv.wall_s}

    @web.middleware
    async def _outermost(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """A down server answers 503 (the generate handler logs its own); admin calls are logged."""
        path = request.path
        dead = None
        if self.engine.dead and request.match_info.http_exception is None:  # a route it serves
            dead = self.engine.dead_response(path, prime_rl=self.profile.prime_rl)
        if dead is not None:
            response: web.StreamResponse = dead
        elif self.faults.down and not path.startswith(("/sim/", "/inference/")):
            if path == "/v1/chat/completions":
                self.counters.down += 1
            response = empty_response(503) if path == "/health" else json_response(_down_body(), 503)
        else:
            response = await handler(request)
        if path in ADMIN_PATHS:
            self.log.admin.append(AdminCall(request.method, path, dict(request.query), await _body_of(request),
                                            response.status))
        return response

    # ------------------------------------------------------------------------------------------ handlers

    async def health(self, _request: web.Request) -> web.Response:
        return empty_response(200)  # a paused engine is healthy too

    async def metrics(self, _request: web.Request) -> web.Response:
        load = (await self.kv.load() if self.kv is not None
                else KVLoad(0.0, self.gate.state().inside, 0, 0))
        return web.Response(body=exposition(self.model, load, float(self._created)).encode(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def models(self, _request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": self._created, "owned_by": "vllm", "root": self.model,
                "parent": None, "max_model_len": self.max_model_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": self._created, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
        return json_response({"object": "list", "data": [card]})

    async def version(self, _request: web.Request) -> web.Response:
        return json_response({"version": self.profile.vllm_version})

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"prompt", "add_special_tokens"?, "return_token_strs"?}``; the chat form (``messages``) is not
        simulated and answers 400."""
        body = await read_json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise validation_error(("body", "prompt"), "missing", "Field required", body)
        if body.get("model") is not None and body["model"] != self.model:
            raise model_not_found(str(body["model"]))
        enc = self.vocab.tokenizer.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
        return json_response({"count": len(enc.ids), "max_model_len": self.max_model_len, "tokens": enc.ids,
                              "token_strs": enc.tokens if body.get("return_token_strs") else None})

    async def set_faults(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        try:
            self.faults = replace(self.faults, **body)
        except TypeError as e:
            return json_response({"error": f"unknown fault: {e}"}, status=400)
        return json_response(asdict(self.faults))

    async def get_log(self, _request: web.Request) -> web.Response:
        return json_response(self.log_json())

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrival = self.gate.mode
        body: Any = None
        try:
            if self.faults.down:
                self.counters.down += 1
                raise Refusal(503, _down_body())
            body = await read_json_body(request)
            req = parse_generate(body, self.profile, model=self.model, vocab_size=self.vocab.size,
                                 max_model_len=self.max_model_len)
        except Refusal as r:
            salt = body.get("cache_salt") if isinstance(body, dict) else None
            self._log_generate(r.status, salt if isinstance(salt, str) else None, arrival,
                               fault="down" if self.faults.down else None)
            return r.response()
        if self.engine.dead:  # refused at once: the engine client knows its core is gone
            self._log_generate(500, req.cache_salt, arrival)
            return dead_error()
        failed, delay_s = await self._fault(
            request, lambda: self._log_generate(0, req.cache_salt, arrival, fault="hang"))
        if failed is not None:
            self._log_generate(failed.status, req.cache_salt, arrival, fault=_fault_name(failed.status))
            return failed
        if self.gate.mode in ("abort", "wait") and self.profile.refuses_while_paused:
            self.counters.refused_paused += 1
            self._log_generate(503, req.cache_salt, arrival)
            return engine_error(503, PAUSED_MESSAGE).response()
        request_id = request.headers.get("X-Request-Id") or req.request_id or uuid.uuid4().hex
        async with self.gate.inflight() as aborted:
            gen = None if aborted or req.sampling.n != 1 else Generation(req.token_ids, req.sampling, delay_s)
            if gen is not None:
                self._generating.add(gen)  # a keep pause from here on cuts it in two (segments.py)
            try:
                aborted = aborted or await self.gate.hold(delay_s)
            finally:
                if gen is not None:
                    self._generating.discard(gen)
            # the forward pass: a broken engine dies here (engine.py)
            alive = aborted or self.engine.forward()
            reply, spans = self._reply(req, request_id, aborted, gen) if alive else (None, [])
            sampled_with = (self.weights_path, self.loads)
            if reply is not None and not aborted and self.kv is not None:  # decoded under the KV cache's capacity
                await self.kv.decode(len(req.token_ids), reply["usage"]["completion_tokens"])
        if reply is None:
            self._log_generate(500, req.cache_salt, arrival)
            return dead_error()
        raw, fault = self._maybe_malformed(reply)
        first = reply["choices"][0]
        recorded = {"token_ids": [*req.token_ids, *first["token_ids"]], "routed_experts": first.get("routed_experts"),
                    "versions": spans} if self.record_replies else {}
        self._log_generate(200, req.cache_salt, arrival, sampled_with=sampled_with,
                           finish_reason=first["finish_reason"], fault=fault, prompt_tokens=len(req.token_ids),
                           completion_tokens=reply["usage"]["completion_tokens"], **recorded)
        return web.Response(body=raw, content_type="application/json")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await read_json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise validation_error(("body", "messages"), "missing", "Field required", body)
        if self.engine.dead:
            return dead_error()
        failed, delay_s = await self._fault(request)
        if failed is not None:
            return failed
        async with self.gate.inflight() as aborted:
            aborted = aborted or await self.gate.hold(delay_s)
            if not aborted and not self.engine.forward():
                return dead_error()
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            sample = None if aborted else self.policy.sample([], SamplingParams(
                max_tokens=max(1, max_tokens), temperature=float(body.get("temperature", 1.0))))
        self.counters.requests += 1
        ids = np.zeros(0, dtype=np.int64) if sample is None else sample.token_ids
        self.counters.generated_tokens += int(ids.size)
        return json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self.vocab.decode(ids)},
                         "finish_reason": "abort" if sample is None else sample.finish_reason}],
            "usage": {"prompt_tokens": 0, "completion_tokens": int(ids.size), "total_tokens": int(ids.size)},
        })

    # ------------------------------------------------------------------------------------------ sampling

    def interrupt_generations(self) -> None:
        """A keep pause begins on a running engine: the requests inside sample the tokens produced so far, with the
        weights and version label of now (segments.py)."""
        if self.gate.mode is None:
            for gen in self._generating:
                gen.interrupt(self.policy, self.weight_version)

    def _reply(self, req: GenerateRequest, request_id: str, aborted: bool, gen: Generation | None = None
               ) -> tuple[dict[str, Any], list[tuple[str, int, int]]]:
        """The reply, and the version spans of its first choice."""
        sp = req.sampling
        self.counters.requests += 1
        choices = []
        first: list[tuple[str, int, int]] = []
        for i in range(sp.n):
            spans: list[tuple[str, int, int]] = []
            if aborted:
                sample = None
            elif gen is not None and i == 0:
                sample, spans = gen.finish(self.policy, self.weight_version)
            else:
                sample = self.policy.sample(req.token_ids, sp)
                spans = [(self.weight_version, 0, int(sample.token_ids.size))]
            experts = None
            if sample is not None:
                self.counters.generated_tokens += int(sample.token_ids.size)
                if self.layers:
                    start = sp.routed_experts_prompt_start
                    rows = len(req.token_ids) + int(sample.token_ids.size) - 1 - start
                    experts = replies.routed_experts(self.profile, self.policy.route(rows), start, self.num_experts)
            choices.append(replies.choice(self.profile, i, sample, logprobs=sp.logprobs, experts=experts,
                                          weight_versions=spans))
            first = first if i else spans
        if aborted:
            self.counters.aborted += 1
        prompt = None
        if sp.prompt_logprobs is not None and not aborted:  # a teacher's prefill: each prompt token scored
            scored = self.policy.prompt_logprobs(req.token_ids, sp.prompt_logprobs)
            prompt = replies.prompt_logprobs(req.token_ids, scored, self.vocab.tokens if sp.detokenize else None)
        return replies.generate_reply(self.profile, request_id, self.model, len(req.token_ids), choices, prompt), first

    def _log_generate(self, status: int, cache_salt: str | None, pause_mode: str | None, *,
                      sampled_with: tuple[str | None, int] | None = None, **rest: Any) -> None:
        """Log a generate request; ``sampled_with``: the weights (path, loads) it sampled with, else the current."""
        weights_path, loads = sampled_with or (self.weights_path, self.loads)
        self.log.generate.append(GenerateCall(status, cache_salt, weights_path, loads, pause_mode, **rest))

    # ------------------------------------------------------------------------------------------- faults

    async def _fault(self, request: web.Request, on_hang: Callable[[], None] | None = None
                     ) -> tuple[web.Response | None, float]:
        """Maybe a 500, a hang (``on_hang`` called as it starts) or a dropped connection (or None: go on), and the
        latency to add in seconds."""
        f, rng = self.faults, self._fault_rng
        delay_s = 0.0
        if f.latency_ms or f.latency_max_ms:
            hi = f.latency_max_ms if f.latency_max_ms is not None else f.latency_ms
            delay_s = float(rng.uniform(f.latency_ms, hi)) / 1e3
        roll = float(rng.random())
        if roll < f.error_rate:
            self.counters.errors += 1
            return engine_error(500, "sim: injected server error").response(), delay_s
        roll -= f.error_rate
        if roll < f.hang_rate:
            self.counters.hangs += 1
            if on_hang is not None:
                on_hang()
            await self.gate.hang()  # answered never; released with an error at shutdown
        roll -= f.hang_rate
        if roll < f.drop_rate:
            self.counters.drops += 1
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=499), delay_s  # never reaches the client: the connection is gone
        return None, delay_s

    def _maybe_malformed(self, reply: dict[str, Any]) -> tuple[bytes, str | None]:
        rate = self.faults.malformed_rate
        if rate <= 0 or float(self._fault_rng.random()) >= rate:
            return orjson.dumps(reply), None
        self.counters.malformed += 1
        kinds = replies.malformed_kinds(reply)
        kind = kinds[int(self._fault_rng.integers(len(kinds)))]
        return replies.malform(self.profile, reply, kind), f"malformed:{kind}"


def _down_body() -> dict[str, Any]:
    return error_body("sim: the server is down", "ServiceUnavailableError", 503)


def _fault_name(status: int) -> str:
    return "error" if status == 500 else "drop"


async def _body_of(request: web.Request) -> Any:
    """An admin request's body for the log: parsed JSON, else its text, else None."""
    try:
        raw = await request.read()  # aiohttp keeps the body a handler read
    except ConnectionResetError:
        return None
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode(errors="replace")
