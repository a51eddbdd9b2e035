"""The inference pool over in-memory servers: choice and pinning, health and eviction, weight sync per
backend (the calls and bodies each real server takes), rejoin only after a re-sync, and the reply parser
preflight uses. Runs against real HTTP servers are in test_real_servers.py.

The event loop's clock is virtual (orchestrator.testing.clock): the timing rules run with the package's own
defaults and bounds (a 1 s probe interval, 600 s weight-sync calls, a warning every 30 s), at full speed, and the
tests can say when each thing happened."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import itertools
import logging
import random
import re
import shutil
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pybase64
import pytest

from orchestrator.config import InferenceConfig
from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.errors import CheckpointError, Failure, InferenceError, MalformedReply, UnloadableCheckpoint
from orchestrator.inference.pool import (
    PROBE_CACHE_SALT,
    PROBE_TIMEOUT_S,
    RESUME_AFTER_FAILURE_S,
    SLOW_CALL_WARN_S,
    InferencePool,
    Server,
)
from orchestrator.inference.replies import parse_generate_reply
from orchestrator.policy import Policy
from orchestrator.testing.clock import virtual_time
from orchestrator.testing.fake_server import FakeInferenceServer
from orchestrator.testing.procs import wait_until

WAIT_S = 3600.0  # hang guard of a wait, in virtual seconds


def config(n: int, **kw: Any) -> InferenceConfig:
    # check_checkpoints off: these tests are about the calls each server gets, for paths that exist nowhere
    defaults: dict[str, Any] = {"failures_to_evict": 2, "weights_path": "/ckpt/step_{step}",
                                "check_checkpoints": False}
    urls = tuple(f"http://fake-{i}.invalid/v1" for i in range(n))
    return InferenceConfig(servers=urls, **{**defaults, **kw})


@contextlib.asynccontextmanager
async def pool_of(n: int, *, probe: bool = True, **kw: object
                  ) -> AsyncIterator[tuple[InferencePool, list[FakeInferenceServer]]]:
    cfg = config(n, **kw)
    fakes = [FakeInferenceServer(url) for url in cfg.servers]
    pool = InferencePool(cfg, fakes)
    async with asyncio.TaskGroup() as tg:
        prober = tg.create_task(pool.run()) if probe else None
        yield pool, fakes
        if prober is not None:
            prober.cancel()


async def acquire(pool: InferencePool, n: int) -> Server:
    """A server for a group of ``n``, waiting while none is in rotation, as the scheduler's admission loop does."""
    while (server := pool.take(n)) is None:
        await pool.wait_room()
    return server


def admin(fake: FakeInferenceServer) -> list[tuple[str, dict[str, str], object]]:
    return [(path, query, body) for _, path, query, body in fake.calls if path != "/health"]


@virtual_time
async def test_least_loaded_choice_and_pinning() -> None:
    async with pool_of(3, probe=False) as (pool, _):
        chosen = [pool.take(4) for _ in range(3)]
        assert sorted(s.url for s in chosen if s is not None) == sorted(s.url for s in pool.servers)  # one each
        assert [s.inflight for s in pool.servers] == [4, 4, 4]
        assert chosen[1] is not None
        pool.release(chosen[1], 4)
        assert pool.take(4) is chosen[1]  # the least loaded again


@pytest.mark.parametrize(("backend", "load"), [
    ("prime-rl", [("/update_weights", {}, {"weight_dir": "/ckpt/step_3"})]),
    ("vllm", [("/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step_3"}}),
              ("/update_weight_version", {}, {"new_version": "3"})]),
])
@virtual_time
async def test_weight_sync_sends_each_backend_its_calls(backend: str, load: list[object]) -> None:
    async with pool_of(2, probe=False, backend=backend) as (pool, fakes):
        result = await pool.update_weights(Checkpoint(3))
        assert sorted(result.updated) == sorted(f.url for f in fakes)
        for fake in fakes:
            keep = {"mode": "keep", "clear_cache": "false"}  # never vLLM's defaults (abort, clear)
            assert admin(fake) == [("/pause", keep, None), *load, ("/resume", {}, None)]
            assert not fake.paused
        assert [s.version for s in pool.servers] == [3, 3]


