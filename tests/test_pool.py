from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest

from orchestrator.config import InferenceConfig
from orchestrator.errors import InferenceError, MalformedReply
from orchestrator.inference.pool import InferencePool
from orchestrator.sim.server import Faults, SimServer
from orchestrator.testing.sim import sim_cluster, sim_process, sim_servers

PROMPT = [2, 5, 14, 11, 113]
SAMPLING = {"max_tokens": 8}


def config(urls: list[str], **kw: object) -> InferenceConfig:
    defaults: dict[str, object] = {"request_timeout_s": 2.0, "max_retries": 0, "failures_to_evict": 2,
                                   "probe_interval_s": 0.05, "weight_sync_timeout_s": 2.0,
                                   "no_server_warn_interval_s": 0.2}
    return InferenceConfig(servers=tuple(urls), **{**defaults, **kw})  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def pool_over(servers: list[SimServer] | list[str], **kw: object) -> AsyncIterator[InferencePool]:
    urls = [s if isinstance(s, str) else s.url for s in servers]
    async with InferencePool.open(config(urls, **kw)) as pool, asyncio.TaskGroup() as tg:
        prober = tg.create_task(pool.run())
        yield pool
        prober.cancel()


async def test_least_loaded_choice_and_pinning() -> None:
    async with sim_servers(3) as servers, pool_over(servers) as pool:
        async with contextlib.AsyncExitStack() as stack:
            leased = [await stack.enter_async_context(pool.lease(4)) for _ in range(3)]
            assert sorted(s.url for s in leased) == sorted(s.url for s in servers)  # spread one group each
            assert [s.inflight for s in pool.servers] == [4, 4, 4]
            group_server = leased[0]
            for _ in range(4):  # every rollout of the group goes to its pinned server
                await pool.generate(group_server, PROMPT, SAMPLING)
            assert servers[[s.url for s in servers].index(group_server.url)].counters.requests == 4
        assert [s.inflight for s in pool.servers] == [0, 0, 0]


async def test_weight_sync_tags_every_reply() -> None:
    async with sim_servers(2) as servers, pool_over(servers) as pool:
        result = await pool.update_weights(3, "/ckpt/3")
        assert sorted(result.updated) == sorted(s.url for s in servers)
        assert not result.failed
        for server in pool.servers:
            gen = await pool.generate(server, PROMPT, SAMPLING)
            assert gen.weight_version == 3
        assert all(s.version == 3 and s.weights_path == "/ckpt/3" for s in servers)


async def test_500s_are_counted_and_evict(caplog: pytest.LogCaptureFixture) -> None:
    async with sim_servers(2) as servers, pool_over(servers, probe_interval_s=60.0) as pool:
        servers[0].faults = Faults(error_rate=1.0)
        bad = pool.servers[0]
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                with pytest.raises(InferenceError, match="HTTP 500"):
                    await pool.generate(bad, PROMPT, SAMPLING)
        assert not bad.in_rotation
        assert pool.metrics["evictions"] == 1
        assert "leaves rotation" in caplog.text
        async with pool.lease(1) as chosen:  # the job continues on the other server
            assert chosen.url == servers[1].url
            await pool.generate(chosen, PROMPT, SAMPLING)


async def test_hang_times_out_and_counts() -> None:
    async with sim_servers(1, faults=Faults(hang_rate=1.0)) as servers, \
            pool_over(servers, request_timeout_s=0.2, probe_interval_s=60.0) as pool:
        with pytest.raises(InferenceError, match="took more than"):
            await pool.generate(pool.servers[0], PROMPT, SAMPLING)
        assert pool.metrics["failed:timeout"] == 1


async def test_malformed_replies_are_counted_never_crash() -> None:
    async with sim_servers(1, layers=2, top_k=2, faults=Faults(malformed_rate=1.0)) as servers, \
            pool_over(servers, failures_to_evict=100, probe_interval_s=60.0) as pool:
        for _ in range(12):
            with pytest.raises(MalformedReply):
                await pool.generate(pool.servers[0], PROMPT, SAMPLING)
        assert pool.metrics["malformed"] == 12
        servers[0].faults = Faults()
        gen = await pool.generate(pool.servers[0], PROMPT, SAMPLING)
        assert gen.token_ids.size >= 1


async def test_retries_on_the_same_server() -> None:
    async with sim_servers(1, seed=3) as servers, pool_over(servers, max_retries=3, failures_to_evict=10) as pool:
        servers[0].faults = Faults(error_rate=0.5)
        gens = [await pool.generate(pool.servers[0], PROMPT, SAMPLING) for _ in range(10)]
        assert len(gens) == 10
        assert servers[0].counters.errors > 0


