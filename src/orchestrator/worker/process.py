"""The env worker: hosts verifiers environments, runs assigned groups, returns compact rollout records.

Runs as its own process (``orchestrator env-worker --connect ADDRESS``), so environment code, trace
handling and sample building never touch the orchestrator's event loop. Its loop consumes ``setup``,
``assign``, ``cancel`` and ``stop`` messages from the orchestrator; it produces ``records`` messages (one per
group: each finished episode's scalars + column frames, see protocol.py) and a heartbeat every HEARTBEAT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import re
import time
from typing import Any

import zmq
import zmq.asyncio

from orchestrator.errors import EnvironmentLoadError
from orchestrator.samples import SampleError, samples_from_trace
from orchestrator.worker.protocol import FLUSH_S, HEARTBEAT_S, pack, records_message, sample_frames, unpack

log = logging.getLogger(__name__)

# verifiers' interception proxy answers the harness 5xx when the inference server's reply was unusable
# (malformed JSON, bad token strings, NaN logprobs): the server's fault, which its health should count
SERVER_FAULT = re.compile(r"Error code: 5\d\d")


class LoadedEnv:
    def __init__(self, name: str, env: Any) -> None:
        self.name = name
        self.env = env
        self.tasks = list(env.taskset)
        if not self.tasks:
            raise EnvironmentLoadError(f"environment {name!r}: its taskset yields no task")


def load_env(spec: dict[str, Any]) -> LoadedEnv:
    """Load one environment (verifiers import happens here, in the worker, once)."""
    import verifiers.v1 as vf

    name = spec["name"]
    try:
        cfg = vf.resolve_env_config({"taskset": {"id": spec["taskset"], **spec.get("args", {})},
                                     "agent": {"runtime": {"type": "subprocess"}}})
        return LoadedEnv(name, vf.load_environment(cfg))
    except EnvironmentLoadError:
        raise
    except Exception as e:  # any failure inside a user's taskset is a load error naming the env
        raise EnvironmentLoadError(f"environment {name!r} (taskset {spec['taskset']!r}) failed to load: "
                                   f"{type(e).__name__}: {e}") from e


def episode_record(ep: Any, header: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """Turn a verifiers Episode into a record header and its column frames."""
    trace = ep.traces[0] if ep.traces else None
    errors = [f"{e.type}: {e.message}" for e in (ep.errors or [])]
    if trace is not None:
        errors += [f"{e.type}: {e.message}" for e in (trace.errors or []) if f"{e.type}: {e.message}" not in errors]
    ok = bool(ep.ok and trace is not None and trace.ok and not errors)
    reward = float(trace.reward or 0.0) if trace is not None else 0.0
    if ok and not math.isfinite(reward):  # one NaN would turn the whole group's advantages into NaN
        ok, errors = False, [f"invalid_reward: the environment returned a reward of {reward}"]
    frames: list[Any] = []
    shapes: list[list[int]] = []
    if ok and trace is not None:
        try:
            samples = samples_from_trace(trace)
            shapes, frames = sample_frames(samples)
        except SampleError as e:
            ok, errors = False, [f"inconsistent_sample: {e}"]
    header.update(
        server_fault=any(SERVER_FAULT.search(e) for e in errors),
        ok=ok,
        reward=reward if math.isfinite(reward) else None,
        metrics={k: float(v) for k, v in (trace.metrics or {}).items() if isinstance(v, int | float)}
        if trace is not None else {},
        error=errors[0] if errors else None,
        stop=trace.stop_condition if trace is not None else None,
        is_timeout=bool(ep.is_timeout),
        samples=shapes,
        tokens=sum(s[0] for s in shapes),
    )
    return header, frames


def failed_header(header: dict[str, Any], error: Exception) -> dict[str, Any]:
    """``header`` completed as a failed rollout whose environment raised ``error``."""
    header.update(ok=False, reward=0.0, metrics={}, error=f"env_error: {type(error).__name__}: {error}",
                  stop=None, is_timeout=False, samples=[], tokens=0)
    return header


class Worker:
    def __init__(self, address: str, worker_id: str) -> None:
        self.address = address
        self.worker_id = worker_id
        self.envs: dict[str, LoadedEnv] = {}
        self.groups: dict[str, asyncio.Task[None]] = {}
        self._contexts: dict[str, Any] = {}

    async def run(self) -> int:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.address)
        try:
            await sock.send(pack({"type": "hello", "worker": self.worker_id, "pid": os.getpid()}))
            setup = unpack(await sock.recv())
            try:
                async with contextlib.AsyncExitStack() as stack:
                    for spec in setup["envs"]:
                        loaded = load_env(spec)
                        await stack.enter_async_context(loaded.env.serving())
                        self.envs[loaded.name] = loaded
                    self.model, self.tokenizer = setup["model"], setup["tokenizer"]
                    gc.freeze()  # everything loaded so far lives for the process: keep it out of GC passes
                    await sock.send(pack({"type": "ready", "worker": self.worker_id,
                                          "envs": {n: len(e.tasks) for n, e in self.envs.items()}}))
                    await self._serve(sock)
            except EnvironmentLoadError as e:
                log.error("%s", e)
                await sock.send(pack({"type": "fatal", "worker": self.worker_id, "error": str(e)}))
                return 3
            return 0
        finally:
            sock.close()
            ctx.term()

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        """Consumes assign/cancel/stop; produces rollout records and heartbeats until ``stop``."""
        async with asyncio.TaskGroup() as tg:
            beat = tg.create_task(self._heartbeat(sock))
            while True:
                msg = unpack(await sock.recv())
                kind = msg["type"]
                if kind == "assign":
                    self.groups[msg["group"]] = tg.create_task(self._run_group(sock, msg))
                elif kind == "cancel":
                    task = self.groups.pop(msg["group"], None)
                    if task is not None:
                        task.cancel()
                elif kind == "stop":
                    break
            for task in self.groups.values():
                task.cancel()
            beat.cancel()

    async def _heartbeat(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            await sock.send(pack({"type": "heartbeat", "worker": self.worker_id, "inflight": len(self.groups)}))
            await asyncio.sleep(HEARTBEAT_S)

    def _model_context(self, server: str, sampling: dict[str, Any]) -> Any:
        import verifiers.v1 as vf
        from renderers.configs import DefaultRendererConfig

        key = repr((server, sorted(sampling.items())))
        ctx = self._contexts.get(key)
        if ctx is None:
            client = vf.TrainClientConfig(base_url=server, renderer=DefaultRendererConfig(),
                                          renderer_model_name=self.tokenizer)
            ctx = self._contexts[key] = vf.ModelContext(model=self.model, client=client,
                                                        sampling=vf.SamplingConfig(**sampling))
        return ctx

    async def _run_group(self, sock: zmq.asyncio.Socket, msg: dict[str, Any]) -> None:
        """Run one group's rollouts; send their records together when the last one ends, or FLUSH_S
        after the latest one finished while others still run (so a slow sibling delays nobody long)."""
        loaded = self.envs[msg["env"]]
        try:
            task = loaded.tasks[msg["task"] % len(loaded.tasks)]
            ctx = self._model_context(msg["server"], msg["sampling"])
            slots = loaded.env.slots(task, len(msg["rids"]))
        except Exception as e:  # the group's setup failed: each of its rollouts fails; the worker goes on
            failed: list[tuple[dict[str, Any], list[Any]]] = [
                (failed_header(self._header(loaded, rid, msg), e), []) for rid in msg["rids"]]
            await sock.send_multipart(records_message(msg["group"], failed), copy=False)
            self.groups.pop(msg["group"], None)
            return
        done: asyncio.Queue[tuple[dict[str, Any], list[Any]]] = asyncio.Queue()
        try:
            async with asyncio.TaskGroup() as tg:
                for rid, slot in zip(msg["rids"], slots, strict=True):
                    tg.create_task(self._run_one(done, loaded, slot, ctx, rid, msg))
                pending: list[tuple[dict[str, Any], list[Any]]] = []
                for _ in msg["rids"]:
                    try:
                        async with asyncio.timeout(FLUSH_S if pending else None):
                            item = await done.get()
                    except TimeoutError:
                        await sock.send_multipart(records_message(msg["group"], pending), copy=False)
                        pending = []
                        item = await done.get()
                    pending.append(item)
            await sock.send_multipart(records_message(msg["group"], pending), copy=False)
        finally:
            self.groups.pop(msg["group"], None)

    def _header(self, loaded: LoadedEnv, rid: str, msg: dict[str, Any]) -> dict[str, Any]:
        return {"rid": rid, "group": msg["group"], "env": loaded.name, "task": msg["task"],
                "policy_step": msg["policy_step"], "worker": self.worker_id, "server": msg["server"]}

    async def _run_one(self, done: asyncio.Queue[tuple[dict[str, Any], list[Any]]], loaded: LoadedEnv, slot: Any,
                       ctx: Any, rid: str, msg: dict[str, Any]) -> None:
        start = time.monotonic()
        header = self._header(loaded, rid, msg)
        frames: list[Any] = []
        try:
            ep = await loaded.env.run_slot(slot, ctx)
            header, frames = episode_record(ep, header)
        except Exception as e:  # an env that raises fails this rollout, not the worker
            failed_header(header, e)
        header["wall_s"] = round(time.monotonic() - start, 4)
        done.put_nowait((header, frames))