@virtual_time
async def test_an_announced_path_wins_over_the_template_and_no_path_is_an_error() -> None:
    async with pool_of(1, probe=False, backend="prime-rl") as (pool, [fake]):
        await pool.update_weights(Checkpoint(2, "/elsewhere/2"))
        assert fake.weights_path == "/elsewhere/2"
    async with pool_of(1, probe=False, weights_path=None) as (pool, [fake]):
        with pytest.raises(CheckpointError, match="weights_path"):
            await pool.update_weights(Checkpoint(2))
        assert fake.calls == []  # nothing paused for a checkpoint that cannot load


@virtual_time
async def test_an_unloadable_checkpoint_reaches_no_server_and_every_server_keeps_its_weights_and_rotation(
        tmp_path: Path) -> None:
    """Issue #27 item 3: a real vLLM asked to load a missing or weightless directory dies at its next forward
    pass, so such a checkpoint is refused before any call; the servers keep serving the last good one."""
    Policy.initial().save(tmp_path / "step_1")
    safetensors = tmp_path / "step_3" / "model.safetensors"
    safetensors.parent.mkdir()
    safetensors.write_bytes(struct.pack("<Q", 64) + b"{}")  # its header runs past the end: a cut copy
    async with pool_of(2, probe=False, weights_path=f"{tmp_path}/step_{{step}}", check_checkpoints=True) as (
            pool, fakes):
        await pool.update_weights(Checkpoint(1))
        before = [len(f.calls) for f in fakes]
        with pytest.raises(UnloadableCheckpoint, match=f"^checkpoint 2 cannot be loaded: {tmp_path}/step_2 does "
                                                       "not exist$"):
            await pool.update_weights(Checkpoint(2))
        with pytest.raises(UnloadableCheckpoint, match=r"^checkpoint 3 cannot be loaded: .*/step_3 holds a corrupt "
                                                       r"file model\.safetensors: its header length says 64 bytes"):
            await pool.update_weights(Checkpoint(3))
        with pytest.raises(UnloadableCheckpoint, match="/announced/4 does not exist"):
            await pool.update_weights(Checkpoint(4, f"{tmp_path}/announced/4"))  # an announced path too
        assert [len(f.calls) for f in fakes] == before  # not even a pause
        assert all(s.in_rotation and s.version == 1 for s in pool.servers)
        assert (pool.target.step, pool.metrics["checkpoints_refused"]) == (1, 3)
        assert [f.weights_path for f in fakes] == [f"{tmp_path}/step_1"] * 2


@virtual_time
async def test_the_probe_does_not_sync_a_server_to_weights_deleted_since(tmp_path: Path) -> None:
    Policy.initial().save(tmp_path / "step_1")
    async with pool_of(2, weights_path=f"{tmp_path}/step_{{step}}", check_checkpoints=True,
                       backend="prime-rl") as (pool, fakes):
        fakes[1].fail_with = InferenceError("down")
        await pool.update_weights(Checkpoint(1))
        assert not pool.servers[1].in_rotation
        shutil.rmtree(tmp_path / "step_1")  # a trainer keeping only its newest checkpoints
        fakes[1].fail_with = None
        await wait_until(lambda: "cannot be loaded" in pool.servers[1].last_error, WAIT_S, "the probe's refusal")
        assert not pool.servers[1].in_rotation  # it would serve other weights than the rest
        assert "/update_weights" not in [c[1] for c in fakes[1].calls]
        Policy.initial().save(tmp_path / "step_1")
        await wait_until(lambda: pool.servers[1].in_rotation, WAIT_S, "the server back")
        assert fakes[1].weights_path == f"{tmp_path}/step_1"


@virtual_time
async def test_resume_follows_a_failed_load_and_the_server_leaves_rotation() -> None:
    async with pool_of(2, probe=False, backend="prime-rl") as (pool, fakes):
        fakes[1].fail_paths["/update_weights"] = InferenceError("POST /update_weights: HTTP 500")
        result = await pool.update_weights(Checkpoint(5))
        assert (result.updated, list(result.failed)) == ([fakes[0].url], [fakes[1].url])
        assert [c[1] for c in fakes[1].calls] == ["/pause", "/resume"]  # resumed although the load failed
        assert not fakes[1].paused
        assert not pool.servers[1].in_rotation
        assert pool.metrics["weight_sync_failed"] == 1


