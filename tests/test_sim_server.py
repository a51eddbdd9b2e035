"""The simulated server plays each real server: routes, exact bodies, status codes and defaults.

What each profile must do is in ``orchestrator.sim.profiles`` (with the source each behaviour was read from);
pause and weight-load semantics are in ``test_sim_pause.py``. Real HTTP on 127.0.0.1; tests synchronise on
the server's state (``gate.wait_until``), never on sleeps.
"""

from __future__ import annotations

import asyncio
import io
import math
from typing import Any

import aiohttp
import numpy as np
import orjson
import pybase64
import pytest

from orchestrator.policy import FILE, Policy
from orchestrator.sim.profiles import ProfileName
from orchestrator.sim.server import Faults, SimServer
from orchestrator.sim.vocab import SimVocab
from orchestrator.testing.sim import PROFILE_NAMES, sim_cluster, sim_process, sim_servers, weights_dir

PROMPT = [2, 5, 14, 11, 113]
VLLM: list[ProfileName] = ["vllm-0.26", "vllm-0.31", "vllm-0.32", "vllm-0.33"]
TOKEN_ID_LOGPROBS = ("vllm-0.32", "vllm-0.33")
STRICT = ("vllm-0.31", "vllm-0.32", "vllm-0.33")  # cache_salt checked, routed_experts_prompt_start in 0..P
ADMIN = [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/collective_rpc"),
         ("POST", "/update_weights"), ("POST", "/reset_prefix_cache"), ("POST", "/update_weight_version"),
         ("GET", "/weight_info")]
HANG_GUARD_S = 30.0  # only ever reached when something hangs


def root(srv: SimServer | Any) -> str:
    return str(srv.url).removesuffix("/v1")


async def call(s: aiohttp.ClientSession, method: str, url: str, **kwargs: Any) -> tuple[int, Any]:
    """Status and body: parsed JSON, or the raw bytes when the body is empty or not JSON."""
    async with s.request(method, url, **kwargs) as r:
        raw = await r.read()
    try:
        return r.status, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return r.status, raw


async def generate_raw(s: aiohttp.ClientSession, srv: SimServer | Any, extra: dict[str, Any] | None = None,
                       **sp: Any) -> tuple[int, bytes]:
    body = {"model": "sim-model", "token_ids": PROMPT, "sampling_params": {"max_tokens": 12, "logprobs": 1, **sp},
            **(extra or {})}
    async with s.post(root(srv) + "/inference/v1/generate", json=body) as r:
        assert "X-Weight-Version" not in r.headers
        return r.status, await r.read()


async def generate(s: aiohttp.ClientSession, srv: SimServer | Any, extra: dict[str, Any] | None = None,
                   **sp: Any) -> tuple[int, Any]:
    status, raw = await generate_raw(s, srv, extra, **sp)
    return status, orjson.loads(raw)


def bad_request(param: str | None) -> dict[str, Any]:
    """The parts of a validation 400 every vLLM version fixes (the message lists pydantic's errors)."""
    return {"type": "Bad Request", "param": param, "code": 400}


def error_of(body: Any) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return {k: body["error"][k] for k in ("type", "param", "code")}


def decode_experts(profile: ProfileName, payload: Any) -> np.ndarray:
    if profile == "prime-rl":
        arr = np.frombuffer(pybase64.b64decode(payload["data"]), dtype=np.dtype(payload["dtype"]))
        return arr.reshape(payload["shape"])
    assert isinstance(payload, str)
    return np.asarray(np.load(io.BytesIO(pybase64.b64decode(payload)), allow_pickle=False))


