"""The trainer link across hosts with real network interfaces: each host a network namespace on a bridge
(``orchestrator.testing.netns``). The orchestrator's side binds its host's address with CURVE keys; the
trainer on another host gets every step once, in order; intruders on a third host (no keys, and a key pair
the orchestrator does not know) write garbage, forge acknowledgements and a checkpoint, and change nothing.

Skipped, with the reason, where namespaces cannot be made (not root, no ``ip``, a container that refuses).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.steps.dump import load_dump
from orchestrator.testing.jobs import ARITHMETIC, write_job_toml
from orchestrator.testing.keys import KeySet, make_key_set
from orchestrator.testing.netns import Network, namespaces, prefix, unavailable
from orchestrator.testing.procs import processes_mentioning, wait_until
from orchestrator.trainer.reference import read_journal

PEER = str(Path(__file__).parent / "netns_peer.py")
STEPS = 5
WAIT_S = 120.0  # a hang guard: every wait ends on a line, an exit or a state (processes start slowly on a busy host)
Process = asyncio.subprocess.Process


@pytest.fixture(scope="module", autouse=True)
def _namespaces_can_be_made() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


class Lines:
    """A process's JSON lines, read as they come."""

    def __init__(self, proc: Process) -> None:
        assert proc.stdout is not None
        self.stream = proc.stdout
        self.proc = proc
        self.seen: list[dict[str, Any]] = []

    async def until(self, done: Callable[[list[dict[str, Any]]], bool], what: str) -> list[dict[str, Any]]:
        """Read lines until ``done(all lines so far)``; AssertionError naming ``what`` on EOF or timeout."""
        try:
            async with asyncio.timeout(WAIT_S):
                while not done(self.seen):
                    line = await self.stream.readline()
                    if not line:
                        raise AssertionError(f"waiting for {what}: process exited ({await self.proc.wait()}) "
                                             f"after {self.seen}")
                    self.seen.append(json.loads(line))
        except TimeoutError:
            raise AssertionError(f"waiting for {what}: not within {WAIT_S:.0f} s; lines: {self.seen}") from None
        return self.seen


def refusals(lines: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(line["refused"], line["why"]) for line in lines if "refused" in line}