@virtual_time
async def test_a_server_rejoins_only_after_it_was_synced_to_the_current_weights() -> None:
    async with pool_of(2, backend="prime-rl") as (pool, fakes):
        fakes[1].fail_with = InferenceError("refused")
        result = await pool.update_weights(Checkpoint(4))
        assert list(result.failed) == [fakes[1].url]
        fakes[1].fail_with = None
        await wait_until(lambda: pool.servers[1].in_rotation, WAIT_S, "the probe to bring it back")
        assert (fakes[1].weights_path, pool.servers[1].version) == ("/ckpt/step_4", 4)
        synced = [c[1] for c in fakes[1].calls if c[1] != "/health"]
        assert synced[-3:] == ["/pause", "/update_weights", "/resume"]  # after its health answered
        assert pool.metrics["rejoins"] == 1


@virtual_time
async def test_a_server_that_left_failing_requests_is_synced_again_before_it_rejoins() -> None:
    """It may have restarted on the weights it started with, so the step it last loaded no longer says what it
    serves (a sim restarted in a broadcast job rejoined labelled step 1 on step 0's weights). At step 0 a restart
    holds the target's weights: it rejoins without a load."""
    async with pool_of(2, backend="prime-rl") as (pool, fakes):
        server = pool.servers[1]
        for _ in range(2):  # at step 0
            pool.report_failure(server, Failure.PROVIDER, "Connection error.")
        await wait_until(lambda: server.in_rotation, WAIT_S, "the probe to bring it back at step 0")
        assert "/update_weights" not in [c[1] for c in fakes[1].calls]
        assert not (await pool.update_weights(Checkpoint(3))).failed
        for _ in range(2):
            pool.report_failure(server, Failure.PROVIDER, "Connection error.")
        assert not server.in_rotation
        fakes[1].calls.clear()  # as if restarted on the weights it started with: it must load step 3's
        await wait_until(lambda: server.in_rotation, WAIT_S, "the probe to bring it back")
        assert (fakes[1].weights_path, server.version) == ("/ckpt/step_3", 3)
        assert [c[1] for c in fakes[1].calls if c[1] != "/health"] == ["/pause", "/update_weights", "/resume"]


@virtual_time
async def test_a_server_whose_canary_outlasts_the_start_of_a_sync_is_synced_before_it_rejoins() -> None:
    """The sync began while the server was out (so it does not sync it); the probe, done with the canary, finds
    newer weights announced and syncs it before it rejoins: it never serves the older weights in rotation (seen
    in a broadcast job: it rejoined on step 1 while the others served step 2)."""
    cfg = config(2, backend="prime-rl")
    fakes = [FakeInferenceServer(url) for url in cfg.servers]
    pool = InferencePool(cfg, fakes, model="m")
    async with asyncio.TaskGroup() as tg:
        prober = tg.create_task(pool.run())
        fakes[1].fail_with = InferenceError("refused")
        assert list((await pool.update_weights(Checkpoint(4))).failed) == [fakes[1].url]
        fakes[1].slow_paths["/inference/v1/generate"] = 3.0  # the probe's canary, within its bound
        fakes[1].fail_with = None
        await wait_until(lambda: pool.servers[1].version == 4, WAIT_S, "the probe to sync it to step 4")
        result = await pool.update_weights(Checkpoint(5))  # while its canary runs
        assert result.updated == [fakes[0].url]
        await wait_until(lambda: pool.servers[1].in_rotation, WAIT_S, "the probe to bring it back")
        assert (pool.servers[1].version, fakes[1].weights_path) == (5, "/ckpt/step_5")
        prober.cancel()


@virtual_time
async def test_failures_evict_and_waiters_share_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    async with pool_of(1, failures_to_evict=2) as (pool, [fake]):
        server = pool.servers[0]
        fake.fail_with = InferenceError("down")  # the probe fails too while it is down
        pool.report_failure(server, Failure.PROVIDER, "HTTP 500")
        assert server.in_rotation  # one failure is not enough
        pool.report_failure(server, Failure.MALFORMED, "bad reply")
        out_at = asyncio.get_running_loop().time()
        assert not server.in_rotation
        assert (pool.metrics["failed:provider_error"], pool.metrics["failed:malformed_reply"]) == (1, 1)
        with caplog.at_level(logging.WARNING):
            waiters = [asyncio.ensure_future(acquire(pool, 1)) for _ in range(5)]
            for _ in range(5):
                await asyncio.sleep(0)
            assert not any(w.done() for w in waiters)
            fake.fail_with = None
            got = await asyncio.wait_for(asyncio.gather(*waiters), WAIT_S)
        # back at the next probe, within the warning interval: one warning for all five waiters
        back_after = asyncio.get_running_loop().time() - out_at
        assert back_after <= pool.cfg.probe_interval_s < pool.cfg.no_server_warn_interval_s
        assert caplog.text.count("no inference server in rotation") == 1
        assert all(s is server for s in got)
        assert server.inflight == 5


