"""Reply and error shapes of vLLM's FastAPI server, written for aiohttp.

vLLM answers errors in three shapes (``v026:entrypoints/serve/utils/server_utils.py`` and
``v026:entrypoints/serve/utils/error_response.py``):

- request validation (FastAPI's ``RequestValidationError``): 400, ``type`` "Bad Request", ``param`` the dotted
  location (``body.token_ids``, ``query.mode``) or the field a vLLM validator names; never 422;
- a raised ``HTTPException``: its status, ``type`` the HTTP phrase, ``param`` null;
- an exception from the engine: ``ValueError`` 400 ``BadRequestError``, not found 404 ``NotFoundError``, others
  500 ``InternalServerError``.

All three are ``{"error": {"message", "type", "param", "code"}}``. A path no route serves is FastAPI's own
``{"detail": "Not Found"}`` (405: ``{"detail": "Method Not Allowed"}``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web


class Refusal(Exception):
    """A request the simulated server refuses; handlers raise it and answer ``response()``."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body

    def response(self) -> web.Response:
        return json_response(self.body, self.status)


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def empty_response(status: int = 200) -> web.Response:
    """A bare Starlette ``Response(status_code=...)``: no body, no JSON (vLLM's ``/health``)."""
    return web.Response(status=status)


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def engine_error(status: int, message: str, param: str | None = None) -> Refusal:
    """An exception mapped by ``create_error_response``: 400 BadRequestError, 404 NotFoundError, 500, 503."""
    type_ = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
        status, "InternalServerError")
    return Refusal(status, error_body(message, type_, status, param))


def http_error(status: int, detail: str) -> Refusal:
    """A raised ``HTTPException``: the HTTP phrase as ``type``."""
    return Refusal(status, error_body(detail, HTTPStatus(status).phrase, status))


def validation_error(loc: tuple[str | int, ...], kind: str, msg: str, value: Any,
                     param: str | None = None) -> Refusal:
    """FastAPI/pydantic rejected the request: 400 with pydantic's error listed in the message."""
    err = {"type": kind, "loc": loc, "msg": msg, "input": value}
    where = param if param is not None else ".".join(str(p) for p in loc)
    return Refusal(400, error_body(f"1 validation error:\n  {err}", "Bad Request", 400, where))


def missing(loc: tuple[str | int, ...], value: Any) -> Refusal:
    return validation_error(loc, "missing", "Field required", value)


def model_not_found(model: str) -> Refusal:
    return engine_error(404, f"The model `{model}` does not exist.", param="model")


async def read_json(request: web.Request) -> Any:
    """The request's JSON body; ValueError when it is not JSON (an empty body included)."""
    try:
        raw = await request.read()
    except ConnectionResetError:  # the client gave up (timeout, cancelled rollout): nothing to answer
        raise web.HTTPBadRequest(text="client went away") from None
    return orjson.loads(raw)


async def read_json_body(request: web.Request) -> Any:
    """A FastAPI body parameter: invalid JSON is a validation error at ``body``."""
    try:
        return await read_json(request)
    except ValueError as e:
        raise validation_error(("body", 0), "json_invalid", "JSON decode error", {}, param="body") from e


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def fastapi_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Unknown paths and methods answer as FastAPI does; ``Refusal`` raised by a handler is answered."""
    try:
        return await handler(request)
    except Refusal as r:
        return r.response()
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, 405)


def parse_bool(name: str, raw: str | None, default: bool) -> bool:
    """A FastAPI ``bool`` query parameter (true/false, 1/0, yes/no, on/off)."""
    if raw is None:
        return default
    low = raw.lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise validation_error(("query", name), "bool_parsing", "Input should be a valid boolean, unable to "
                           "interpret input", raw)