async def start_intruder(net: Network, address: str, flags: list[str]) -> Lines:
    proc = await net.run("intruder", sys.executable, PEER, "intrude", address, *flags, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    lines = Lines(proc)
    await lines.until(lambda seen: any("refused" in line for line in seen), "an intruder to be refused")
    return lines


async def stop_intruder(lines: Lines) -> int:
    """Tell an intruder to stop; the number of messages it received."""
    assert lines.proc.stdin is not None
    lines.proc.stdin.write(b"stop\n")
    await lines.proc.stdin.drain()
    lines.proc.stdin.close()
    seen = await lines.until(lambda seen: any("received_total" in line for line in seen), "an intruder's total")
    assert await asyncio.wait_for(lines.proc.wait(), WAIT_S) == 0
    return int(seen[-1]["received_total"])


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_only_the_authorized_trainer_on_another_host_is_served(tmp_path: Path) -> None:
    keys: KeySet = make_key_set(tmp_path / "keys")
    journal = tmp_path / "journal.jsonl"
    async with Network.open(("orch", "trainer", "intruder")) as net:
        assert set(namespaces()) >= {net.namespace(h) for h in net.hosts} | {net.bridge_ns}
        address = f"tcp://{net.address_of('orch')}:5555"
        sender = Lines(await net.run("orch", sys.executable, PEER, "send", address, "--steps", str(STEPS),
                                     "--server-key", str(keys.server_secret), "--authorized",
                                     str(keys.authorized_dir), stdout=subprocess.PIPE))
        await sender.until(lambda seen: any("bound" in line for line in seen), "the sender to bind")
        # both are refused on both sockets before the trainer exists
        intruders = [await start_intruder(net, address, []),
                     await start_intruder(net, address, ["--server-key", str(keys.server_public),
                                                         "--client-key", str(keys.client_secret("intruder"))])]
        expected = {("push", "HANDSHAKE_FAILED_AUTH"), ("pull", "HANDSHAKE_FAILED_AUTH")}  # the unknown key
        await sender.until(lambda seen: refusals(seen) >= expected, "the sender's refusals of the unknown key")
        trainer = await net.run("trainer", sys.executable, "-m", "orchestrator", "--log-level", "WARNING", "receive",
                                address, "--steps", str(STEPS), "--journal", str(journal), "--server-key",
                                str(keys.server_public), "--client-key", str(keys.client_secret("trainer")))
        done = (await sender.until(lambda seen: "done" in seen[-1], "the sender to finish"))[-1]
        assert await asyncio.wait_for(sender.proc.wait(), WAIT_S) == 0
        assert await asyncio.wait_for(trainer.wait(), WAIT_S) == 0
        assert [line["step"] for line in read_journal(journal)] == list(range(STEPS))  # each once, in order
        assert done["skipped"] == []  # the forged "trainer has step 50" did not count
        assert done["acked"] == STEPS - 1
        assert 99 not in done["announced"]  # nor the forged checkpoint
        assert done["announced"][-1] == STEPS
        assert [await stop_intruder(lines) for lines in intruders] == [0, 0]
    assert [n for n in namespaces() if n.startswith(prefix())] == []
    assert processes_mentioning(str(tmp_path)) == []


class Boom(Exception):
    pass


async def start_then_fail(marker: str, started: list[Process]) -> None:
    async with Network.open(("a", "b")) as net:
        started.append(await net.run("b", sys.executable, "-c", "import time; time.sleep(600)", marker))
        pid = started[0].pid  # its command line names the marker once `ip netns exec` has started
        await wait_until(lambda: processes_mentioning(marker) == [pid], WAIT_S, "the process to start")
        with pytest.raises(KeyError, match="no host 'c'"):
            net.address_of("c")
        raise Boom


async def test_the_network_is_torn_down_however_the_block_ends(tmp_path: Path) -> None:
    marker = str(tmp_path / "still-here")
    started: list[Process] = []
    with pytest.raises(Boom):
        await start_then_fail(marker, started)
    assert started[0].returncode is not None
    assert processes_mentioning(marker) == []
    assert [n for n in namespaces() if n.startswith(prefix())] == []


def test_where_namespaces_cannot_be_made_the_reason_is_given() -> None:
    code = "from orchestrator.testing.netns import unavailable; print(unavailable())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True,
                          env={**os.environ, "PATH": "/nonexistent"})
    assert done.stdout.strip() == "no `ip` command (iproute2) on this machine"


JOB_STEPS = 3


