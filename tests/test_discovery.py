"""The inference pool following a DNS name (``inference.discover``, a Kubernetes headless service) with a resolver
the test controls (``orchestrator.testing.resolver``) and real simulated servers, one per loopback address on one
port, as a headless service's pods are: a server that appears joins rotation only after the job's preflight and a
sync to the current weights; one that fails preflight stays out, saying why; one that vanishes leaves rotation and
the pool; a lookup that fails changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.assets import tokenizer_dir
from orchestrator.config import load_config
from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.engines import admit_server
from orchestrator.inference.discovery import SystemResolver, server_url
from orchestrator.inference.logprobs import LogprobsCheck
from orchestrator.inference.pool import PROBE_CACHE_SALT, InferencePool
from orchestrator.sim.server import SimServer
from orchestrator.testing.procs import wait_until
from orchestrator.testing.resolver import StaticResolver
from orchestrator.trainer.reference import initial_policy

NAME = "rl-servers.test"
WAIT_S = 60.0  # a hang guard: every wait ends on the pool's state


def free_port() -> int:
    """A port free on 127.0.0.2..5 (bound on one, then used by every server: a headless service's pods share it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def servers(port: int, hosts: dict[str, str]) -> AsyncIterator[dict[str, SimServer]]:
    """A simulated prime-rl server per host address, each serving the model named (a wrong one fails preflight)."""
    async with contextlib.AsyncExitStack() as stack:
        yield {host: await stack.enter_async_context(SimServer.open(host, port, profile="prime-rl", model=model))
               for host, model in hosts.items()}


def job_toml(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f"""
[inference]
discover = "http://{NAME}:{port}/v1"
discover_interval_s = 0.05
probe_interval_s = 0.05
backend = "prime-rl"

[scheduler]
batch_size = 4

[[env]]
taskset = "orchestrator-arithmetic"
group_size = 2
""")
    return path


def in_rotation(pool: InferencePool) -> set[str]:
    return {s.url for s in pool.servers if s.in_rotation}


async def test_the_pool_follows_a_dns_name(tmp_path: Path) -> None:
    port = free_port()
    cfg = load_config(job_toml(tmp_path, port))
    assert cfg.inference.discover is not None
    url = functools.partial(server_url, cfg.inference.discover)
    resolver = StaticResolver({NAME: ["127.0.0.2"]})
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / "tiny_policy.npz").hardlink_to(initial_policy(tmp_path))
    hosts = {"127.0.0.2": "sim-model", "127.0.0.3": "sim-model", "127.0.0.4": "another-model"}
    async with servers(port, hosts) as sims, InferencePool.open(cfg.inference, cfg.model.name,
                                                                 resolver=resolver) as pool:
        assert [s.url for s in pool.servers] == [url("127.0.0.2")]  # the first answer, before any loop runs
        check = LogprobsCheck.of(cfg.inference, [1.0], prime_rl_trainer=False)
        pool.admit = functools.partial(admit_server, cfg, tokenizer_dir(), dataclasses.replace(check, stated="raw"))
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(pool.run())
            await pool.update_weights(Checkpoint(1, str(ckpt)))  # the policy a new server must serve to join

            resolver.set(NAME, ["127.0.0.2", "127.0.0.3", "127.0.0.4"])  # two pods become ready
            await wait_until(lambda: url("127.0.0.3") in in_rotation(pool), WAIT_S, "the new server to join")
            joined = sims["127.0.0.3"]
            assert (joined.loads, joined.weights_path) == (1, str(ckpt))  # synced to step 1 before joining
            calls = [(g.cache_salt, g.loads) for g in joined.log.generate]
            assert calls[0] == ("preflight", 0)  # the job's preflight first, on the weights it started with
            assert (PROBE_CACHE_SALT, 1) in calls  # then the canary, on the current weights
            assert next(s for s in pool.servers if s.url == url("127.0.0.3")).version == 1

            # a server that fails the job's preflight (it serves another model) stays out, saying why
            wrong = next(s for s in pool.servers if s.url == url("127.0.0.4"))
            await wait_until(lambda: "another-model" in wrong.probe_verdict or "sim-model" in wrong.probe_verdict,
                             WAIT_S, "the wrong server's preflight to fail")
            assert not wrong.in_rotation
            assert "preflight" in wrong.probe_verdict
            assert sims["127.0.0.4"].loads == 0  # never given the job's weights

            resolver.fail(NAME, socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))
            asked = resolver.asked[NAME]
            await wait_until(lambda: resolver.asked[NAME] >= asked + 3, WAIT_S, "lookups that fail")
            assert url("127.0.0.2") in in_rotation(pool)  # a failed lookup changes nothing

            resolver.set(NAME, ["127.0.0.3", "127.0.0.4"])  # a pod goes away
            await wait_until(lambda: url("127.0.0.2") not in {s.url for s in pool.servers}, WAIT_S,
                             "the vanished server to leave the pool")
            assert in_rotation(pool) == {url("127.0.0.3")}
            assert {pool.take(2).url for _ in range(4)} == {url("127.0.0.3")}  # type: ignore[union-attr]
            assert (pool.metrics["servers_added"], pool.metrics["servers_removed"]) == (2, 1)
            run.cancel()


async def test_the_system_resolver_gives_every_address_of_a_name() -> None:
    assert "127.0.0.1" in await SystemResolver().resolve("localhost")  # /etc/hosts: no DNS server needed


def test_a_server_url_is_the_template_with_the_address() -> None:
    assert server_url("http://rl.ns.svc:8000/v1", "10.0.0.7") == "http://10.0.0.7:8000/v1"
    assert server_url("http://rl:8000/v1", "fd00::7") == "http://[fd00::7]:8000/v1"


@pytest.mark.parametrize(("value", "error"), [
    ('"rl-servers:8000"', "inference.discover: expected http://NAME:PORT/v1"),
    ('"http://rl-servers/v1"', "inference.discover: expected http://NAME:PORT/v1"),
])
def test_a_bad_discover_url_is_a_config_error(value: str, error: str, tmp_path: Path) -> None:
    from orchestrator.errors import ConfigError

    text = job_toml(tmp_path, 8000).read_text().replace(f'"http://{NAME}:8000/v1"', value)
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_config(tmp_path / "bad.toml")
