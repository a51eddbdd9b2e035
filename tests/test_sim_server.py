from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import orjson
import pytest

from orchestrator.inference.replies import parse_generate_reply
from orchestrator.sim.server import Faults, SimServer
from orchestrator.sim.vocab import SimVocab
from orchestrator.testing.sim import sim_process, sim_servers

PROMPT = [2, 5, 14, 11, 113]


async def generate(session: aiohttp.ClientSession, server: SimServer | SimServerRef,
                   **sp: object) -> tuple[int, bytes, str]:
    body = {"model": "sim-model", "token_ids": PROMPT, "sampling_params": {"max_tokens": 12, **sp}}
    async with session.post(server.url.removesuffix("/v1") + "/inference/v1/generate", json=body) as r:
        return r.status, await r.read(), r.headers.get("X-Weight-Version", "")


async def test_generate_reply_matches_the_protocol() -> None:
    async with sim_servers(1, layers=3, top_k=2) as [srv], aiohttp.ClientSession() as s:
        status, raw, version = await generate(s, srv, stop_token_ids=[3])
        assert (status, version) == (200, "0")
        gen = parse_generate_reply(raw, len(PROMPT))
        assert 1 <= gen.token_ids.size <= 12
        assert gen.logprobs.dtype == np.float32
        assert np.all(gen.logprobs < 0)
        assert gen.finish_reason in ("stop", "length")
        assert gen.routed_experts is not None
        assert gen.routed_experts.shape == (len(PROMPT) + gen.token_ids.size, 3, 2)
        assert gen.weight_version == 0
        vocab = SimVocab.load()
        assert all(0 <= t < vocab.size for t in gen.token_ids.tolist())


async def test_routed_experts_honour_prompt_start() -> None:
    async with sim_servers(1, layers=2, top_k=4) as [srv], aiohttp.ClientSession() as s:
        _, raw, _ = await generate(s, srv, routed_experts_prompt_start=3)
        gen = parse_generate_reply(raw, len(PROMPT))
        assert gen.routed_start == 3
        assert gen.routed_experts is not None
        assert gen.routed_experts.shape[0] == len(PROMPT) - 3 + gen.token_ids.size


async def test_deterministic_under_seed() -> None:
    async with (
        sim_servers(1, seed=5) as [a],
        sim_servers(1, seed=5) as [b],
        sim_servers(1, seed=6) as [c],
        aiohttp.ClientSession() as s,
    ):
        ra = [(await generate(s, a))[1] for _ in range(5)]
        rb = [(await generate(s, b))[1] for _ in range(5)]
        rc = [(await generate(s, c))[1] for _ in range(5)]
    strip = [orjson.loads(x)["choices"] for x in ra]
    assert strip == [orjson.loads(x)["choices"] for x in rb]
    assert strip != [orjson.loads(x)["choices"] for x in rc]


async def test_max_tokens_and_temperature() -> None:
    async with sim_servers(1) as [srv], aiohttp.ClientSession() as s:
        lengths = []
        for _ in range(20):
            _, raw, _ = await generate(s, srv, max_tokens=3, stop_token_ids=[])
            lengths.append(len(orjson.loads(raw)["choices"][0]["token_ids"]))
        assert max(lengths) == 3
        _, cold, _ = await generate(s, srv, temperature=0.05, max_tokens=50)
        assert np.mean(parse_generate_reply(cold, len(PROMPT)).logprobs) > -1.0  # near-greedy: likely tokens


async def test_pause_holds_requests_and_update_changes_version() -> None:
    async with sim_servers(1) as [srv], aiohttp.ClientSession() as s:
        root = srv.url.removesuffix("/v1")
        await s.post(root + "/pause")
        pending = asyncio.ensure_future(generate(s, srv))
        await asyncio.sleep(0.1)
        assert not pending.done()  # waiting, not failed
        async with s.post(root + "/update_weights", json={"step": 7, "path": "/ckpt/7"}) as r:
            assert (await r.json())["weight_version"] == 7
        await s.post(root + "/resume")
        status, raw, header = await asyncio.wait_for(pending, 5)
        assert (status, header, orjson.loads(raw)["weight_version"]) == (200, "7", 7)
        assert srv.weights_path == "/ckpt/7"


