"""vLLM's weight-transfer routes on one server: what a broadcast asks of each server, and what preflight checks.

A server serves them in dev mode (``VLLM_SERVER_DEV_MODE=1``) and needs ``--weight-transfer-config '{"backend":
B}'`` (vLLM 0.31: ``vllm/entrypoints/serve/dev/rlhf/api_router.py``; 0.32: ``vllm/entrypoints/rl/online/
api_router.py``; observed on both with the gloo backend, ``orchestrator.transfer``):

- ``GET /get_world_size`` -> ``{"world_size": TP*PP*DP}``: the ranks its workers take in a group;
- ``POST /init_weight_transfer_engine {"init_info": ...}`` -> ``{"message": "Weight transfer initialized"}`` once
  its workers joined the group (it waits in the rendezvous); again, a new group (our gloo engine leaves the old);
- ``POST /start_weight_update`` -> ``{"message": "Weight update started"}``; a second one before the finish: 500
  "start_weight_update called while a weight update is already active";
- ``POST /update_weights {"update_info": {"names", "dtype_names", "shapes"}}`` -> ``{"message": "Weights
  updated"}`` once every chunk arrived and loaded (it waits in the broadcast; nothing in vLLM bounds the wait: the
  engine's own timeout does), 500 "start_weight_update must be called before update_weights" without a start;
- ``POST /finish_weight_update {"weight_version": "N"}`` -> ``{"message": "Weight update finished"}``, then
  ``GET /weight_info`` says ``"N"``; without a start, or after a failed update: 500 "finish_weight_update called
  without a matching start_weight_update".

Every worker error is a 500 ``{"error": {"message": "Call to collective_rpc method failed: Worker failed with error
'...'"}}``, and the server then closes the connection (server.py). A server started without the flag answers 500
"Weight transfer not configured. Please set weight_transfer_config to enable weight transfer." to every one but
``/get_world_size``: ``configured_backend`` tells (by an ``init_info`` the engine must refuse, which changes
nothing) whether, and which engine, a server has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from orchestrator.contracts.transfer import Params
from orchestrator.errors import InferenceError
from orchestrator.inference.server import HttpStatusError, InferenceServer
from orchestrator.inference.weights import Timed

NOT_CONFIGURED = b"Weight transfer not configured"
ENGINES = {"gloo": b"GlooWeightTransferEngine", "nccl": b"NCCLWeightTransferEngine"}


def init_info(backend: str, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
              group: str, timeout_s: float, buffer_bytes: int) -> dict[str, Any]:
    """A server's ``init_info``: the gloo engine's fields (transfer/gloo.py ``GlooInitInfo``), or vLLM's nccl
    engine's (``NCCLWeightTransferInitInfo``, vLLM 0.31/0.32: keyword-only, no unknown keys; it has no timeout)."""
    common = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
              "world_size": world_size, "packed_buffer_size_bytes": buffer_bytes}
    if backend == "nccl":
        return {**common, "packed": True}
    return {**common, "group": group, "timeout_s": timeout_s}


def update_info(params: Params) -> dict[str, Any]:
    return {"names": params.names, "dtype_names": params.dtype_names, "shapes": params.shapes}


async def world_size(server: InferenceServer, timed: Timed) -> int:
    raw = await timed(server.request("GET", "/get_world_size"), f"get_world_size on {server.url}")
    try:
        n = orjson.loads(raw)["world_size"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise InferenceError(f"{server.url}/get_world_size answered {raw[:100]!r}, not a world size") from None
    if not isinstance(n, int) or n < 1:
        raise InferenceError(f"{server.url}/get_world_size answered {n!r}, not a world size")
    return n


async def init(server: InferenceServer, info: Mapping[str, Any], timed: Timed) -> None:
    await timed(server.request("POST", "/init_weight_transfer_engine", body={"init_info": info}),
                f"init_weight_transfer_engine on {server.url}")


async def start(server: InferenceServer, timed: Timed) -> None:
    await timed(server.request("POST", "/start_weight_update"), f"start_weight_update on {server.url}")


async def update(server: InferenceServer, params: Params, timed: Timed) -> None:
    await timed(server.request("POST", "/update_weights", body={"update_info": update_info(params)}),
                f"update_weights on {server.url}")


async def finish(server: InferenceServer, step: int, timed: Timed) -> None:
    await timed(server.request("POST", "/finish_weight_update", body={"weight_version": str(step)}),
                f"finish_weight_update on {server.url}")


async def configured_backend(server: InferenceServer, timed: Timed) -> str | None:
    """Which engine ``server`` has (``"gloo"``, ``"nccl"``, or another engine's class name); None without one.
    InferenceError when it cannot say (no such route: no dev mode, or a vLLM older than 0.31)."""
    try:
        await timed(server.request("POST", "/init_weight_transfer_engine", body={"init_info": {}}),
                    f"init_weight_transfer_engine on {server.url}")
    except HttpStatusError as e:
        if NOT_CONFIGURED in e.body:
            return None
        for name, engine in ENGINES.items():
            if engine in e.body:
                return name
        if e.status == 500 and b"Invalid init_info for " in e.body:
            return e.body.split(b"Invalid init_info for ", 1)[1].split(b":", 1)[0].decode(errors="replace")
        raise
    raise InferenceError(f"{server.url} accepted an empty init_info: it cannot tell which engine it has")