def write_job(tmp_path: Path, orch: str, keys: KeySet, data_plane: str) -> Path:
    """A job whose env workers and trainer are on other hosts, over TCP with CURVE keys."""
    return write_job_toml(
        tmp_path, run={"name": "hosts", "max_steps": JOB_STEPS},
        inference={"servers": [f"http://{orch}:8000/v1"], "backend": "prime-rl"},
        scheduler={"batch_size": 8, "max_inflight": 8, "worker_address": f"tcp://{orch}:5600", "remote_workers": 1},
        transport={"address": f"tcp://{orch}:5700", "data_plane": data_plane, "worker_pool_mb": 16},
        security={"server_key": keys.server_secret, "authorized_keys": keys.authorized_dir},
        pipeline={
            "gates": [],  # every finished group trains: gates are not what this test is about
            # direct mode: the orchestrator reads the step back from the worker's host, as a CURVE client
            "dump_steps": [1],
        },
        env=[{**ARITHMETIC, "workers": 0}])


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("plane", ["through", "direct"])  # not the data_plane fixture: both, in every run
async def test_a_job_across_hosts_trains_only_on_what_its_own_workers_sent(tmp_path: Path, plane: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The orchestrator and the inference server on one host, an env worker on a second, the trainer on a third
    (TCP, CURVE); on a fourth, intruders without keys and with an unknown key write garbage to every port,
    forge a worker's hello, ready, records (a reward and a token no real rollout has) and fatal, and forge the
    trainer's acknowledgements. Every step reaches the trainer once, in order, and nothing forged is in it.

    In direct mode the columns go from the worker's host to the trainer's without crossing the orchestrator's:
    the worker (its own host name) serves its pool at its address with CURVE, the trainer fetches each step's
    spans with its key pair. The pool's Unix socket is removed before the trainer starts, so mapping the pool
    cannot stand in: a trainer that could neither map nor fetch would report every step lost, and the job
    would not end."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # verifiers writes ~/.cache/verifiers
    keys = make_key_set(tmp_path / "keys", clients=("trainer", "worker"))
    journal, ckpt = tmp_path / "journal.jsonl", tmp_path / "ckpt"
    orchestrator = [sys.executable, "-m", "orchestrator", "--log-level", "WARNING"]
    client = ["--server-key", str(keys.server_public)]
    direct = plane == "direct"
    async with Network.open(("orch", "workers", "trainer", "intruder")) as net:
        orch = net.address_of("orch")
        sim = Lines(await net.run("orch", *orchestrator, "sim-inference", "--host", orch, "--port", "8000",
                                  "--profile", "prime-rl", stdout=subprocess.PIPE))
        assert sim.stream is not None
        await asyncio.wait_for(sim.stream.readline(), WAIT_S)  # its URL: it listens
        run = await net.run("orch", *orchestrator, "run", str(write_job(tmp_path, orch, keys, plane)))
        intruders = []
        for address, mode in ((f"tcp://{orch}:5600", "intrude-workers"), (f"tcp://{orch}:5700", "intrude")):
            for flags in ([], [*client, "--client-key", str(keys.client_secret("intruder"))]):
                proc = await net.run("intruder", sys.executable, PEER, mode, address, *flags, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
                intruders.append(Lines(proc))
                await intruders[-1].until(lambda seen: any("refused" in line for line in seen), f"a {mode} refusal")
        spans = ["--span-address", f"tcp://{net.address_of('workers')}:5800"] if direct else []
        await net.run("workers", *orchestrator, "env-worker", "--connect", f"tcp://{orch}:5600", "--id", "remote-w",
                      *client, "--client-key", str(keys.client_secret("worker")), *spans, hostname="workers-host")
        if direct:
            pool_socket = tmp_path / "out" / "pools" / "remote-w.pool"
            await wait_until(pool_socket.exists, WAIT_S, "the worker's pool socket", alive=run)
            pool_socket.unlink()
        await net.run("trainer", *orchestrator, "receive", f"tcp://{orch}:5700", "--journal", str(journal),
                      "--checkpoint-dir", str(ckpt), *client, "--client-key", str(keys.client_secret("trainer")))
        assert await asyncio.wait_for(run.wait(), 300) == 0
        assert [await stop_intruder(lines) for lines in intruders] == [0, 0, 0, 0]
    assert [line["step"] for line in read_journal(journal)] == list(range(JOB_STEPS))  # once each, in order
    out = tmp_path / "out"
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert rows
    assert {r["worker"] for r in rows} == {"remote-w"}
    assert all(r["reward"] != 7.75 for r in rows)  # netns_peer.FORGED_REWARD
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(JOB_STEPS))
    dump = load_dump(out / "dumps" / "step_000001")
    assert dump.batch.num_samples == metrics[1]["samples"]
    # every record's columns: the token columns, versions (bounded on 0.31) and routed experts
    assert all(len(r.frames) == 5 and r.columns[3] == "versions" for g in dump.groups for r in g.records if r.ok)
    assert [n for n in namespaces() if n.startswith(prefix())] == []
    assert processes_mentioning(str(tmp_path)) == []