def check_reply(profile: ProfileName, raw: bytes, prompt_len: int) -> None:
    """What a client relies on in a generate reply; raises (ValueError, KeyError, ...) when it is broken."""
    choice = orjson.loads(raw)["choices"][0]  # orjson refuses NaN, as a strict JSON parser does
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    if len(content) != len(ids):
        raise ValueError("logprobs do not cover the tokens")
    for t, entry in zip(ids, content, strict=True):
        got, want = (entry["token_id"], t) if profile in TOKEN_ID_LOGPROBS else (entry["token"], f"token_id:{t}")
        lp = entry["logprob"]
        if got != want or not isinstance(lp, float) or not math.isfinite(lp) or lp == -9999.0:
            raise ValueError(f"bad logprob entry {entry}")
    experts = decode_experts(profile, choice["routed_experts"])
    if experts.shape[0] != prompt_len + len(ids) - 1:
        raise ValueError(f"{experts.shape[0]} routed expert rows for {prompt_len + len(ids)} tokens")


# ----------------------------------------------------------------------------------------------- routes


@pytest.mark.parametrize("profile", PROFILE_NAMES)
async def test_health_models_version_and_unknown_routes(profile: ProfileName) -> None:
    async with sim_servers(1, profile=profile, max_model_len=2048) as [srv], aiohttp.ClientSession() as s:
        async with s.get(root(srv) + "/health") as r:
            assert (r.status, await r.read(), r.content_type) == (200, b"", "application/octet-stream")
        status, models = await call(s, "GET", srv.url + "/models")
        assert status == 200
        assert models["object"] == "list"
        [card] = models["data"]
        assert {k: card[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")} == {
            "id": "sim-model", "object": "model", "owned_by": "vllm", "root": "sim-model", "parent": None,
            "max_model_len": 2048}
        assert isinstance(card["created"], int)
        assert card["permission"][0]["object"] == "model_permission"
        version = profile.removeprefix("vllm-") + ".0" if profile != "prime-rl" else "0.26.0"  # prime-rl: on 0.26
        assert await call(s, "GET", root(srv) + "/version") == (200, {"version": version})
        assert await call(s, "GET", root(srv) + "/no/such/route") == (404, {"detail": "Not Found"})
        assert await call(s, "GET", root(srv) + "/inference/v1/generate") == (405, {"detail": "Method Not Allowed"})
        srv.faults = Faults(down=True)
        async with s.get(root(srv) + "/health") as r:
            assert (r.status, await r.read()) == (503, b"")
        status, body = await generate(s, srv)
        assert (status, error_of(body)["type"]) == (503, "ServiceUnavailableError")


@pytest.mark.parametrize("profile", PROFILE_NAMES)
async def test_tokenize_uses_the_built_in_tokenizer(profile: ProfileName) -> None:
    vocab = SimVocab.load()
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:
        status, body = await call(s, "POST", root(srv) + "/tokenize", json={"model": "sim-model",
                                                                             "prompt": "what is 2 + 3?"})
        ids = vocab.tokenizer.encode("what is 2 + 3?").ids
        assert (status, body) == (200, {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None})
        assert [vocab.tokens[i] for i in ids] == ["what", "is", "2", "+", "3", "?"]
        status, body = await call(s, "POST", root(srv) + "/tokenize",
                                  json={"prompt": "2 + 3", "return_token_strs": True})
        assert body["token_strs"] == ["2", "+", "3"]
        status, body = await call(s, "POST", root(srv) + "/tokenize", json={"model": "other", "prompt": "hi"})
        assert status == 404
        assert body == {"error": {"message": "The model `other` does not exist.", "type": "NotFoundError",
                                  "param": "model", "code": 404}}


@pytest.mark.parametrize("profile", VLLM)
async def test_vllm_admin_routes_need_dev_mode(profile: ProfileName) -> None:
    async with sim_servers(1, profile=profile, dev_mode=False) as [srv], aiohttp.ClientSession() as s:
        for method, path in ADMIN:
            assert await call(s, method, root(srv) + path, json={}) == (404, {"detail": "Not Found"}), path
        assert [(c.path, c.status) for c in srv.log.admin] == [(p, 404) for _, p in ADMIN]
        assert (await generate(s, srv))[0] == 200  # /inference/v1/generate is served without dev mode
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:
        served = [p for _, p in ADMIN if profile != "vllm-0.26" or p not in ("/update_weight_version", "/weight_info")]
        for method, path in ADMIN:
            status, _ = await call(s, method, root(srv) + path, params={"mode": "keep"}, json={})
            assert (status != 404) == (path in served), path


async def test_prime_rl_serves_its_own_admin_routes_only() -> None:
    async with sim_servers(1, profile="prime-rl") as [srv], aiohttp.ClientSession() as s:
        for method, path in ADMIN:
            if path not in ("/pause", "/resume", "/update_weights"):
                assert await call(s, method, root(srv) + path, json={}) == (404, {"detail": "Not Found"}), path
        assert await call(s, "GET", root(srv) + "/liveness") == (200, {"status": "ok"})


@pytest.mark.parametrize("profile", VLLM)
async def test_vllm_pause_defaults_to_abort_and_clearing_the_cache(profile: ProfileName) -> None:
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:
        assert await call(s, "GET", root(srv) + "/is_paused") == (200, {"is_paused": False})
        assert await call(s, "POST", root(srv) + "/pause", json={"mode": "keep"}) == (200, {"status": "paused"})
        assert srv.gate.mode == "abort"  # the JSON body is ignored: no query, vLLM's default
        assert srv.counters.cache_resets == 1  # clear_cache defaults to true
        assert await call(s, "GET", root(srv) + "/is_paused") == (200, {"is_paused": True})
        assert await call(s, "POST", root(srv) + "/resume") == (200, {"status": "resumed"})
        assert await call(s, "POST", root(srv) + "/pause", params={"mode": "keep", "clear_cache": "false"}) == (
            200, {"status": "paused"})
        assert (srv.gate.mode, srv.counters.cache_resets) == ("keep", 1)
        status, body = await call(s, "POST", root(srv) + "/pause", params={"mode": "drain"})
        assert (status, error_of(body)) == (400, bad_request("query.mode"))
        status, body = await call(s, "POST", root(srv) + "/pause", params={"clear_cache": "maybe"})
        assert (status, error_of(body)) == (400, bad_request("query.clear_cache"))
        assert (srv.gate.mode, srv.counters.cache_resets) == ("keep", 1)  # refused pauses change nothing
        assert await call(s, "POST", root(srv) + "/reset_prefix_cache") == (200, {"success": True})
        assert srv.counters.cache_resets == 2
        assert [(c.path, c.query, c.body, c.status) for c in srv.log.admin][:3] == [
            ("/is_paused", {}, None, 200), ("/pause", {}, {"mode": "keep"}, 200), ("/is_paused", {}, None, 200)]


async def test_prime_rl_pause_ignores_its_parameters() -> None:
    async with sim_servers(1, profile="prime-rl") as [srv], aiohttp.ClientSession() as s:
        assert await call(s, "POST", root(srv) + "/pause", params={"mode": "abort", "clear_cache": "true"}) == (
            200, {"status": "paused"})
        assert (srv.gate.mode, srv.counters.cache_resets) == ("keep", 0)
        assert await call(s, "POST", root(srv) + "/resume") == (200, {"status": "resumed"})
        assert srv.log.admin[0].query == {"mode": "abort", "clear_cache": "true"}


@pytest.mark.parametrize("profile", VLLM)
async def test_vllm_weight_loads(profile: ProfileName, tmp_path: Any) -> None:
    weights_dir(tmp_path)
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:
        rpc = root(srv) + "/collective_rpc"
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
        assert await call(s, "POST", rpc, json=reload) == (200, {"results": [None]})
        assert (srv.weights_path, srv.loads) == (str(tmp_path), 1)
        assert await call(s, "POST", rpc, json={"kwargs": {}}) == (400, {"error": {
            "message": "Missing 'method' in request body", "type": "Bad Request", "param": None, "code": 400}})
        status, body = await call(s, "POST", rpc, json={"method": "reload_weights",
                                                        "kwargs": {"weights_path": str(tmp_path / "missing")}})
        assert (status, error_of(body)) == (500, {"type": "InternalServerError", "param": None, "code": 500})
        status, body = await call(s, "POST", root(srv) + "/update_weights", json={"step": 3, "path": str(tmp_path)})
        if profile in ("vllm-0.26", "vllm-0.31"):  # untyped bodies (v031:entrypoints/serve/dev/rlhf/api_router.py)
            assert (status, body) == (400, {"error": {"message": "Missing 'update_info' in request body",
                                                      "type": "Bad Request", "param": None, "code": 400}})
        else:
            assert (status, error_of(body)) == (400, bad_request("body.update_info"))
        assert (srv.weights_path, srv.loads) == (str(tmp_path), 1)  # failed calls load nothing


@pytest.mark.parametrize("profile", ["vllm-0.31", "vllm-0.32", "vllm-0.33"])
async def test_weight_version_routes(profile: ProfileName) -> None:
    spans = profile != "vllm-0.31"  # 0.31 has the routes, but its replies carry no weight_versions (observed)
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:
        assert await call(s, "GET", root(srv) + "/weight_info") == (200, {"weight_version": "default"})
        _, reply = await generate(s, srv)
        n = len(reply["choices"][0]["token_ids"])
        assert reply["choices"][0].get("weight_versions") == ([{"version": "default", "start": 0, "end": n}]
                                                               if spans else None)
        url = root(srv) + "/update_weight_version"
        assert await call(s, "POST", url, json={"new_version": "7"}) == (200, {"success": True, "new_version": "7"})
        for body, param in (({"new_version": 7}, "body.new_version"), ({}, "body.new_version")):
            status, err = await call(s, "POST", url, json=body)
            assert (status, error_of(err)) == (400, bad_request(param))
        assert await call(s, "GET", root(srv) + "/weight_info") == (200, {"weight_version": "7"})
        _, reply = await generate(s, srv)
        assert not spans or reply["choices"][0]["weight_versions"][0]["version"] == "7"
        assert srv.loads == 0  # a version label is not a weight load


async def test_prime_rl_update_weights(tmp_path: Any) -> None:
    weights_dir(tmp_path)
    async with sim_servers(1, profile="prime-rl") as [srv], aiohttp.ClientSession() as s:
        url = root(srv) + "/update_weights"
        assert await call(s, "POST", url, json={"weight_dir": str(tmp_path)}) == (200, {"status": "ok"})
        assert (srv.weights_path, srv.loads) == (str(tmp_path), 1)
        for body in ({}, {"weight_dir": str(tmp_path / "missing")}, {"step": 2, "path": str(tmp_path)}):
            status, err = await call(s, "POST", url, json=body)
            assert (status, error_of(err)["type"]) == (500, "InternalServerError"), body
        status, err = await call(s, "POST", url, data=b"not json", headers={"Content-Type": "application/json"})
        assert (status, error_of(err)["type"]) == (400, "BadRequestError")
        assert srv.loads == 1
        assert [c.status for c in srv.log.admin] == [200, 500, 500, 500, 400]


# ---------------------------------------------------------------------------------------------- generate


@pytest.mark.parametrize("profile", PROFILE_NAMES)
async def test_generate_validation(profile: ProfileName) -> None:
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:
        url = root(srv) + "/inference/v1/generate"
        sp = {"max_tokens": 4}
        for body, param in (({"token_ids": [], "sampling_params": sp}, "body.token_ids"),
                            ({"token_ids": [1, -2], "sampling_params": sp}, "body.token_ids"),
                            ({"token_ids": [1, "2"], "sampling_params": sp}, "body.token_ids.1"),
                            ({"sampling_params": sp}, "body.token_ids"),
                            ({"token_ids": [1, 2]}, "body.sampling_params")):
            status, err = await call(s, "POST", url, json=body)
            assert (status, error_of(err)) == (400, bad_request(param)), body
        status, err = await call(s, "POST", url, json={"model": "gpt", "token_ids": [1], "sampling_params": sp})
        assert (status, err) == (404, {"error": {"message": "The model `gpt` does not exist.", "type": "NotFoundError",
                                                 "param": "model", "code": 404}})
        status, err = await call(s, "POST", url, json={"token_ids": [SimVocab.load().size], "sampling_params": sp})
        assert (status, error_of(err)["type"]) == (400, "BadRequestError")
        assert [g.status for g in srv.log.generate] == [400] * 5 + [404, 400]
        assert srv.counters.requests == 0


@pytest.mark.parametrize("profile", PROFILE_NAMES)
async def test_cache_salt_rules(profile: ProfileName) -> None:
    bad = ["", "a/b", "a@b", "a\\b", "a\x00b", "x" * 129]
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:
        for salt in bad:
            status, body = await generate(s, srv, {"cache_salt": salt})
            if profile in STRICT:  # 0.31+ check it, with vLLM's own bodies (observed on 0.31 and 0.32)
                message = ("Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
                           if salt == "" else "Parameter 'cache_salt' must be at most 128 characters and must not "
                           "contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)")
                assert (status, body) == (400, {"error": {"message": message, "type": "BadRequestError",
                                                          "param": "cache_salt", "code": 400}}), salt
            else:
                assert status == 200, salt
        assert (await generate(s, srv, {"cache_salt": "7"}))[0] == 200
        assert [g.cache_salt for g in srv.log.generate] == [*bad, "7"]


@pytest.mark.parametrize("profile", PROFILE_NAMES)
async def test_reply_shape(profile: ProfileName) -> None:
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:
        _status, raw = await generate_raw(s, srv, stop_token_ids=[3])
        assert b"weight_version\"" not in raw  # no real server sends one (0.32+ send weight_versions spans)
        reply = orjson.loads(raw)
        [choice] = reply["choices"]
        n = len(choice["token_ids"])
        assert 1 <= n <= 12
        assert choice["finish_reason"] in ("stop", "length")
        usage = {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n, "prompt_tokens_details": None}
        if profile == "vllm-0.31":  # every key, in the order a real 0.31.0 sent them (OBSERVED.md)
            assert list(reply) == ["request_id", "model", "created", "choices", "usage", "prompt_logprobs",
                                   "prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders", "metrics",
                                   "kv_transfer_params", "ec_transfer_params"]
            assert list(choice) == ["index", "logprobs", "finish_reason", "token_ids", "routed_experts",
                                    "sampling_mask"]
            usage["completion_tokens_details"] = None
            assert list(reply["usage"]) == list(usage)
            assert reply["request_id"].startswith("generate-tokens-")
        if profile in ("vllm-0.32", "vllm-0.33"):  # in the order a real 0.32.0 sent them (profiles.py, 2026-11-28)
            assert list(reply) == ["request_id", "model", "created", "usage", "prompt_logprobs",
                                   "prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders", "metrics",
                                   "kv_transfer_params", "ec_transfer_params", "output_mode", "choices"]
            assert list(choice) == ["index", "finish_reason", "stop_reason", "token_ids", "routed_experts",
                                    "sampling_mask", "weight_versions", "logprobs"]
            usage["completion_tokens_details"] = None
            assert list(reply["usage"]) == list(usage)
        assert reply["usage"] == usage
        assert (reply["model"], reply["created"] is None) == ((None, True) if profile == "prime-rl" else
                                                              ("sim-model", False))
        assert choice["routed_experts"] is None  # no layers/top_k: no routed experts
        entry = choice["logprobs"]["content"][0]
        if profile in TOKEN_ID_LOGPROBS:
            assert set(entry) == {"token_id", "logprob", "rank", "top_logprobs"}
            assert entry["token_id"] == choice["token_ids"][0]
            assert entry["rank"] >= 1
            assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": n}]
        else:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert (entry["token"], entry["bytes"]) == (f"token_id:{choice['token_ids'][0]}", None)
            assert "weight_versions" not in choice
        assert entry["top_logprobs"][0] == {k: v for k, v in entry.items() if k != "top_logprobs"}  # sampled first
        _, quiet = await generate(s, srv, logprobs=None)
        assert quiet["choices"][0]["logprobs"] is None  # logprobs only when asked
        _, three = await generate(s, srv, logprobs=3)
        tops = {len(e["top_logprobs"]) for e in three["choices"][0]["logprobs"]["content"]}
        assert tops <= ({3, 4} if profile == "vllm-0.33" else {3})  # 0.33: every candidate, the sampled one first


async def test_max_tokens_defaults_to_the_rest_of_the_context() -> None:
    async with sim_servers(1, max_model_len=9) as [srv], aiohttp.ClientSession() as s:
        body = {"token_ids": PROMPT, "sampling_params": {"ignore_eos": True}}
        status, reply = await call(s, "POST", root(srv) + "/inference/v1/generate", json=body)
        choice = reply["choices"][0]
        assert (status, len(choice["token_ids"]), choice["finish_reason"]) == (200, 4, "length")
        status, _ = await call(s, "POST", root(srv) + "/inference/v1/generate",
                               json={"token_ids": list(range(9)), "sampling_params": {}})
        assert status == 400  # a prompt as long as the context


@pytest.mark.parametrize(("profile", "num_experts"), [(p, e) for p in PROFILE_NAMES for e in (64, 512)])
async def test_routed_experts(profile: ProfileName, num_experts: int) -> None:
    async with sim_servers(1, profile=profile, layers=3, top_k=2, num_experts=num_experts) as [srv], \
            aiohttp.ClientSession() as s:
        for start in (0, 2):
            status, raw = await generate_raw(s, srv, routed_experts_prompt_start=start)
            assert status == 200
            choice = orjson.loads(raw)["choices"][0]
            payload = choice["routed_experts"]
            experts = decode_experts(profile, payload)
            rows = len(PROMPT) + len(choice["token_ids"]) - 1 - start
            assert experts.shape == (rows, 3, 2)
            assert experts.dtype == (np.uint16 if num_experts > 256 else np.uint8)
            assert int(experts.max()) < num_experts
            assert all(len(set(pair)) == 2 for pair in experts.reshape(-1, 2).tolist())  # distinct per token
            if num_experts > 256:
                assert int(experts.max()) > 255  # values above uint8 survive
            if profile == "prime-rl":
                assert list(payload) == ["data", "shape", "start", "dtype"]
                assert payload["start"] == start
                assert b'"routed_experts":{"data":"' in raw  # what renderers' fast path looks for
            check_reply(profile, raw, len(PROMPT) - start)
        status, body = await generate(s, srv, routed_experts_prompt_start=len(PROMPT))
        if profile in STRICT:  # 0.31+ take 0..P
            assert decode_experts(profile, body["choices"][0]["routed_experts"]).shape[0] == \
                len(body["choices"][0]["token_ids"]) - 1
        else:
            assert (status, error_of(body)["type"]) == (400, "BadRequestError")


async def test_deterministic_under_seed_and_changed_by_loaded_weights(tmp_path: Any) -> None:
    unchanged, trained = weights_dir(tmp_path / "unchanged"), tmp_path / "trained"
    other = Policy.initial().weights
    other["context"][0] = np.random.default_rng(1).normal(0, 2, other["context"].shape[1])
    Policy(other, step=7).save(trained)
    async with sim_servers(2, seed=5) as [a, b], sim_servers(1, seed=5) as [c], aiohttp.ClientSession() as s:
        ra = [(await generate(s, a))[1]["choices"] for _ in range(4)]
        rc = [(await generate(s, c))[1]["choices"] for _ in range(4)]
        rb = [(await generate(s, b))[1]["choices"] for _ in range(4)]
        assert ra == rc
        assert ra != rb
        for srv in (a, c):  # the weights they started with: the same tokens
            await call(s, "POST", root(srv) + "/collective_rpc",
                       json={"method": "reload_weights", "kwargs": {"weights_path": str(unchanged)}})
        assert [(await generate(s, c))[1]["choices"] for _ in range(2)] == \
            [(await generate(s, a))[1]["choices"] for _ in range(2)]
        await call(s, "POST", root(c) + "/collective_rpc",
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(trained)}})
        assert c.policy.model.step == 7
        assert all(np.array_equal(c.policy.model.weights[k], w) for k, w in other.items())
        after = [(await generate(s, c))[1]["choices"] for _ in range(4)]
        again = [(await generate(s, a))[1]["choices"] for _ in range(4)]
        assert after != again  # same generator state, other weights: other tokens
        (trained / FILE).write_bytes(b"not a policy")
        status, body = await call(s, "POST", root(c) + "/collective_rpc",
                                  json={"method": "reload_weights", "kwargs": {"weights_path": str(trained)}})
        assert (status, error_of(body)["type"]) == (500, "InternalServerError")
        assert "not a tiny policy file" in body["error"]["message"]


