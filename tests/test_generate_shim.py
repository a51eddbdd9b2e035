"""The env worker's shim between verifiers and the inference servers: vLLM 0.32/0.33 replies adapted to what
verifiers 0.4.0 reads, the weight versions they report kept per rollout, everything else passed on unchanged.

verifiers itself is imported only by the slow test (its import costs ~6 s) and writes its cache under a temporary
HOME.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pybase64
import pytest

from orchestrator.assets import tokenizer_dir
from orchestrator.columns.samples import samples_from_trace
from orchestrator.columns.versions import TokenVersions, bounded
from orchestrator.sim.profiles import ProfileName
from orchestrator.testing.procs import wait_until
from orchestrator.testing.sim import Faults, sim_cluster, sim_servers
from orchestrator.workers.adapter import Request, adapt_reply
from orchestrator.workers.shim import GenerateShim

LAYERS, TOP_K = 3, 2


def generate_body(n: int = 4, salt: str = "1", **sampling: Any) -> dict[str, Any]:
    return {"model": "sim-model", "token_ids": [5, 6, 7], "cache_salt": salt,
            "sampling_params": {"max_tokens": n, "logprobs": 1, **sampling}}


# ----------------------------------------------------------------------------------------------- adapter


def test_a_0_33_reply_becomes_what_verifiers_reads_and_a_0_31_one_keeps_its_bytes() -> None:
    from renderers.client import _parse_completion_logprobs, parse_generate_response  # what verifiers runs

    buf = io.BytesIO()
    np.save(buf, np.array([[[1, 300]], [[2, 3]]], dtype=np.int32))  # uint16 ids: one is above 255
    new: dict[str, Any] = {"choices": [{"index": 0, "finish_reason": "length", "stop_reason": None,
                                        "token_ids": [5, 6, 7],
                        "logprobs": {"content": [
                            {"token_id": 5, "logprob": -0.5, "rank": 2, "top_logprobs": [
                                {"token_id": 5, "logprob": -0.5, "rank": 2}, {"token_id": 9, "logprob": -0.1,
                                                                              "rank": 1}]},
                            {"token_id": 6, "logprob": -9999.0, "rank": None, "top_logprobs": []},
                            {"token_id": 7, "logprob": -1.5, "rank": 1, "top_logprobs": []}]},
                        "routed_experts": pybase64.b64encode(buf.getvalue()).decode(),
                        "weight_versions": [{"version": "4", "start": 0, "end": 1},
                                            {"version": "5", "start": 1, "end": 3}]}],
           "output_mode": "tokens"}
    reply = adapt_reply(orjson.dumps(new), Request(prompt_tokens=0, routed_start=1))
    assert reply.changed
    assert reply.token_ids == [5, 6, 7]
    assert reply.spans == ((4, 0, 1), (5, 1, 3))
    adapted = orjson.loads(reply.body)
    choice: dict[str, Any] = adapted["choices"][0]
    first = new["choices"][0]["logprobs"]["content"][0]
    assert choice["logprobs"]["content"][0] == {**first, "token": "token_id:5"}  # what verifiers reads, beside vLLM's
    assert choice["logprobs"]["content"][1]["logprob"] == -9999.0  # kept: verifiers refuses it, as it should
    assert list(choice["routed_experts"]) == ["data", "shape", "start", "dtype"]  # data first: its fast path
    assert choice["routed_experts"]["dtype"] == "uint16"
    assert (choice["weight_versions"], adapted["output_mode"]) == (new["choices"][0]["weight_versions"], "tokens")
    parsed = parse_generate_response(reply.body)
    experts: dict[str, Any] = parsed["choices"][0]["routed_experts"]
    got = np.frombuffer(pybase64.b64decode(bytes(experts["data"])), experts["dtype"]).reshape(experts["shape"])
    assert got.tolist() == [[[1, 300]], [[2, 3]]]
    choice["logprobs"]["content"][1]["logprob"] = -0.25
    assert _parse_completion_logprobs(choice, [5, 6, 7]) == [-0.5, -0.25, -1.5]

    old = {"choices": [{"index": 0, "token_ids": [5], "finish_reason": "stop", "routed_experts": None,
                        "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.5, "bytes": None}]}}]}
    raw = orjson.dumps(old)
    same = adapt_reply(raw, Request(0, 0))
    assert (same.body is raw, same.changed, same.spans) == (True, False, None)  # nothing to do: not re-encoded


def test_what_the_adapter_cannot_convert_is_left_for_verifiers_to_refuse() -> None:
    for junk in (b"not json", b"[]", b'{"choices": []}', b'{"choices": [7]}'):
        assert adapt_reply(junk, Request(0, 0)).body == junk
    broken = {"choices": [{"token_ids": [5], "routed_experts": "bm90IGFuIG5weQ==",  # base64, not a .npy
                           "logprobs": {"content": [{"tok": 5, "logprob": -1.0}]}}]}
    reply = adapt_reply(orjson.dumps(broken), Request(0, 0))
    assert not reply.changed
    assert orjson.loads(reply.body) == broken


# -------------------------------------------------------------------------------------------------- shim


async def test_the_shim_adapts_generate_replies_keeps_versions_and_passes_the_rest_on() -> None:
    async with sim_servers(1, profile="vllm-0.32", layers=LAYERS, top_k=TOP_K) as [srv], \
            GenerateShim.open(max_sessions=2) as shim, aiohttp.ClientSession() as client:
        srv.weight_version = "5"
        base = shim.url_for(srv.url)
        assert base.endswith("/v1")
        assert base != srv.url
        assert shim.url_for(srv.url) == base  # one upstream, one base
        async with client.get(base + "/models") as via, client.get(srv.url + "/models") as direct:
            cards = [(r.status, [(c["id"], c["max_model_len"]) for c in (await r.json())["data"]])
                     for r in (via, direct)]
        assert cards[0] == cards[1] == (200, [("sim-model", srv.max_model_len)])
        root = base.removesuffix("/v1")
        for session in ("a", "b", "a", "c"):
            async with client.post(root + "/inference/v1/generate", json=generate_body(),
                                   headers={"X-Session-ID": session}) as reply:
                assert reply.status == 200
                choice = (await reply.json())["choices"][0]
            assert choice["logprobs"]["content"][0]["token"].startswith("token_id:")
            assert isinstance(choice["routed_experts"], dict)
        async with client.post(root + "/inference/v1/generate", json=generate_body(salt="")) as reply:
            assert reply.status == 400  # refused by the server: passed on, body and all
            assert "cache_salt" in (await reply.json())["error"]["message"]
        assert shim.counts["adapted"] == 4
        assert shim.take("b") == {}  # evicted: at most two rollouts are kept, the least recently used goes
        assert shim.counts["sessions_evicted"] == 1
        calls = shim.take("a")
        assert sum(len(v) for v in calls.values()) == 2
        assert {spans for v in calls.values() for spans in v} == {((5, 0, 4),)}
        assert shim.take("a") == {}  # taken once


async def test_a_server_that_drops_or_is_gone_is_a_connection_error_through_the_shim() -> None:
    async with sim_cluster(1, profile="vllm-0.32") as cluster, GenerateShim.open() as shim, \
            aiohttp.ClientSession() as client:
        root = shim.url_for(cluster.urls[0]).removesuffix("/v1")
        cluster[0].faults = Faults(drop_rate=1.0)
        with pytest.raises(aiohttp.ClientConnectionError):
            async with client.post(root + "/inference/v1/generate", json=generate_body()) as reply:
                await reply.read()
        await cluster.kill(0)
        with pytest.raises(aiohttp.ClientConnectionError):
            async with client.post(root + "/inference/v1/generate", json=generate_body()) as reply:
                await reply.read()
        assert shim.counts["upstream_errors"] == 2


async def test_a_request_a_paused_0_33_server_refuses_waits_for_the_resume() -> None:
    """vLLM 0.33 answers 503 to new requests during an abort or wait pause: the shim sends it again until the
    server takes it. Any other 503 goes back at once."""
    async with sim_servers(1, profile="vllm-0.33") as [srv], GenerateShim.open() as shim, \
            aiohttp.ClientSession() as client:
        root = shim.url_for(srv.url).removesuffix("/v1")
        async with client.post(srv.url.removesuffix("/v1") + "/pause", params={"mode": "abort"}) as paused:
            assert paused.status == 200
        waiting = asyncio.ensure_future(client.post(root + "/inference/v1/generate", json=generate_body()))
        await wait_until(lambda: srv.counters.refused_paused >= 2, 30, "two refusals while paused", poll_s=0.01)
        assert not waiting.done()
        async with client.post(srv.url.removesuffix("/v1") + "/resume") as resumed:
            assert resumed.status == 200
        reply = await asyncio.wait_for(waiting, 30)
        assert reply.status == 200
        assert len((await reply.json())["choices"][0]["token_ids"]) >= 1
        reply.release()
        assert shim.counts["retried_paused"] >= 2
        srv.faults = Faults(down=True)  # another 503: not a pause
        async with client.post(root + "/inference/v1/generate", json=generate_body()) as down:
            assert down.status == 503
        assert srv.counters.down == 1


# ------------------------------------------------------------------------------------- with verifiers


async def run_slots(url: str, n: int) -> list[Any]:
    import verifiers.v1 as vf
    from renderers.configs import DefaultRendererConfig

    cfg = vf.resolve_env_config({"taskset": {"id": "orchestrator-guess-number", "num_tasks": 4},
                                 "agent": {"runtime": {"type": "subprocess"}}})
    env = vf.load_environment(cfg)
    task = next(iter(env.taskset))
    client = vf.TrainClientConfig(base_url=url, renderer=DefaultRendererConfig(),
                                  renderer_model_name=str(tokenizer_dir()))
    ctx = vf.ModelContext(model="sim-model", client=client, sampling=vf.SamplingConfig(max_tokens=12))
    async with env.serving():
        return [await env.run_slot(slot, ctx) for slot in env.slots(task, n)]


@pytest.mark.slow
@pytest.mark.parametrize(("profile", "layers"), [("vllm-0.26", LAYERS), ("vllm-0.31", 0), ("vllm-0.32", LAYERS),
                                                 ("vllm-0.33", 0)])
async def test_verifiers_reads_every_vllm_through_the_shim_and_samples_carry_versions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile: ProfileName, layers: int) -> None:
    """Multi-turn rollouts (guess-number) of verifiers' own client, through the shim: every reply reads, routed
    experts included (upstream vLLM's .npy), and each sampled token's version is the server's label where it
    reports one (0.32+), else bounded by the rollout's policy."""
    monkeypatch.setenv("HOME", str(tmp_path))
    async with sim_servers(1, profile=profile, layers=layers, top_k=TOP_K if layers else 0) as [srv], \
            GenerateShim.open() as shim:
        srv.weight_version = "5"
        episodes = await run_slots(shim.url_for(srv.url), 2)
    for ep in episodes:
        assert ep.ok, ep.errors
        trace = ep.traces[0]
        assert trace.ok, trace.errors
        assert trace.num_turns >= 2
        versions = TokenVersions(3, shim.take(trace.id))
        samples = samples_from_trace(trace, versions)
        for s in samples:
            assert s.versions is not None
            sampled = s.versions[s.loss_mask != 0]
            assert sampled.size
            assert set(sampled.tolist()) == ({5} if profile >= "vllm-0.32" else {bounded(3)})
            assert set(s.versions[s.loss_mask == 0].tolist()) == {-1}
            if layers:
                assert s.routed_experts is not None
                assert s.routed_experts.shape == (s.num_tokens, LAYERS, TOP_K)
    assert shim.counts["adapted"] > 0 if (layers or profile >= "vllm-0.32") else shim.counts["adapted"] == 0
