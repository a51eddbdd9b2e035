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
from orchestrator.testing.sim import sim_process, sim_servers

PROMPT = [2, 5, 14, 11, 113]
SAMPLING = {"max_tokens": 8}


def config(urls: list[str], **kw: object) -> InferenceConfig:
    defaults: dict[str, object] = {"request_timeout_s": 2.0, "max_retries": 0, "failures_to_evict": 2,
                                   "probe_interval_s": 0.05, "weight_sync_timeout_s": 2.0,
                                   "no_server_warn_interval_s": 0.2}
    return InferenceConfig(servers=tuple(urls), **{**defaults, **kw})  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def pool_over(servers: list[SimServer], **kw: object) -> AsyncIterator[InferencePool]:
    async with InferencePool.open(config([s.url for s in servers], **kw)) as pool, asyncio.TaskGroup() as tg:
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
        with pytest.raises(InferenceError, match="timeout"):
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
            with pytest.raises(InferenceError, match="connection"):
                await pool.generate(pool.servers[0], PROMPT, SAMPLING)
            assert not pool.servers[0].in_rotation
            result = await pool.update_weights(1)  # sync while it is down: it is reported failed
            assert list(result.failed) == [proc.url]
            assert result.updated == [alive.url]
            async with pool.lease(1) as s:
                assert s.url == alive.url
            prober.cancel()
