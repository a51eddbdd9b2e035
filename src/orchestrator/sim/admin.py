"""Admin routes of each profile: pause, resume, weight loads (sources in ``profiles.py``).

vLLM profiles serve them only in dev mode (``VLLM_SERVER_DEV_MODE=1``); without it every path below answers
FastAPI's 404 ``{"detail": "Not Found"}``, as it does for prime-rl's missing ``/is_paused``,
``/collective_rpc``, ``/reset_prefix_cache``, ``/update_weight_version``, ``/weight_info`` and ``/server_info``.

- ``POST /pause``: vLLM reads query ``mode`` (default ``abort``), ``clear_cache`` (default true) and, on 0.26
  and 0.31, ``wait_for_inflight_requests``; the body is ignored. prime-rl ignores everything and pauses in keep
  mode without clearing the cache. Both answer ``{"status": "paused"}``.
- ``POST /resume`` -> ``{"status": "resumed"}``; ``GET /is_paused`` -> ``{"is_paused": bool}`` (vLLM only).
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` ->
  ``{"results": [null]}`` (vLLM only; no ``method``: 400).
- ``POST /update_weights``: vLLM needs ``update_info`` (0.26, 0.31: 400 "Missing 'update_info' in request body";
  0.32+: a 400 validation error); prime-rl takes ``{"weight_dir": DIR}`` -> ``{"status": "ok"}``.
- ``POST /reset_prefix_cache`` -> ``{"success": true}`` (vLLM only).
- ``GET /server_info[?config_format=json]`` -> ``{"vllm_config", "vllm_env", "system_env"}`` (vLLM only; read in
  0.31, and in vLLM's dev routes long before 0.26; prime-rl's server runs without dev mode: 404), whose
  ``vllm_config.model_config.logprobs_mode`` says which logprobs replies report.
- 0.31+: ``POST /update_weight_version {"new_version": str}`` -> ``{"success": true, "new_version"}``,
  ``GET /weight_info`` -> ``{"weight_version"}`` (``"default"`` until set).
- prime-rl: ``GET /liveness`` -> ``{"status": "ok"}``.

- 0.31+: the weight transfer routes (``transfer.py``: ``GET /get_world_size``, ``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``; 0.32+ ``/shutdown_weight_transfer_engine``),
  with a gloo engine when the server is started with one, else answering "Weight transfer not configured" as a
  server started without ``--weight-transfer-config`` does (observed). 0.26: ``/update_weights`` with an
  ``update_info`` answers that too.

A weight load that fails (a path that is not a directory, a directory without the simulator's weights file, a
file it cannot read) answers 500 with the worker's error, as observed on vLLM 0.31.0, and breaks the engine:
``orchestrator.sim.engine`` says what a real server does next.
"""

from __future__ import annotations

import platform
from typing import Any, Protocol

from aiohttp import web

from orchestrator.sim.gate import PAUSE_MODES, Gate, PauseMode
from orchestrator.sim.log import Counters
from orchestrator.sim.policy import SimPolicy
from orchestrator.sim.profiles import Profile
from orchestrator.sim.responses import (
    engine_error,
    http_error,
    json_response,
    missing,
    parse_bool,
    read_json,
    read_json_body,
    validation_error,
)
from orchestrator.sim.transfer import NOT_CONFIGURED, SimTransfer


class AdminServer(Protocol):
    """What the admin routes act on (``AdminServer``)."""

    profile: Profile
    dev_mode: bool
    model: str
    max_model_len: int
    policy: SimPolicy
    gate: Gate
    counters: Counters
    weight_version: str
    transfer: SimTransfer

    async def load(self, path: object, *, none_reloads: bool = False) -> None: ...

    def interrupt_generations(self) -> None: ...

ADMIN_PATHS = frozenset({"/pause", "/resume", "/is_paused", "/collective_rpc", "/update_weights",
                         "/reset_prefix_cache", "/update_weight_version", "/weight_info", "/get_world_size",
                         "/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
                         "/shutdown_weight_transfer_engine"})


