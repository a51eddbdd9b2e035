"""A job on the real stack, in one process: the orchestrator against real vLLM servers, the PyTorch trainer on a
real model (``orchestrator.trainer.torch_learner``), the built-in environments in real env workers.

``await run_real_job(RealJob(out, model_dir, urls, ...))`` writes the job's TOML (``job.toml``), runs the
orchestrator and the trainer (a ``ReferenceTrainer`` with a ``TorchLearner``, journaling every step) until
``steps`` steps are trained, and returns what both saw; ``weight_transfer = "broadcast"``: the trainer sends its
weights over gloo (servers started with that engine). The real-stack tests and ``bench_real_vllm.py`` use it; so
can a user checking their own setup. ``reload_base`` puts a server back on the weights it started with.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from orchestrator.app import Orchestrator, RunSummary
from orchestrator.config import load_config
from orchestrator.realstack.install import StackPaths
from orchestrator.realstack.server import VLLMServer
from orchestrator.testing.jobs import Section, toml_text
from orchestrator.trainer.reference import BroadcastLearner, ReferenceTrainer, read_journal

RESET_TRIES = 20  # reload_base's prefix-cache resets, 0.5 s apart
ENVS = {
    "arith": "orchestrator-arithmetic",  # single turn
    "guess": "orchestrator-guess-number",  # 2-6 turns
}


@dataclass
class Servers:
    """The real servers a test session shares (tests/real/conftest.py)."""

    dense: list[VLLMServer]  # on the dense model, float32, processed logprobs
    moe: VLLMServer  # on the MoE model, float32, raw logprobs (vLLM's default)
    paths: StackPaths

    def model(self, kind: str) -> Path:
        return self.paths.model(kind)


@dataclass(frozen=True)
class RealJob:
    """A job's shape; ``config_text`` is its TOML."""

    out: Path
    model: Path  # the served model's directory (its tokenizer is model.tokenizer)
    urls: tuple[str, ...]
    steps: int = 4
    envs: tuple[str, ...] = ("arith", "guess")
    batch_size: int = 16
    max_inflight: int | None = None  # default: batch_size
    group_size: int = 4
    max_tokens: int = 4
    temperature: float = 1.0
    max_async_level: int = 0  # 0: every step trains on rollouts of the weights the trainer saved last
    workers: int = 1  # env workers per environment
    seed: int = 0
    concurrency: Section = field(default_factory=dict)  # [scheduler.concurrency], e.g. {"adaptive": True}
    # more keys of each env's sampling table, e.g. {"extra_body": {"ignore_eos": True}}; env_sampling: per env
    sampling: Section = field(default_factory=dict)
    env_sampling: Mapping[str, Section] = field(default_factory=dict)
    # [pipeline]: every finished rollout trains, so every step has tokens for the trainer's parity check (with the
    # zero_advantage filter a tiny model's step whose every group scored alike is empty: the 0.31 job's learner once
    # got a batch without a versions column); a rollout of zero advantage adds no gradient
    pipeline: Section = field(default_factory=lambda: {"gates": [], "filters": []})
    extra: Mapping[str, Section | Sequence[Section]] = field(default_factory=dict)  # more sections (testing.jobs)
    env_keys: Mapping[str, Section] = field(default_factory=dict)  # more keys of an env, by name (e.g. algorithm)
    weight_transfer: str = "filesystem"  # "broadcast": the trainer sends its weights over gloo (servers with it)
    save_every: int = 1  # the trainer writes a checkpoint directory every this many steps
    broadcast: Section = field(default_factory=dict)  # [inference.broadcast]

    @property
    def trainer_address(self) -> str:
        return f"ipc://{self.out / 'out'}/trainer.sock"

    def config_text(self) -> str:
        sampling = {"max_tokens": self.max_tokens, "temperature": self.temperature, **self.sampling}
        return toml_text(
            run={"name": "real", "output_dir": self.out / "out", "max_steps": self.steps, "seed": self.seed},
            model={"name": "tiny", "tokenizer": self.model},
            inference={"servers": list(self.urls), "backend": "vllm", "request_timeout_s": 120.0,
                       "probe_interval_s": 0.5, "weight_transfer": self.weight_transfer,
                       **({"broadcast": self.broadcast} if self.broadcast else {})},
            scheduler={"batch_size": self.batch_size, "max_inflight": self.max_inflight or self.batch_size,
                       "max_async_level": self.max_async_level, "max_off_policy_steps": self.max_async_level + 1,
                       "concurrency": self.concurrency},
            pipeline=self.pipeline,
            env=[{"name": name, "taskset": ENVS[name], "group_size": self.group_size, "workers": self.workers,
                  "sampling": {**sampling, **self.env_sampling.get(name, {})}, **self.env_keys.get(name, {})}
                 for name in self.envs],
            **self.extra)


