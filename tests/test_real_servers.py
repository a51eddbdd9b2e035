"""Jobs against simulated servers that answer as the real ones do (vLLM 0.26 in dev mode, prime-rl's server),
checked on the server side: what each was asked in every weight sync, the cache salt of every request, and
the weights each request was sampled with. Preflight turns each way a real server breaks a run into one
message. Router replay with more than 256 experts delivers uint16 ids byte-identical to what the server sent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from orchestrator.app import Orchestrator
from orchestrator.assets import tokenizer_dir
from orchestrator.config import load_config
from orchestrator.contracts.wire import Batch
from orchestrator.inference.logprobs import LogprobsCheck
from orchestrator.inference.preflight import Preflight, PreflightError, preflight
from orchestrator.inference.server import HttpInferenceServer, InferenceServer
from orchestrator.testing.jobs import ARITHMETIC, write_job_toml
from orchestrator.testing.procs import orchestrator_process
from orchestrator.testing.sim import Faults, ProfileName, SimServer, sim_process, sim_servers
from orchestrator.trainer.reference import ReferenceTrainer

pytestmark = [pytest.mark.timeout(400),  # a hang guard: two server processes and a job, on a busy host
              pytest.mark.usefixtures("verifiers_home")]
STEPS = 4
KEEP = {"mode": "keep", "clear_cache": "false"}


def write_job(tmp_path: Path, urls: list[str], backend: str, *, steps: int = STEPS) -> Path:
    return write_job_toml(
        tmp_path, run={"name": "real", "max_steps": steps},
        inference={"servers": urls, "backend": backend, "probe_interval_s": 0.2},
        scheduler={"batch_size": 8, "max_inflight": 8, "max_async_level": 1, "max_off_policy_steps": 2},
        pipeline={"gates": []},  # every finished group trains: gates are not what this test is about
        env=[ARITHMETIC])


async def sim_log(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url.removesuffix("/v1") + "/sim/log") as reply:
        log: dict[str, Any] = await reply.json()
        return log


def step_of(path: str | None) -> int:
    """The checkpoint step of a weights directory the reference trainer made (``.../step_N``); 0: none loaded."""
    return 0 if path is None else int(path.rpartition("step_")[2])


@pytest.mark.parametrize(("profile", "backend"), [("prime-rl", "prime-rl"), ("vllm-0.26", "vllm")])
async def test_a_run_through_weight_syncs_speaks_each_servers_protocol(tmp_path: Path, profile: ProfileName,
                                                                       backend: str) -> None:
    ckpt = tmp_path / "ckpt"
    async with sim_process(["--seed", "1"], profile=profile) as a, sim_process(["--seed", "2"], profile=profile) as b:
        job = write_job(tmp_path, [a.url, b.url], backend)
        trainer_address = f"ipc://{tmp_path / 'out'}/trainer.sock"
        async with orchestrator_process("run", str(job)) as run, \
                orchestrator_process("receive", trainer_address, "--checkpoint-dir", str(ckpt), "--steps", str(STEPS)):
            assert await asyncio.wait_for(run.wait(), 300) == 0  # a hang guard
        logs = [await sim_log(a.url), await sim_log(b.url)]
    salts: set[str] = set()
    for log in logs:
        admin = [(c["path"], c["query"], c["body"], c["status"]) for c in log["admin"]]
        starts = [i for i, c in enumerate(admin) if c[0] == "/pause"]
        syncs = [admin[i:admin.index(("/resume", {}, None, 200), i) + 1] for i in starts]
        cut = False
        for n, sync in enumerate(syncs, start=1):
            weights = str((ckpt / f"step_{n}").resolve())
            load: list[tuple[str, dict[str, str], Any, int]]
            if backend == "prime-rl":
                load = [("/update_weights", {}, {"weight_dir": weights}, 200)]
            else:  # vLLM 0.26 has no weight versions: that call's 404 is expected and ignored
                load = [("/collective_rpc", {}, {"method": "reload_weights", "kwargs": {"weights_path": weights}}, 200),
                        ("/update_weight_version", {}, {"new_version": str(n)}, 404)]
            # keep in-flight requests and the (salted) cache; load; resume. The run may end during the sync of
            # the checkpoint that follows its last step: that one is cut short, and still resumed.
            expected = [("/pause", KEEP, None, 200), *load, ("/resume", {}, None, 200)]
            cut = n == len(syncs) and sync != expected
            assert sync == expected or (cut and sync == [*expected[:len(sync) - 1], expected[-1]]), sync
        complete = len(syncs) - cut
        assert complete >= 2, admin  # the trainer announced after every step
        assert step_of(log["weights_path"]) >= complete
        sampled = [g for g in log["generate"] if g["status"] == 200 and g["cache_salt"] != "preflight"]
        assert sampled, "a server never rejoined"
        for g in sampled:  # no request counted as policy N was sampled with weights older than N
            assert step_of(g["weights_path"]) >= int(g["cache_salt"]), g
        salts |= {g["cache_salt"] for g in sampled}
        assert max(int(g["cache_salt"]) for g in sampled) >= 2  # back in rotation after the syncs
    assert {"0", "1", "2"} <= salts  # the salt changed with the policy


@contextlib.asynccontextmanager
async def checked(servers: list[SimServer], backend: str, model: str = "sim-model", tokenizer: Path | None = None,
                  logprobs: LogprobsCheck | None = None) -> AsyncIterator[Preflight]:
    async with aiohttp.ClientSession() as session:
        apis: list[InferenceServer] = [HttpInferenceServer(s.url, session) for s in servers]
        yield await preflight(apis, backend=backend, model=model, tokenizer=tokenizer or tokenizer_dir(), resume=True,
                              logprobs=logprobs)


def other_tokenizer(directory: Path) -> Path:
    """A tokenizer that splits the probe text like the built-in one but numbers its words differently."""
    words = json.loads((tokenizer_dir() / "tokenizer.json").read_text())["model"]["vocab"]
    reversed_ids = {w: len(words) - 1 - i for w, i in words.items()}
    tok = Tokenizer(models.WordLevel(reversed_ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return directory


# (profile, server options, backend, check kwargs, words the one message must contain)
BREAKS: list[tuple[ProfileName, dict[str, Any], str, dict[str, Any], str]] = [
    ("vllm-0.26", {"dev_mode": False}, "vllm", {}, "start vLLM with VLLM_SERVER_DEV_MODE=1"),
    ("prime-rl", {}, "vllm", {}, "set inference.backend = 'prime-rl'"),
    ("vllm-0.26", {}, "prime-rl", {}, "this is upstream vLLM, not prime-rl's inference server"),
    ("vllm-0.26", {"dev_mode": False}, "prime-rl", {}, "start prime-rl's inference server"),
    ("prime-rl", {}, "prime-rl", {"model": "Qwen/Qwen3-4B"}, "set model.name to the served name"),
    ("prime-rl", {}, "prime-rl", {"tokenizer": "other"}, "set model.tokenizer to the served model's tokenizer"),
    # started without --enable-scale-out: 0.31 has no generate route (404), 0.32 and 0.33 refuse it (403)
    ("vllm-0.31", {"scale_out": False}, "vllm", {}, "restart vllm serve with --enable-scale-out"),
    ("vllm-0.32", {"scale_out": False}, "vllm", {}, "restart vllm serve with --enable-scale-out"),
    ("vllm-0.33", {"scale_out": False}, "vllm", {}, "restart vllm serve with --enable-scale-out"),
]


@pytest.mark.parametrize(("profile", "options", "backend", "kwargs", "fix"), BREAKS,
                         ids=[f"{p}-{b}-{'-'.join(map(str, [*o, *k])) or 'default'}" for p, o, b, k, _ in BREAKS])
async def test_preflight_names_each_break_and_its_fix(tmp_path: Path, profile: ProfileName, options: dict[str, Any],
                                                       backend: str, kwargs: dict[str, Any], fix: str) -> None:
    if kwargs.get("tokenizer") == "other":
        kwargs = {**kwargs, "tokenizer": other_tokenizer(tmp_path / "tok")}
    async with sim_servers(2, profile=profile, **options) as servers:
        with pytest.raises(PreflightError) as e:
            async with checked(servers, backend, **kwargs):
                pass
    assert e.value.problems == [p for p in e.value.problems if fix in p]  # only that problem ...
    assert sorted(p.split(": ")[0] for p in e.value.problems) == sorted(s.url for s in servers)  # ... per server


async def test_preflight_passes_the_supported_servers_and_says_what_is_down() -> None:
    async with sim_servers(1, profile="prime-rl", layers=2, top_k=2) as prime, \
            sim_servers(1, profile="vllm-0.26") as vllm:
        async with checked(prime, "prime-rl"), checked(vllm, "vllm") as report:
            pass
        assert [s.weight_versions for s in report.servers] == [False]  # 0.26: bounded token versions
        for profile in ("vllm-0.26", "vllm-0.31", "vllm-0.32", "vllm-0.33"):  # .npy routed experts, 0.32+ logprobs
            async with sim_servers(1, profile=profile, layers=2, top_k=2) as newer, checked(newer, "vllm") as report:
                assert [s.weight_versions for s in report.servers] == [profile >= "vllm-0.32"], profile
        vllm[0].faults = Faults(down=True)
        with pytest.raises(PreflightError, match="503: its engine is dead"):
            async with checked(vllm, "vllm"):
                pass
    with pytest.raises(PreflightError, match="not reachable"):
        async with checked(vllm, "vllm"):  # stopped: the port refuses
            pass


async def test_check_servers_exits_1_naming_the_fix(tmp_path: Path) -> None:
    async with sim_process(profile="vllm-0.26", dev_mode=False) as server:
        job = write_job(tmp_path, [server.url], "vllm")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--log-level", "ERROR", "check", str(job), "--servers",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 1, (out, err)
    assert b"VLLM_SERVER_DEV_MODE=1" in err
    assert server.url.encode() in err


async def test_512_experts_arrive_as_uint16_byte_identical_to_what_the_server_sent(tmp_path: Path) -> None:
    batches: list[Batch] = []

    def keep(batch: Batch) -> None:  # copies: the batch's arrays view receive buffers
        batches.append(Batch(batch.run, batch.step, {k: v.copy() for k, v in batch.columns.items()},
                             batch.offsets.copy(), dict(batch.scalars)))

    async with sim_servers(1, profile="prime-rl", layers=3, top_k=4, num_experts=512, record_replies=True) as [sim]:
        cfg = load_config(write_job(tmp_path, [sim.url], "prime-rl", steps=2))
        async with Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=2, on_batch=keep, checkpoint_dir=tmp_path / "c")
            async with asyncio.timeout(300), asyncio.TaskGroup() as tg:  # a hang guard, workers' start-up included
                tg.create_task(trainer.run())
                await orch.run()
        sent: dict[tuple[int, ...], list[dict[str, Any]]] = {}
        for g in sim.log.to_json()["generate"]:
            if g["status"] == 200 and g["token_ids"] is not None:
                sent.setdefault(tuple(g["token_ids"]), []).append(g["routed_experts"])
    compared = 0
    for batch in batches:
        routed = batch.columns["routed_experts"]
        assert routed.dtype == np.uint16
        for i in range(batch.num_samples):
            a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
            tokens = tuple(batch.columns["token_ids"][a:b].tolist())
            ours = routed[a:b]
            # the replies that sampled exactly these tokens (a group often samples the same short answer twice)
            candidates = sent.get(tokens, [])
            matched = [r for r in candidates if ours[r["start"]:-1].tobytes() == decode(r).tobytes()]
            assert matched or not candidates, f"sample {i} of step {batch.step}: no reply sent these routed experts"
            if matched:
                reply = matched[0]
                candidates.remove(reply)  # each reply accounts for one sample
                rows = decode(reply)
                assert reply["dtype"] == "uint16"
                assert rows.shape[0] == len(tokens) - 1 - reply["start"]  # the last sampled token has no row yet
                assert ours[-1].tobytes() == rows[-1].tobytes()  # verifiers' client repeats the last row
                compared += 1
    assert any(decode(r).max() > 255 for rs in sent.values() for r in rs)  # ids above 255 took the uint16 path
    assert compared >= 8, compared


def decode(reply: dict[str, Any]) -> np.ndarray:
    """prime-rl's routed experts object as the array it encodes."""
    return np.frombuffer(base64.b64decode(reply["data"]), reply["dtype"]).reshape(reply["shape"])
