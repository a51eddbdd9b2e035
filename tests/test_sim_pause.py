"""Pauses while generating, as each real server does them (sources in ``orchestrator.sim.profiles``).

- keep: in-flight and new requests wait until ``/resume``, then sample with the weights loaded at that moment (what
  an in-flight request had sampled before the pause stays the old weights': two version spans on 0.32+);
- abort: requests waiting in the server answer 200 with ``finish_reason: "abort"``; new ones queue (0.26,
  0.32) or get 503 (0.33);
- wait: in-flight requests finish and ``/pause`` returns then; new ones queue (0.33: 503);
- prime-rl's ``/pause`` is always keep.

A request "in flight" is held inside the server by ``Faults(hold=True)`` (or a long latency) until the test
lets it go; tests wait for the server's state (``gate.wait_until``), never for time to pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from orchestrator.sim.gate import GateState
from orchestrator.sim.profiles import ProfileName
from orchestrator.sim.server import Faults, SimServer
from orchestrator.testing.sim import sim_servers, weights_dir
from test_sim_server import HANG_GUARD_S, VLLM, call, error_of, generate, root

PAUSED_503 = {"error": {"message": "Generation is paused. Please retry after it resumes.",
                        "type": "ServiceUnavailableError", "param": None, "code": 503}}


async def until(srv: SimServer, done: Callable[[GateState], bool]) -> None:
    async with asyncio.timeout(HANG_GUARD_S):  # a hang guard, not a timing assumption
        await srv.gate.wait_until(done)


def started(s: aiohttp.ClientSession, srv: SimServer, **kwargs: Any) -> asyncio.Future[tuple[int, Any]]:
    return asyncio.ensure_future(generate(s, srv, **kwargs))


async def load(s: aiohttp.ClientSession, srv: SimServer, path: Path) -> None:
    weights_dir(path)
    if srv.profile.prime_rl:
        assert await call(s, "POST", root(srv) + "/update_weights", json={"weight_dir": str(path)}) == (
            200, {"status": "ok"})
    else:
        assert await call(s, "POST", root(srv) + "/collective_rpc", json={
            "method": "reload_weights", "kwargs": {"weights_path": str(path)}}) == (200, {"results": [None]})


@pytest.mark.parametrize("profile", [*VLLM, "prime-rl"])
async def test_keep_pause_holds_requests_until_resume_then_samples_new_weights(profile: ProfileName,
                                                                               tmp_path: Path) -> None:
    async with sim_servers(1, profile=profile, faults=Faults(hold=True)) as [srv], aiohttp.ClientSession() as s:
        inflight = started(s, srv, ignore_eos=True)  # its 12 tokens: 6 before the pause (held), 6 after
        await until(srv, lambda st: st.running == 1)
        # prime-rl ignores the query and always keeps; vLLM keeps because it is asked to
        assert await call(s, "POST", root(srv) + "/pause", params={"mode": "keep", "clear_cache": "false"}) == (
            200, {"status": "paused"})
        srv.faults = Faults()  # the in-flight request would finish now, but the keep pause freezes it
        await until(srv, lambda st: st.frozen == 1 and st.running == 0)
        new = started(s, srv)
        await until(srv, lambda st: st.queued == 1)
        await load(s, srv, tmp_path)
        if srv.profile.weight_version_routes:
            await call(s, "POST", root(srv) + "/update_weight_version", json={"new_version": "1"})
        assert not inflight.done()
        assert not new.done()
        assert await call(s, "POST", root(srv) + "/resume") == (200, {"status": "resumed"})
        async with asyncio.timeout(HANG_GUARD_S):
            replies = [await inflight, await new]
    expected: list[list[tuple[str, int, int | None]]] = [[("default", 0, 6), ("1", 6, 12)], [("1", 0, None)]]
    for (status, reply), spans in zip(replies, expected, strict=True):
        choice = reply["choices"][0]
        assert status == 200
        assert choice["finish_reason"] in ("stop", "length")
        if srv.profile.weight_versions:  # the label the engine had when each token was sampled
            assert choice["weight_versions"] == [{"version": v, "start": a, "end": b or len(choice["token_ids"])}
                                                 for v, a, b in spans]
    assert [(g.weights_path, g.loads) for g in srv.log.generate] == [(str(tmp_path), 1)] * 2
    assert {g.pause_mode for g in srv.log.generate} == {None, "keep"}  # the one in flight, and the new one


async def test_each_keep_pause_a_request_spans_starts_a_span_of_the_new_label() -> None:
    """As on a real 0.32.0 (a 1,500-token request across two keep pauses: three spans, profiles.py): the tokens
    sampled before each pause carry the label the engine had then; consecutive spans tile the reply."""
    async with sim_servers(1, profile="vllm-0.32", faults=Faults(hold=True)) as [srv], aiohttp.ClientSession() as s:
        inflight = started(s, srv, ignore_eos=True)
        await until(srv, lambda st: st.running == 1)
        for label in ("1", "2"):  # held throughout: half of what is left is out at each pause
            await call(s, "POST", root(srv) + "/pause", params={"mode": "keep", "clear_cache": "false"})
            await call(s, "POST", root(srv) + "/update_weight_version", json={"new_version": label})
            await call(s, "POST", root(srv) + "/resume")
        srv.faults = Faults()
        async with asyncio.timeout(HANG_GUARD_S):
            status, reply = await inflight
    assert status == 200
    choice = reply["choices"][0]
    assert len(choice["token_ids"]) == 12
    assert [(v["version"], v["start"], v["end"]) for v in choice["weight_versions"]] == [
        ("default", 0, 6), ("1", 6, 9), ("2", 9, 12)]


@pytest.mark.parametrize("profile", VLLM)
@pytest.mark.parametrize("inside", ["held", "in latency"])
async def test_abort_pause_ends_requests_in_the_server(profile: ProfileName, inside: str) -> None:
    faults = Faults(hold=True) if inside == "held" else Faults(latency_ms=3_600_000)  # ended by the abort only
    async with sim_servers(1, profile=profile, faults=faults) as [srv], aiohttp.ClientSession() as s:
        inflight = started(s, srv)
        await until(srv, lambda st: st.running == 1)
        assert await call(s, "POST", root(srv) + "/pause") == (200, {"status": "paused"})  # default: abort
        async with asyncio.timeout(HANG_GUARD_S):
            status, reply = await inflight
        choice = reply["choices"][0]
        assert (status, choice["finish_reason"], choice["token_ids"], choice["logprobs"]) == (
            200, "abort", [], {"content": []})
        assert choice["routed_experts"] is None
        assert choice.get("weight_versions", []) == []
        assert srv.counters.aborted == 1
        srv.faults = Faults()
        if profile == "vllm-0.33":
            assert await generate(s, srv) == (503, PAUSED_503)
            assert (srv.log.generate[-1].status, srv.counters.refused_paused) == (503, 1)
        else:
            new = started(s, srv)
            await until(srv, lambda st: st.queued == 1)
            await call(s, "POST", root(srv) + "/resume")
            async with asyncio.timeout(HANG_GUARD_S):
                status, reply = await new
            assert (status, reply["choices"][0]["finish_reason"] != "abort") == (200, True)
        assert srv.log.generate[0].finish_reason == "abort"


@pytest.mark.parametrize("profile", VLLM)
async def test_abort_pause_ends_requests_queued_by_a_keep_pause(profile: ProfileName) -> None:
    async with sim_servers(1, profile=profile) as [srv], aiohttp.ClientSession() as s:
        await call(s, "POST", root(srv) + "/pause", params={"mode": "keep"})
        queued = started(s, srv)  # 0.33 queues under keep too
        await until(srv, lambda st: st.queued == 1)
        await call(s, "POST", root(srv) + "/pause", params={"mode": "abort"})
        async with asyncio.timeout(HANG_GUARD_S):
            status, reply = await queued
        assert (status, reply["choices"][0]["finish_reason"]) == (200, "abort")


@pytest.mark.parametrize("profile", ["vllm-0.26", "vllm-0.33"])
async def test_wait_pause_returns_once_requests_in_flight_finish(profile: ProfileName) -> None:
    async with sim_servers(1, profile=profile, faults=Faults(hold=True)) as [srv], aiohttp.ClientSession() as s:
        inflight = started(s, srv, ignore_eos=True)  # its 12 tokens: 6 before the pause (held), 6 after
        await until(srv, lambda st: st.running == 1)
        # 0.26 also takes its deprecated spelling of mode=wait
        params = {"wait_for_inflight_requests": "true"} if profile == "vllm-0.26" else {"mode": "wait"}
        pausing = asyncio.ensure_future(call(s, "POST", root(srv) + "/pause", params=params))
        await until(srv, lambda st: st.mode == "wait")
        assert not pausing.done()  # /pause waits for the request in flight
        if profile == "vllm-0.33":
            status, body = await generate(s, srv)
            assert (status, body) == (503, PAUSED_503)
        else:
            new = started(s, srv)
            await until(srv, lambda st: st.queued == 1)
        srv.faults = Faults()
        async with asyncio.timeout(HANG_GUARD_S):
            assert await pausing == (200, {"status": "paused"})
            status, reply = await inflight
        assert (status, reply["choices"][0]["finish_reason"] in ("stop", "length")) == (200, True)
        await call(s, "POST", root(srv) + "/resume")
        if profile != "vllm-0.33":
            async with asyncio.timeout(HANG_GUARD_S):
                assert (await new)[0] == 200


async def test_prime_rl_never_aborts() -> None:
    async with sim_servers(1, profile="prime-rl", faults=Faults(hold=True)) as [srv], aiohttp.ClientSession() as s:
        inflight = started(s, srv)
        await until(srv, lambda st: st.running == 1)
        assert await call(s, "POST", root(srv) + "/pause", params={"mode": "abort"}) == (200, {"status": "paused"})
        assert srv.gate.state().running == 1
        assert not inflight.done()
        srv.faults = Faults()
        await until(srv, lambda st: st.frozen == 1)
        await call(s, "POST", root(srv) + "/resume")
        async with asyncio.timeout(HANG_GUARD_S):
            status, reply = await inflight
        assert (status, reply["choices"][0]["finish_reason"] in ("stop", "length")) == (200, True)
        assert srv.counters.aborted == 0


async def test_paused_server_is_healthy_and_0_33_refusal_is_an_error_response() -> None:
    async with sim_servers(1, profile="vllm-0.33") as [srv], aiohttp.ClientSession() as s:
        await call(s, "POST", root(srv) + "/pause", params={"mode": "abort"})
        assert (await call(s, "GET", root(srv) + "/health"))[0] == 200
        status, body = await generate(s, srv)
        assert (status, error_of(body)) == (503, {"type": "ServiceUnavailableError", "param": None, "code": 503})