@dataclass
class RealJobResult:
    summary: RunSummary
    journal: list[dict[str, Any]]  # the trainer's journal: a row per step trained, with its learner's report
    checkpoints: Path
    orchestrator: Orchestrator | None = field(default=None, repr=False)


async def run_real_job(job: RealJob, learner: BroadcastLearner, *,
                       trainer: Callable[..., ReferenceTrainer] = ReferenceTrainer,
                       during: Callable[[Orchestrator], Coroutine[Any, Any, None]] | None = None,
                       timeout_s: float = 900.0) -> RealJobResult:
    """Run ``job`` with ``learner`` behind a reference trainer (``trainer``: its class, e.g. a test's subclass);
    ``during(orch)`` runs beside them (a test's fault injection). A hang guard of ``timeout_s``."""
    job.out.mkdir(parents=True, exist_ok=True)
    path = job.out / "job.toml"
    path.write_text(job.config_text())
    cfg = load_config(path)
    journal, ckpt = job.out / "journal.jsonl", job.out / "ckpt"
    broadcaster = None
    if job.weight_transfer == "broadcast":
        from orchestrator.trainer.gloo_broadcast import GlooBroadcaster

        broadcaster = GlooBroadcaster(learner.weights)
    run = trainer(job.trainer_address, journal=journal, checkpoint_dir=ckpt, learner=learner, max_steps=job.steps,
                  broadcaster=broadcaster, save_every=job.save_every)
    async with asyncio.timeout(timeout_s), Orchestrator.open(cfg) as orch, asyncio.TaskGroup() as tg:
        trained = tg.create_task(run.run())
        side = tg.create_task(during(orch)) if during is not None else None
        summary = await orch.run()
        await trained
        if side is not None and not side.done():
            side.cancel()
    return RealJobResult(summary, read_journal(journal), ckpt, orch)


async def reload_base(url: str, model: Path) -> None:
    """A shared server back to the state it started in: pause, reload ``model``'s own weights, resume, and empty
    its prefix cache. Its KV blocks were computed with a previous test's weights under the ``cache_salt`` of a
    policy version (inference/weights.py) that this test's run numbers again from 0: reused, they would give this
    run's requests that run's logprobs. A reset fails while blocks are held (requests still running): retried."""
    root = url.removesuffix("/v1")
    async with aiohttp.ClientSession() as session:
        for path, body in (("/pause?mode=keep&clear_cache=false", None),
                           ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(model)}}),
                           ("/update_weight_version", {"new_version": "0"}), ("/resume", None)):
            async with session.post(root + path, json=body) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"{root}{path}: HTTP {reply.status}: {(await reply.text())[:300]}")
        for _ in range(RESET_TRIES):
            async with session.post(root + "/reset_prefix_cache") as reply:
                if reply.status != 200:
                    raise RuntimeError(f"{root}/reset_prefix_cache: HTTP {reply.status}: {(await reply.text())[:300]}")
                if (await reply.json()).get("success"):
                    return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{root}/reset_prefix_cache: no success in {RESET_TRIES} tries (requests still running)")


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as reply:
        with contextlib.suppress(aiohttp.ContentTypeError):
            return await reply.json()
        return None