def admin_routes(server: AdminServer) -> list[web.RouteDef]:
    """The admin routes ``server``'s profile serves (none for vLLM without dev mode)."""
    admin = _Admin(server)
    if server.profile.prime_rl:
        return [web.post("/pause", admin.prime_pause), web.post("/resume", admin.resume),
                web.post("/update_weights", admin.prime_update_weights), web.get("/liveness", admin.liveness)]
    if not server.dev_mode:
        return []
    routes = [web.post("/pause", admin.pause), web.post("/resume", admin.resume),
              web.get("/is_paused", admin.is_paused), web.post("/collective_rpc", admin.collective_rpc),
              web.post("/update_weights", admin.update_weights),
              web.post("/reset_prefix_cache", admin.reset_prefix_cache), web.get("/server_info", admin.server_info)]
    if server.profile.weight_version_routes:
        routes += [web.post("/update_weight_version", admin.update_weight_version),
                   web.get("/weight_info", admin.weight_info), web.get("/get_world_size", admin.get_world_size),
                   web.post("/init_weight_transfer_engine", admin.init_weight_transfer_engine),
                   web.post("/start_weight_update", admin.start_weight_update),
                   web.post("/finish_weight_update", admin.finish_weight_update)]
    if server.profile.typed_admin_bodies:
        routes.append(web.post("/shutdown_weight_transfer_engine", admin.shutdown_weight_transfer_engine))
    return routes


def _pause_mode(raw: str) -> PauseMode:
    for mode in PAUSE_MODES:
        if raw == mode:
            return mode
    raise validation_error(("query", "mode"), "literal_error", "Input should be 'abort', 'wait' or 'keep'", raw)