@virtual_time
async def test_a_call_with_no_answer_times_out_and_says_so_while_it_waits(caplog: pytest.LogCaptureFixture) -> None:
    async with pool_of(1, probe=False) as (pool, [fake]):
        fake.hang_paths.add("/collective_rpc")  # never released: no answer
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with caplog.at_level(logging.WARNING):
            result = await pool.update_weights(Checkpoint(1))
        timeout_s = pool.cfg.weight_sync_timeout_s
        assert loop.time() - t0 == pytest.approx(timeout_s)  # the resume after it answered at once
        assert f"took more than {timeout_s:g} s" in result.failed[fake.url]
    said = [r.getMessage() for r in caplog.records if "no answer after" in r.getMessage()]
    every = [f"reload_weights on {fake.url}: no answer after {k * SLOW_CALL_WARN_S:.0f} s (gives up after "
             f"{timeout_s:.0f} s)" for k in range(1, int(timeout_s // SLOW_CALL_WARN_S))]
    assert said[:len(every)] == every, said  # every SLOW_CALL_WARN_S while it waited


@virtual_time
async def test_a_call_that_fails_as_its_weight_sync_is_cancelled_leaves_no_unretrieved_error() -> None:
    """Seen under load at the end of a run: the last sync, cancelled at shutdown just as vLLM 0.26 answered
    404 to /update_weight_version, printed "Task exception was never retrieved" on the run's stderr."""
    loop = asyncio.get_running_loop()

    async def cancelled_as_the_call_fails(pool: InferencePool) -> bool:
        call: asyncio.Future[bytes] = loop.create_future()
        sync = asyncio.ensure_future(pool.timed(call, "update_weight_version on a server"))
        await asyncio.sleep(0)  # the sync now waits for the call
        call.set_exception(InferenceError("HTTP 404", Failure.PROVIDER))  # the call fails ...
        sync.cancel()  # ... as the sync is cancelled, before it sees the failure
        await asyncio.wait({sync})
        return sync.cancelled()

    reported: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    try:
        async with pool_of(1, probe=False) as (pool, _):
            assert await cancelled_as_the_call_fails(pool)
            gc.collect()  # the failed call is freed: an error nobody read would be reported now
    finally:
        loop.set_exception_handler(previous)
    assert reported == []


@virtual_time
async def test_a_sync_cancelled_while_its_resume_is_on_the_way_still_resumes_the_server() -> None:
    """Seen under load at the end of a run: the sync of the checkpoint after the last step, cancelled at shutdown
    as its resume was on the way, left the server paused: every request of a next run on it would freeze."""
    async with pool_of(1, probe=False) as (pool, [fake]):
        fake.slow_paths["/resume"] = 5.0
        sync = asyncio.ensure_future(pool.update_weights(Checkpoint(1)))
        await wait_until(lambda: any(c[1] == "/resume" for c in fake.calls), 10, "the resume")
        assert fake.paused
        sync.cancel()
        await asyncio.wait({sync})
        assert sync.cancelled()  # the cancel still ends the sync ...
        assert not fake.paused  # ... once the resume is answered
        fake.slow_paths["/pause"] = 5.0  # and cut short in its pause: resumed after it
        sync = asyncio.ensure_future(pool.update_weights(Checkpoint(2)))
        await wait_until(lambda: fake.calls[-1][1] == "/pause", 10, "the pause")
        sync.cancel()
        await asyncio.wait({sync})
        assert [c[1] for c in fake.calls[-2:]] == ["/pause", "/resume"]
        assert not fake.paused


def test_reply_parser_reads_what_verifiers_reads_and_names_the_fix() -> None:
    ok = {"choices": [{"token_ids": [5, 6], "finish_reason": "stop", "logprobs": {"content": [
        {"token": "token_id:5", "logprob": -1.0}, {"token": "token_id:6", "logprob": -0.5}]},
        "routed_experts": {"data": "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "shape": [6, 2, 1], "start": 0,
                           "dtype": "uint16"}}]}
    gen = parse_generate_reply(orjson.dumps(ok), 5)  # 7 tokens: 6 rows, the last token has none yet
    assert gen.routed_experts is not None
    assert (gen.routed_experts.shape, gen.routed_experts.dtype.name) == ((6, 2, 1), "uint16")
    assert (gen.adapted, gen.weight_versions) == (False, None)
    # vLLM 0.32+: {"token_id": N} entries and weight_versions; upstream vLLM: routed experts as a .npy string. An
    # env worker's shim adapts both (workers/adapter.py), and so does this parser
    new = orjson.loads(orjson.dumps(ok))
    new["choices"][0]["logprobs"]["content"] = [{"token_id": 5, "logprob": -1.0, "rank": 1, "top_logprobs": []},
                                                {"token_id": 6, "logprob": -0.5, "rank": 1, "top_logprobs": []}]
    buf = io.BytesIO()
    np.save(buf, np.arange(12, dtype=np.int32).reshape(6, 2, 1))
    new["choices"][0]["routed_experts"] = pybase64.b64encode(buf.getvalue()).decode()
    new["choices"][0]["weight_versions"] = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1,
                                                                                   "end": 2}]
    gen = parse_generate_reply(orjson.dumps(new), 5)
    assert gen.adapted
    assert gen.logprobs == [-1.0, -0.5]
    assert gen.weight_versions == ((3, 0, 1), (4, 1, 2))
    assert gen.routed_experts is not None
    assert (gen.routed_experts.dtype.name, gen.routed_experts[:, 0, 0].tolist()) == ("uint8", [0, 2, 4, 6, 8, 10])
    npy = orjson.loads(orjson.dumps(ok))
    npy["choices"][0]["routed_experts"] = "k05VTVBZAQB2AHsnZGVzY3InOiAnfHUxJyw="  # a truncated .npy header
    with pytest.raises(MalformedReply, match=r"not a \.npy array"):
        parse_generate_reply(orjson.dumps(npy), 5)


def test_reply_parser_raises_only_malformed_reply() -> None:
    """Every mutation of a valid reply either parses or raises MalformedReply (never another exception)."""
    valid = {"choices": [{"token_ids": [5, 6], "finish_reason": "stop", "logprobs": {"content": [
        {"token": "token_id:5", "logprob": -1.0}, {"token": "token_id:6", "logprob": -0.5}]},
        "routed_experts": {"data": "AAAAAAAAAAAAAAAA", "shape": [6, 2, 1], "start": 0, "dtype": "uint8"}}]}
    parse_generate_reply(orjson.dumps(valid), 5)
    junk: list[object] = [None, "x", -1, 2**40, 1.5, [], {}, [1], {"a": 1}, True, -9999.0]
    rng = random.Random(0)
    outcomes = set()
    for _ in range(400):  # bounded fuzz: replace one nested value with junk
        reply = orjson.loads(orjson.dumps(valid))
        path: list[tuple[Any, Any]] = []  # (a dict or a list, its key)
        node: object = reply
        while isinstance(node, dict | list) and node and rng.random() < 0.8:
            key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
            path.append((node, key))
            node = node[key]
        if not path:
            continue
        parent, key = path[-1]
        parent[key] = rng.choice(junk)
        try:
            parse_generate_reply(orjson.dumps(reply), 5)
            outcomes.add("ok")
        except MalformedReply:
            outcomes.add("malformed")
    assert "malformed" in outcomes


@virtual_time
async def test_a_server_whose_generate_hangs_stays_out_until_it_answers_again(caplog: pytest.LogCaptureFixture) -> None:
    """Its /health answers, so without the probe's generate canary it would rejoin at once and take new groups
    that hang until their request timeout, again and again."""
    cfg = config(2, failures_to_evict=1, request_timeout_s=60.0)  # each probe call: PROBE_TIMEOUT_S
    fakes = [FakeInferenceServer(url) for url in cfg.servers]
    pool = InferencePool(cfg, fakes, model="m")
    hung, server = fakes[0], pool.servers[0]
    hung.hang_paths.add("/inference/v1/generate")
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        async with asyncio.TaskGroup() as tg:
            prober = tg.create_task(pool.run())
            pool.report_failure(server, Failure.TIMEOUT, "generate: Request timed out")
            assert not server.in_rotation
            # probes keep trying it (health, resume and label, canary), and it stays out while its generate hangs
            await wait_until(lambda: [c[1] for c in hung.calls].count("/inference/v1/generate") >= 3, WAIT_S,
                             "three probes")
            assert not server.in_rotation
            hung.hang_paths.clear()
            hung.release()
            await wait_until(lambda: server.in_rotation, WAIT_S, "the probe to bring it back")
            prober.cancel()
    probes = [c for c in hung.calls if c[1] == "/inference/v1/generate"]
    assert all(body["cache_salt"] == PROBE_CACHE_SALT and body["model"] == "m" for _, _, _, body in probes)
    assert [c[1] for c in hung.calls[:4]] == ["/health", "/resume", "/update_weight_version", "/inference/v1/generate"]
    assert (pool.metrics["evictions"], pool.metrics["rejoins"]) == (1, 1)
    info = [r.getMessage() for r in caplog.records if "stays out of rotation" in r.getMessage()]  # INFO and up
    # three probes timed out: one line at INFO, the same reason again at DEBUG (a server may stay out for hours); a
    # new one (the hung call cut by the release) at INFO again
    assert sum(f"took more than {PROBE_TIMEOUT_S:g} s" in m for m in info) == 1, info
    assert f"took more than {PROBE_TIMEOUT_S:g} s" in info[0]
    assert all(a != b for a, b in itertools.pairwise(info)), info


@virtual_time
async def test_after_a_call_with_no_answer_the_resume_is_best_effort_and_bounded(
        caplog: pytest.LogCaptureFixture) -> None:
    """A hung server holds a sync for one weight_sync_timeout_s plus at most RESUME_AFTER_FAILURE_S (not a second
    full timeout), and the error named is the call that failed, not the resume after it."""
    timeout_s = 120.0  # above RESUME_AFTER_FAILURE_S: the resume's bound is that, not this
    async with pool_of(2, probe=False, weight_sync_timeout_s=timeout_s) as (pool, fakes):
        fakes[0].hang_paths.update({"/pause", "/resume"})
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with caplog.at_level(logging.WARNING, logger="orchestrator"):
            result = await asyncio.wait_for(pool.update_weights(Checkpoint(1)), WAIT_S)
        assert loop.time() - t0 == pytest.approx(timeout_s + RESUME_AFTER_FAILURE_S)
        fakes[0].release()
    assert result.updated == [fakes[1].url]
    assert result.failed[fakes[0].url] == f"pause on {fakes[0].url} took more than {timeout_s:g} s"
    assert [c[1] for c in fakes[0].calls] == ["/pause", "/resume"]
    assert f"resume on {fakes[0].url} after a failed sync took more than {RESUME_AFTER_FAILURE_S:g} s" in caplog.text
    assert not pool.servers[0].in_rotation


@virtual_time
async def test_a_server_whose_work_never_answers_is_checked_and_evicted(caplog: pytest.LogCaptureFixture) -> None:
    """Rollouts on a hung server need not time out to tell: cancelled as stale while steps go on with the other
    servers, they never answer at all. A server given work and silent for request_timeout_s must answer the
    canary within request_timeout_s; one with long rollouts does, and stays."""
    timeout_s = 60.0
    cfg = config(2, failures_to_evict=3, request_timeout_s=timeout_s)
    fakes = [FakeInferenceServer(url) for url in cfg.servers]
    pool = InferencePool(cfg, fakes, model="m")
    fakes[0].hang_paths.add("/inference/v1/generate")
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        async with asyncio.TaskGroup() as tg:
            prober = tg.create_task(pool.run())
            hung, slow = await acquire(pool, 4), await acquire(pool, 4)  # one group each, never answered
            given = loop.time()
            assert (hung.url, slow.url) == (fakes[0].url, fakes[1].url)
            await wait_until(lambda: not hung.in_rotation, WAIT_S, "the hung server checked and evicted")
            # out within about twice request_timeout_s of its first unanswered request (pool.py), not sooner
            assert 2 * timeout_s <= loop.time() - given <= 2 * timeout_s + 2 * cfg.probe_interval_s
            await wait_until(lambda: pool.metrics["liveness_checks"] >= 3, WAIT_S, "more checks")
            assert slow.in_rotation  # it answered every check: its rollouts are just long
            pool.report_success(slow)  # a rollout came back: no check until it is waited on again
            assert slow.waiting_since is None
            fakes[0].release()
            prober.cancel()
    assert pool.metrics["evictions"] == 1
    assert re.search(rf"inference server {re.escape(fakes[0].url)} leaves rotation: 1 failure\(s\) in a row, last: "
                     r"timeout: its work waited 6[01] s with no answer, and a 2-token generate request to \S+ took "
                     r"more than 60 s", caplog.text)