async def test_models_and_health() -> None:
    async with sim_servers(1) as [srv], aiohttp.ClientSession() as s:
        async with s.get(srv.url + "/models") as r:
            card = (await r.json())["data"][0]
        assert (card["id"], card["max_model_len"]) == ("sim-model", 4096)
        async with s.get(srv.url.removesuffix("/v1") + "/health") as r:
            assert (await r.json())["status"] == "ok"


async def test_chat_completions() -> None:
    async with sim_servers(1) as [srv], aiohttp.ClientSession() as s:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        async with s.post(srv.url + "/chat/completions", json=body) as r:
            reply = await r.json()
        assert reply["object"] == "chat.completion"
        assert isinstance(reply["choices"][0]["message"]["content"], str)


@pytest.mark.parametrize("kind", ["error_rate", "malformed_rate", "drop_rate"])
async def test_injected_faults(kind: str) -> None:
    async with sim_servers(1, faults=Faults(**{kind: 1.0})) as [srv], aiohttp.ClientSession() as s:
        if kind == "error_rate":
            assert (await generate(s, srv))[0] == 500
        elif kind == "malformed_rate":
            for _ in range(8):
                _, raw, _ = await generate(s, srv)
                with pytest.raises(Exception, match="generate reply"):
                    parse_generate_reply(raw, len(PROMPT))
        else:
            with pytest.raises(aiohttp.ClientError):
                await generate(s, srv)
        # faults switch off at run time, over HTTP
        async with s.post(srv.url.removesuffix("/v1") + "/sim/faults", json={kind: 0.0}) as r:
            assert r.status == 200
        assert (await generate(s, srv))[0] == 200


async def test_hung_request_never_answers() -> None:
    async with sim_servers(1, faults=Faults(hang_rate=1.0)) as [srv], aiohttp.ClientSession() as s:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await generate(s, srv)
        assert srv.counters.hangs == 1


async def test_down_server_refuses_and_counts_refused_requests() -> None:
    async with sim_servers(1, faults=Faults(down=True)) as [srv], aiohttp.ClientSession() as s:
        assert (await generate(s, srv))[0] == 503
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with s.post(srv.url + "/chat/completions", json=chat) as r:
            assert r.status == 503
        async with s.get(srv.url.removesuffix("/v1") + "/health") as r:
            assert r.status == 503
        assert (srv.counters.down, srv.counters.requests) == (2, 0)  # generate and chat; probes are not counted
        srv.faults = Faults()
        assert (await generate(s, srv))[0] == 200
        assert (srv.counters.down, srv.counters.requests) == (2, 1)


async def test_subprocess_server_prints_address_and_stops() -> None:
    async with sim_process(["--layers", "2", "--top-k", "2"]) as proc, aiohttp.ClientSession() as s:
        assert proc.url.startswith("http://127.0.0.1:")
        async with s.get(proc.url + "/models") as r:
            assert r.status == 200
        pid = proc.pid
    assert proc.proc.returncode == 0, f"sim server {pid} did not exit cleanly"


async def test_cluster_kill_and_restart_keep_the_url() -> None:
    from orchestrator.testing.sim import sim_cluster

    async with sim_cluster(2, layers=2, top_k=2) as cluster, aiohttp.ClientSession() as s:
        url = cluster.urls[0]
        await cluster.kill(0)
        with pytest.raises(aiohttp.ClientConnectionError):
            await generate(s, SimServerRef(url))
        with pytest.raises(LookupError, match="killed"):
            cluster[0].faults = Faults()
        fresh = await cluster.restart(0)
        assert fresh.url == url
        status, _, version = await generate(s, fresh)
        assert (status, version) == (200, "0")
        cluster.set_faults(1, error_rate=1.0)  # runtime control of another server
        assert (await generate(s, cluster[1]))[0] == 500


class SimServerRef:
    """Just a URL, for a server that is no longer running."""

    def __init__(self, url: str) -> None:
        self.url = url