async def test_chat_completions() -> None:
    async with sim_servers(1) as [srv], aiohttp.ClientSession() as s:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        status, reply = await call(s, "POST", srv.url + "/chat/completions", json=body)
        assert status == 200
        assert reply["object"] == "chat.completion"
        assert isinstance(reply["choices"][0]["message"]["content"], str)
        assert "weight_version" not in reply


# ------------------------------------------------------------------------------------------------ faults


@pytest.mark.parametrize("profile", PROFILE_NAMES)
async def test_malformed_replies_break_the_contract(profile: ProfileName) -> None:
    async with sim_servers(1, profile=profile, layers=2, top_k=2, faults=Faults(malformed_rate=1.0)) as [srv], \
            aiohttp.ClientSession() as s:
        for _ in range(12):
            status, raw = await generate_raw(s, srv)
            assert status == 200
            with pytest.raises((ValueError, KeyError, TypeError)):
                check_reply(profile, raw, len(PROMPT))
        assert srv.counters.malformed == 12
        assert all((g.fault or "").startswith("malformed:") for g in srv.log.generate)
        await call(s, "POST", root(srv) + "/sim/faults", json={"malformed_rate": 0.0})
        status, raw = await generate_raw(s, srv)
        check_reply(profile, raw, len(PROMPT))