class _Admin:
    def __init__(self, server: AdminServer) -> None:
        self.server = server

    # ------------------------------------------------------------------------------------------- vLLM

    async def pause(self, request: web.Request) -> web.Response:
        q = request.query
        mode = _pause_mode(q.get("mode", "abort"))
        clear_cache = parse_bool("clear_cache", q.get("clear_cache"), True)
        if not self.server.profile.typed_admin_bodies and parse_bool(
                "wait_for_inflight_requests", q.get("wait_for_inflight_requests"), False):
            mode = "wait"  # 0.26's deprecated spelling of mode=wait
        await self._pause(mode, clear_cache)
        return json_response({"status": "paused"})

    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        if mode == "keep":  # requests inside stop mid-way: what they sampled so far is the old weights' (segments.py)
            self.server.interrupt_generations()
        self.server.gate.pause(mode)
        if mode == "wait":
            await self.server.gate.drained()
        if clear_cache:  # when the pause completes (the simulator keeps no KV cache: it only counts)
            self.server.counters.cache_resets += 1

    async def resume(self, _request: web.Request) -> web.Response:
        self.server.gate.resume()
        return json_response({"status": "resumed"})

    async def is_paused(self, _request: web.Request) -> web.Response:
        return json_response({"is_paused": self.server.gate.paused})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except ValueError as e:
            raise http_error(400, f"JSON decode error: {e}") from e
        body = self._object(body)
        method = body.get("method")
        if method is None:
            raise http_error(400, "Missing 'method' in request body")
        if method != "reload_weights":
            raise engine_error(500, f"sim: collective_rpc method {method!r} is not simulated (only reload_weights)")
        kwargs = body.get("kwargs") or {}
        path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
        await self.server.load(path, none_reloads=True)
        return json_response({"results": [None]})

    async def _embedded(self, request: web.Request, field: str) -> Any:
        """The body's ``field`` (``{"update_info": ...}``), refused as each version refuses a missing one."""
        if self.server.profile.typed_admin_bodies:
            body = self._object(await read_json_body(request))
            if body.get(field) is None:
                raise missing(("body", field), body)
            return body[field]
        try:
            body = await read_json(request)
        except ValueError as e:
            raise http_error(400, "Invalid JSON format") from e
        body = self._object(body)
        if body.get(field) is None:
            raise http_error(400, f"Missing '{field}' in request body")
        return body[field]

    async def update_weights(self, request: web.Request) -> web.Response:
        update_info = await self._embedded(request, "update_info")
        if not self.server.profile.weight_version_routes:
            raise engine_error(500, NOT_CONFIGURED)
        await self.server.transfer.update(update_info)
        return json_response({"message": "Weights updated"})

    async def get_world_size(self, request: web.Request) -> web.Response:
        parse_bool("include_dp", request.query.get("include_dp"), True)
        return json_response({"world_size": 1})

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        await self.server.transfer.init(await self._embedded(request, "init_info"))
        return json_response({"message": "Weight transfer initialized"})

    async def start_weight_update(self, _request: web.Request) -> web.Response:
        self.server.transfer.start()
        return json_response({"message": "Weight update started"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = self._object(await read_json_body(request)) if raw else {}
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise validation_error(("body", "weight_version"), "string_type", "Input should be a valid string",
                                   version)
        self.server.transfer.finish(version)
        return json_response({"message": "Weight update finished"})

    async def shutdown_weight_transfer_engine(self, _request: web.Request) -> web.Response:
        self.server.transfer.shutdown()
        return json_response({"message": "Weight transfer shut down"})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        parse_bool("reset_running_requests", request.query.get("reset_running_requests"), False)
        parse_bool("reset_external", request.query.get("reset_external"), False)
        self.server.counters.cache_resets += 1
        return json_response({"success": True})

    async def server_info(self, request: web.Request) -> web.Response:
        """vLLM's dev-mode ``GET /server_info`` (``v031:entrypoints/serve/dev/server_info/api_router.py``):
        ``vllm_config`` as JSON with ``?config_format=json``, else as its text; the JSON holds the fields the
        simulator has, ``model_config.logprobs_mode`` among them (observed: ``"raw_logprobs"`` by default,
        ``"processed_logprobs"`` with ``--logprobs-mode processed_logprobs``)."""
        fmt = request.query.get("config_format", "text")
        if fmt not in ("text", "json"):
            raise validation_error(("query", "config_format"), "literal_error", "Input should be 'text' or 'json'",
                                   fmt)
        s = self.server
        model = {"model": s.model, "served_model_name": s.model, "max_model_len": s.max_model_len,
                 "logprobs_mode": s.policy.logprobs_mode}
        text = ", ".join(f"{k}={v!r}" for k, v in model.items())  # VllmConfig.__str__ is such a line
        return json_response({"vllm_config": {"model_config": model} if fmt == "json" else text,
                              "vllm_env": {"VLLM_SERVER_DEV_MODE": True},
                              "system_env": {"os": platform.platform(), "python_version": platform.python_version()}})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = self._object(await read_json_body(request))
        version = body.get("new_version")
        if version is None:
            raise missing(("body", "new_version"), body)
        if not isinstance(version, str):
            raise validation_error(("body", "new_version"), "string_type", "Input should be a valid string", version)
        self.server.weight_version = version
        return json_response({"success": True, "new_version": version})

    async def weight_info(self, _request: web.Request) -> web.Response:
        return json_response({"weight_version": self.server.weight_version})

    def _object(self, body: Any) -> dict[str, Any]:
        if isinstance(body, dict):
            return body
        if self.server.profile.typed_admin_bodies:
            raise http_error(400, "Expected a JSON object")
        raise engine_error(500, f"'{type(body).__name__}' object has no attribute 'get'")  # 0.26 calls body.get

    # ---------------------------------------------------------------------------------------- prime-rl

    async def prime_pause(self, _request: web.Request) -> web.Response:
        await self._pause("keep", clear_cache=False)  # whatever the query says
        return json_response({"status": "paused"})

    async def prime_update_weights(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except ValueError as e:  # a JSONDecodeError is a ValueError: vLLM's handler answers 400
            raise engine_error(400, str(e)) from e
        if not isinstance(body, dict):
            raise engine_error(500, f"'{type(body).__name__}' object has no attribute 'get'")
        await self.server.load(body.get("weight_dir"))
        return json_response({"status": "ok"})

    async def liveness(self, _request: web.Request) -> web.Response:
        return json_response({"status": "ok"})