async def test_all_down_then_back(caplog: pytest.LogCaptureFixture) -> None:
    async with sim_servers(2) as servers, pool_over(servers, failures_to_evict=1) as pool:
        for sim, server in zip(servers, pool.servers, strict=True):
            sim.faults = Faults(down=True)
            with pytest.raises(InferenceError):
                await pool.generate(server, PROMPT, SAMPLING)
        assert not any(s.in_rotation for s in pool.servers)
        with caplog.at_level(logging.WARNING):
            waiting = asyncio.ensure_future(pool.lease(1).__aenter__())
            await asyncio.sleep(0.1)
            assert not waiting.done()
            for sim in servers:  # health answers again: the probe puts them back
                sim.faults = Faults()
            server = await asyncio.wait_for(waiting, 5)
        assert server.in_rotation
        assert "no inference server in rotation" in caplog.text
        assert pool.metrics["rejoins"] >= 1


async def test_server_killed_mid_run_then_restarted() -> None:
    async with sim_servers(1) as [alive], sim_process() as proc:
        cfg = config([proc.url, alive.url], failures_to_evict=1, probe_interval_s=0.05)
        async with InferencePool.open(cfg) as pool, asyncio.TaskGroup() as tg:
            prober = tg.create_task(pool.run())
            await pool.generate(pool.servers[0], PROMPT, SAMPLING)
            proc.kill()
            await proc.proc.wait()
            with pytest.raises(InferenceError, match="Cannot connect"):
                await pool.generate(pool.servers[0], PROMPT, SAMPLING)
            assert not pool.servers[0].in_rotation
            result = await pool.update_weights(1)  # sync while it is down: it is reported failed
            assert list(result.failed) == [proc.url]
            assert result.updated == [alive.url]
            async with pool.lease(1) as s:
                assert s.url == alive.url
            prober.cancel()


async def test_replies_name_the_policy_across_a_weight_sync() -> None:
    async with sim_servers(2) as servers, pool_over(servers) as pool:
        server = pool.servers[0]
        before = [await pool.generate(server, PROMPT, SAMPLING) for _ in range(2)]
        servers[0].faults = Faults(latency_ms=20.0)  # requests in flight while the sync pauses the server
        during = [asyncio.ensure_future(pool.generate(server, PROMPT, SAMPLING)) for _ in range(6)]
        result = await pool.update_weights(1, "/ckpt/1")
        assert not result.failed
        versions = [(await f).weight_version for f in during]  # paused requests waited, none failed
        after = [await pool.generate(s, PROMPT, SAMPLING) for s in pool.servers]
    assert [g.weight_version for g in before] == [0, 0]
    assert set(versions) <= {0, 1}
    assert [g.weight_version for g in after] == [1, 1]
    assert [s.version for s in pool.servers] == [1, 1]


async def test_timeout_evicts_at_once_and_drops_are_counted() -> None:
    async with sim_cluster(2) as cluster, \
            pool_over(cluster.urls, request_timeout_s=0.2, failures_to_evict=5, probe_interval_s=60.0) as pool:
        cluster.set_faults(0, hang_rate=1.0)
        cluster.set_faults(1, drop_rate=1.0)
        with pytest.raises(InferenceError, match="took more than"):
            await pool.generate(pool.servers[0], PROMPT, SAMPLING)
        with pytest.raises(InferenceError, match="Server disconnected"):
            await pool.generate(pool.servers[1], PROMPT, SAMPLING)
        assert not pool.servers[0].in_rotation  # one timeout is enough
        assert pool.servers[1].in_rotation  # one dropped connection is not
        assert (pool.metrics["timeouts"], pool.metrics["failed:provider_error"]) == (1, 1)
        assert (cluster[0].counters.hangs, cluster[1].counters.drops) == (1, 1)


async def test_waiters_share_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    async with sim_cluster(1) as cluster, pool_over(cluster.urls, failures_to_evict=1,
                                                   no_server_warn_interval_s=30.0) as pool:
        await cluster.kill(0)
        with pytest.raises(InferenceError):
            await pool.generate(pool.servers[0], PROMPT, SAMPLING)
        with caplog.at_level(logging.WARNING):
            waiters = [asyncio.ensure_future(pool.acquire(1)) for _ in range(5)]
            for _ in range(5):
                await asyncio.sleep(0)
            assert not any(w.done() for w in waiters)
            await cluster.restart(0)
            servers = await asyncio.wait_for(asyncio.gather(*waiters), 5)
        assert caplog.text.count("no inference server in rotation") == 1
        assert all(s is pool.servers[0] for s in servers)
        assert pool.servers[0].inflight == 5