@pytest.mark.parametrize("kind", ["error_rate", "drop_rate"])
async def test_injected_errors_and_drops(kind: str) -> None:
    rates: dict[str, Any] = {kind: 1.0}
    async with sim_servers(1, faults=Faults(**rates)) as [srv], aiohttp.ClientSession() as s:
        if kind == "error_rate":
            status, body = await generate(s, srv)
            assert (status, error_of(body)["type"]) == (500, "InternalServerError")
        else:
            with pytest.raises(aiohttp.ClientError):
                await generate(s, srv)
        assert await call(s, "POST", root(srv) + "/sim/faults", json={kind: 0.0}) == (200, {
            **Faults().__dict__, kind: 0.0})
        assert (await generate(s, srv))[0] == 200
        assert [g.fault for g in srv.log.generate] == ["error" if kind == "error_rate" else "drop", None]


async def test_hung_request_is_never_answered() -> None:
    async with sim_servers(1, faults=Faults(hang_rate=1.0)) as [srv], aiohttp.ClientSession() as s:
        pending = asyncio.ensure_future(generate(s, srv))
        async with asyncio.timeout(HANG_GUARD_S):
            await srv.gate.wait_until(lambda st: st.hung == 1)
        assert not pending.done()
        assert srv.counters.hangs == 1
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending


async def test_down_server_refuses_and_counts_refused_requests() -> None:
    async with sim_servers(1, faults=Faults(down=True)) as [srv], aiohttp.ClientSession() as s:
        assert (await generate(s, srv))[0] == 503
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await call(s, "POST", srv.url + "/chat/completions", json=chat))[0] == 503
        assert (await call(s, "POST", root(srv) + "/pause"))[0] == 503
        assert (srv.counters.down, srv.counters.requests) == (2, 0)  # generate and chat; admin calls are not counted
        srv.faults = Faults()
        assert (await generate(s, srv))[0] == 200
        assert (srv.counters.down, srv.counters.requests) == (2, 1)


# ----------------------------------------------------------------------------------- processes, clusters


async def test_subprocess_server_plays_its_profile_and_reports_its_log() -> None:
    async with sim_process(["--layers", "2", "--top-k", "2", "--num-experts", "512"], profile="prime-rl") as proc, \
            aiohttp.ClientSession() as s:
        assert proc.url.startswith("http://127.0.0.1:")
        _, raw = await generate_raw(s, proc, {"cache_salt": "3"})
        assert decode_experts("prime-rl", orjson.loads(raw)["choices"][0]["routed_experts"]).dtype == np.uint16
        assert await call(s, "POST", root(proc) + "/pause", params={"mode": "abort"}) == (200, {"status": "paused"})
        assert await call(s, "POST", root(proc) + "/resume") == (200, {"status": "resumed"})
        _status, log = await call(s, "GET", root(proc) + "/sim/log")
        assert (log["profile"], log["dev_mode"], log["weights_path"], log["loads"]) == ("prime-rl", True, None, 0)
        assert [(c["path"], c["query"], c["status"]) for c in log["admin"]] == [
            ("/pause", {"mode": "abort"}, 200), ("/resume", {}, 200)]
        assert log["generate"] == [{"status": 200, "cache_salt": "3", "weights_path": None, "loads": 0,
                                    "pause_mode": None, "finish_reason": log["generate"][0]["finish_reason"],
                                    "fault": None, "prompt_tokens": 5,
                                    "completion_tokens": log["generate"][0]["completion_tokens"],
                                    "token_ids": None, "routed_experts": None,
                                    "versions": None}]  # the last three kept with --record-replies
        pid = proc.pid
    assert proc.proc.returncode == 0, f"sim server {pid} did not exit cleanly"
    async with sim_process(profile="vllm-0.33", dev_mode=False) as proc, aiohttp.ClientSession() as s:
        assert await call(s, "POST", root(proc) + "/pause") == (404, {"detail": "Not Found"})
        assert await call(s, "GET", root(proc) + "/version") == (200, {"version": "0.33.0"})


async def test_cluster_kill_and_restart_keep_the_url(tmp_path: Any) -> None:
    weights_dir(tmp_path)
    async with sim_cluster(2, profile="prime-rl", layers=2, top_k=2) as cluster, aiohttp.ClientSession() as s:
        url = cluster.urls[0]
        await call(s, "POST", root(cluster[0]) + "/update_weights", json={"weight_dir": str(tmp_path)})
        assert cluster[0].loads == 1
        await cluster.kill(0)
        with pytest.raises(aiohttp.ClientConnectionError):
            await generate(s, _Url(url))
        with pytest.raises(LookupError, match="killed"):
            cluster[0].faults = Faults()
        fresh = await cluster.restart(0)
        assert (fresh.url, fresh.profile.name, fresh.loads, fresh.weights_path) == (url, "prime-rl", 0, None)
        assert (await generate(s, fresh))[0] == 200
        cluster.set_faults(1, error_rate=1.0)  # runtime control of another server
        assert (await generate(s, cluster[1]))[0] == 500


class _Url:
    """Just a URL, for a server that is no longer running."""

    def __init__(self, url: str) -> None:
        self.url = url