async def test_killed_server_rejoins_with_new_weights_after_restart() -> None:
    async with sim_cluster(1) as cluster, pool_over(cluster.urls, failures_to_evict=1) as pool:
        server = pool.servers[0]
        cluster.set_faults(0, hang_rate=1.0)
        inflight = asyncio.ensure_future(pool.generate(server, PROMPT, SAMPLING))
        for _ in range(500):  # bounded: until the server holds the request
            if cluster[0].counters.hangs:
                break
            await asyncio.sleep(0.002)
        assert cluster[0].counters.hangs == 1
        await cluster.kill(0)  # mid-request
        with pytest.raises(InferenceError):
            await inflight
        assert not server.in_rotation
        result = await pool.update_weights(2, "/ckpt/2")
        assert list(result.failed) == [cluster.urls[0]]
        waiting = asyncio.ensure_future(pool.acquire(1))
        restarted = await cluster.restart(0)
        assert restarted.version == 0  # a fresh process lost its weights
        assert await asyncio.wait_for(waiting, 5) is server  # the probe updated it before it rejoined
        gen = await pool.generate(server, PROMPT, SAMPLING)
        assert (gen.weight_version, restarted.version, restarted.weights_path) == (2, 2, "/ckpt/2")
        assert (pool.metrics["rejoins"], pool.metrics["weight_sync_failed"]) == (1, 1)


def test_reply_parser_raises_only_malformed_reply() -> None:
    """Every mutation of a valid reply either parses or raises MalformedReply (never another exception)."""
    import random

    import orjson

    from orchestrator.inference.replies import parse_generate_reply

    valid = {"choices": [{"token_ids": [5, 6], "finish_reason": "stop", "logprobs": {"content": [
        {"token": "token_id:5", "logprob": -1.0}, {"token": "token_id:6", "logprob": -0.5}]},
        "routed_experts": {"data": "AAAAAAAAAAAAAAAAAAA=", "shape": [7, 2, 1], "start": 0}}], "weight_version": 0}
    gen = parse_generate_reply(orjson.dumps(valid), 5)
    assert gen.routed_experts is not None
    assert gen.routed_experts.shape == (7, 2, 1)
    junk: list[object] = [None, "x", -1, 2**40, 1.5, [], {}, [1], {"a": 1}, True]
    rng = random.Random(0)
    outcomes = set()
    for _ in range(400):  # bounded fuzz: replace one nested value with junk
        reply = orjson.loads(orjson.dumps(valid))
        path: list[tuple[object, object]] = []
        node: object = reply
        while isinstance(node, dict | list) and node and rng.random() < 0.8:
            key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
            path.append((node, key))
            node = node[key]  # type: ignore[index]
        if not path:
            continue
        parent, key = path[-1]
        parent[key] = rng.choice(junk)  # type: ignore[index]
        try:
            parse_generate_reply(orjson.dumps(reply), 5)
            outcomes.add("ok")
        except MalformedReply:
            outcomes.add("malformed")
    assert "malformed" in outcomes


async def test_pool_over_fake_servers_follows_the_protocol() -> None:
    from orchestrator.testing.sim import FakeInferenceServer

    fakes = [FakeInferenceServer(f"http://fake-{i}.invalid/v1") for i in range(2)]
    pool = InferencePool(config([f.url for f in fakes], failures_to_evict=1), fakes)
    fakes[1].fail_with = InferenceError("connection: refused")
    result = await pool.update_weights(4, "/ckpt/4")
    assert (result.updated, list(result.failed)) == ([fakes[0].url], [fakes[1].url])
    assert fakes[0].calls == ["pause", "update_weights", "resume"]
    assert not fakes[0].paused
    async with pool.lease(2) as server:
        assert server.url == fakes[0].url
        gen = await pool.generate(server, PROMPT, {"max_tokens": 2})
    assert (gen.token_ids.tolist(), gen.weight_version) == ([7, 8], 4)
    fakes[0].fail_with = InferenceError("http_500: injected")
    with pytest.raises(InferenceError):
        await pool.generate(pool.servers[0], PROMPT, {})
    fakes[1].fail_with = None
    async with asyncio.TaskGroup() as tg:
        prober = tg.create_task(pool.run())
        server = await asyncio.wait_for(pool.acquire(1), 5)  # waits for the probe to bring fake 1 back
        prober.cancel()
    assert server is pool.servers[1]
    assert (fakes[1].version, server.version) == (4, 4)  # updated before it rejoined
