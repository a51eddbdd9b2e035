"""The env worker: hosts verifiers environments, runs assigned groups, returns compact rollout records.

Runs as its own process (``orchestrator env-worker --connect ADDRESS``), so environment code, trace
handling and sample building never touch the orchestrator's event loop. Its loop consumes ``setup``,
``assign``, ``cancel``, ``release`` and ``stop`` messages from the orchestrator; it produces ``records``
messages (one per group: each finished episode's scalars + column frames, see protocol.py) and a heartbeat
every HEARTBEAT_S.

verifiers' client reaches the inference servers through this process's ``GenerateShim`` (shim.py): it adapts vLLM
0.32+'s generate replies to what verifiers reads and keeps the weight versions they report, so the ``versions`` of
each sampled token is exact where the server says which weights sampled it.

With ``data_plane = "direct"`` in its setup (docs/data-plane.md) a rollout's columns are written once into
this worker's own column pool (``columns.store.ColumnStore``, served read-only to trainers on this host at
``<pool_dir>/<worker id>.pool``) and its record carries the span instead of frames; ``release`` frees spans.
Spans of records never sent (a cancelled group) are freed here. A setup from another orchestrator process
(a new ``session``) renews the pool: the old one's spans belonged to records that orchestrator held.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import re
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from orchestrator.columns.memfd import check_socket_path, serve_pool
from orchestrator.columns.samples import Sample, SampleError, samples_from_trace
from orchestrator.columns.store import ColumnStore, PoolTooSmall, rollout_layout, sample_optional
from orchestrator.columns.versions import TokenVersions, summary
from orchestrator.contracts.protocol import (
    FLUSH_S,
    HEARTBEAT_S,
    Assign,
    AssignedRollout,
    Cancel,
    EnvSpec,
    Fatal,
    Heartbeat,
    Hello,
    PoolInfo,
    Ready,
    Release,
    RolloutHeader,
    Setup,
    Stop,
    TokenFilter,
    decode_orchestrator_message,
    pack,
    records_message,
    sample_frames,
)
from orchestrator.errors import ConfigError, EnvironmentLoadError, Failure, TransportError, WireError
from orchestrator.memory import rss_mb
from orchestrator.scoring.filters import token_filter
from orchestrator.security import ClientKeys, KeyPair, RefusalWatch, ServerKeys, is_loopback, secure_client
from orchestrator.trainer.fetch import SpanServer
from orchestrator.workers.envconfig import resolve_env
from orchestrator.workers.shim import Calls, GenerateShim

log = logging.getLogger(__name__)

CONTEXTS_KEPT = 64  # (server, sampling) pairs: servers x envs x the policy versions still in flight
NO_API_KEY_VAR = "ORCHESTRATOR_NO_API_KEY"  # an unset variable: verifiers sends "EMPTY", looks up nothing else
SERVER_FAULT = re.compile(r"Error code: 5\d\d")  # see classify()
SCORING = re.compile(r"\bscoring\b")  # verifiers' TaskError boundary names ("task X scoring", "scoring")


class LoadedEnv:
    def __init__(self, name: str, env: Any, tasks: Iterable[Any] | None = None) -> None:
        self.name = name
        self.env = env
        self.tasks = list(env.taskset if tasks is None else tasks)
        if not self.tasks:
            raise EnvironmentLoadError(f"environment {name!r}: its taskset yields no task")


def load_env(spec: EnvSpec) -> LoadedEnv:
    """Load one environment with its verifiers configuration (verifiers is imported here, in the worker, once).
    A configuration verifiers rejects, or a taskset that fails to load, is an EnvironmentLoadError naming the
    environment and the key."""
    import verifiers.v1 as vf

    what = f"environment {spec.name!r} (taskset {spec.taskset!r}) failed to load"
    try:
        resolved = resolve_env(spec.taskset, spec.args, spec.verifiers, spec.select, spec.key)
        env = vf.load_environment(resolved.config)
        return LoadedEnv(spec.name, env, env.taskset.select(resolved.select))
    except ConfigError as e:  # verifiers rejected the configuration: each problem names its key
        raise EnvironmentLoadError(f"{what}: {'; '.join(e.problems)}") from None
    except EnvironmentLoadError:
        raise
    except Exception as e:  # any failure inside a user's taskset is a load error naming the env
        raise EnvironmentLoadError(f"{what}: {type(e).__name__}: {e}") from e


def classify(errors: list[Any], is_timeout: bool) -> Failure:
    """The failure kind of a rollout from verifiers' recorded errors (``type``, ``message``, ``status_code``).

    verifiers names the boundary an error crossed (``ProviderError``, ``HarnessError``, ``TaskError``...); we
    map it to our vocabulary. A harness that got a 5xx from verifiers' interception proxy means the server's
    reply was unusable (malformed JSON, bad token strings, NaN logprobs): the server's fault."""
    if is_timeout:
        return Failure.TIMEOUT
    first = errors[0] if errors else None
    kind = getattr(first, "type", "")
    message = str(getattr(first, "message", ""))
    if kind == "ProviderError":
        return Failure.TIMEOUT if getattr(first, "status_code", None) == 504 else Failure.PROVIDER
    if kind == "HarnessError" and SERVER_FAULT.search(message):
        return Failure.MALFORMED
    if kind == "TaskError" and SCORING.search(message):
        return Failure.SCORING
    return Failure.ENV


def episode_record(ep: Any, base: AssignedRollout, wall_s: float, train: bool = True, calls: Calls | None = None
                   ) -> tuple[RolloutHeader, list[Sample]]:
    """Turn a verifiers Episode into a record header and its training samples (none for an evaluation
    rollout: ``train`` False, or a failed one). The header has the samples' shapes; where their columns go
    (frames or a span of the worker's pool) is the caller's choice. ``calls``: the versions its generate calls
    reported (the shim's), which make the samples' ``versions`` exact; without them every sampled token is
    bounded by the policy the rollout was assigned under."""
    trace = ep.traces[0] if ep.traces else None
    errors = list(ep.errors or [])
    if trace is not None:
        seen = {(e.type, e.message) for e in errors}
        errors += [e for e in (trace.errors or []) if (e.type, e.message) not in seen]
    stop = trace.stop_condition if trace is not None else None
    if not (ep.ok and trace is not None and trace.ok and not errors):
        first = f"{errors[0].type}: {errors[0].message}" if errors else f"the episode failed (stop: {stop})"
        return RolloutHeader.failed(base, classify(errors, bool(ep.is_timeout)), first, wall_s=wall_s, stop=stop,
                                    is_timeout=bool(ep.is_timeout)), []
    reward = float(trace.reward or 0.0)
    if not math.isfinite(reward):  # one NaN would turn the whole group's advantages into NaN
        return RolloutHeader.failed(base, Failure.INVALID_REWARD, f"the environment returned a reward of {reward}",
                                    wall_s=wall_s, stop=stop), []
    try:
        samples = samples_from_trace(trace, TokenVersions(base.policy_step, calls)) if train else []
        shapes, routed_dtype, _ = rollout_layout(samples)
    except SampleError as e:
        return RolloutHeader.failed(base, Failure.BAD_SAMPLE, str(e), wall_s=wall_s, stop=stop), []
    metrics = {k: float(v) for k, v in (trace.metrics or {}).items()
               if isinstance(v, int | float) and math.isfinite(v)}
    header = RolloutHeader(rid=base.rid, group=base.group, env=base.env, task=base.task,
                           policy_step=base.policy_step, worker=base.worker, server=base.server, ok=True,
                           reward=reward, metrics=metrics, stop=stop, samples=shapes, routed_dtype=routed_dtype,
                           tokens=sum(s[0] for s in shapes) if train else _trace_tokens(trace), turns=trace.num_turns,
                           wall_s=wall_s)
    return header, samples


def matched_token_filters(filters: list[TokenFilter], samples: list[Sample]) -> list[int]:
    """The indices of ``filters`` a rollout matches, on its sampled tokens (``loss_mask``) across all its
    samples, in order: what ``RolloutRecord.sampled`` gives the orchestrator in through mode."""
    mask = np.concatenate([s.loss_mask for s in samples]).astype(bool)
    ids = np.concatenate([s.token_ids for s in samples])[mask]
    logprobs = np.concatenate([s.logprobs for s in samples])[mask]
    return [f.index for f in filters if token_filter(f.name, f.args)(ids, logprobs)]


def _trace_tokens(trace: Any) -> int:
    """Tokens of a trace's messages (an evaluation rollout's size, without building samples)."""
    return sum(len(getattr(node, "token_ids", None) or ()) for node in (trace.nodes or []))


class Worker:
    store_class = ColumnStore  # data_plane = direct: the column pool's class

    def __init__(self, address: str, worker_id: str, keys: ClientKeys | None = None,
                 span_address: str | None = None) -> None:
        self.address = address
        self.worker_id = worker_id
        self.keys = keys
        # direct mode: where to serve the pool's spans to trainers on other hosts (trainer/fetch.py): CURVE when the
        # setup names the clients' keys (with this worker's key pair, or one it makes); else loopback only
        self.span_address = span_address
        self.span_key: str | None = None  # the span server's public key (Z85), when it is CURVE
        self.envs: dict[str, LoadedEnv] = {}
        self.groups: dict[str, asyncio.Task[None]] = {}
        self.store: ColumnStore | None = None  # data_plane = direct: this worker's column pool
        self.pool_path: str | None = None  # where trainers on this host get the pool's fd
        self.shim: GenerateShim | None = None  # verifiers' way to the servers (None: straight to them)
        self._contexts: dict[str, Any] = {}

    async def run(self) -> int:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        sock.setsockopt(zmq.LINGER, 1000)
        if self.keys is not None:
            secure_client(sock, self.keys)
        refusals = RefusalWatch(sock, self.address, self.keys, "env worker")
        sock.connect(self.address)
        try:
            await sock.send(pack(Hello(self.worker_id, os.getpid())))
            setup = await self._setup(sock, refusals)
            if setup is None:
                return 0
            try:
                async with contextlib.AsyncExitStack() as stack:
                    self.setup, self.model, self.tokenizer = setup, setup.model, setup.tokenizer
                    self.shim = await stack.enter_async_context(GenerateShim.open())
                    await self._load(stack, setup)
                    await self.open_store(stack, setup)
                    gc.freeze()  # everything loaded so far lives for the process: keep it out of GC passes
                    await sock.send(pack(self._ready()))
                    await self._serve(sock)
            except (EnvironmentLoadError, TransportError) as e:  # environments, or the column pool
                log.error("%s", e)
                await sock.send(pack(Fatal(self.worker_id, str(e))))
                return 3
            return 0
        finally:
            refusals.close()
            sock.close()
            ctx.term()

    async def _load(self, stack: contextlib.AsyncExitStack, setup: Setup) -> None:
        """Load the setup's environments (served until ``stack`` closes) and warm their client (``_warm``).
        EnvironmentLoadError names the one that failed. (testing/synthetic_worker.py replaces this.)"""
        for spec in setup.envs:
            loaded = load_env(spec)
            await stack.enter_async_context(loaded.env.serving())
            self.envs[loaded.name] = loaded
        await self._warm()

    async def open_store(self, stack: contextlib.AsyncExitStack, setup: Setup) -> None:
        """data_plane = direct: this worker's column pool, closed by ``stack``, served read-only on
        ``<pool_dir>/<worker id>.pool`` when the setup names a directory. TransportError if it cannot be."""
        if setup.data_plane != "direct":
            return
        try:
            store = self.store_class(setup.worker_pool_bytes)
        except ValueError as e:
            raise TransportError(f"column pool: {e}") from None
        stack.callback(store.close)
        if setup.pool_dir is not None:
            path = str(Path(setup.pool_dir) / f"{self.worker_id}.pool")
            check_socket_path(path)
            self.pool_path = await stack.enter_async_context(serve_pool(store, path))
        if self.span_address is not None:
            curve = None
            if setup.span_clients:  # a worker without a key pair of its own (local, on ipc) makes one for its pool
                pair = self.keys.keys if self.keys is not None else KeyPair(*zmq.curve_keypair())
                curve = ServerKeys(pair, frozenset(k.encode() for k in setup.span_clients), Path())
            elif not is_loopback(self.span_address):
                raise TransportError(f"span server address {self.span_address}: a non-loopback address needs CURVE "
                                     "keys (this worker's key pair, and the trainers' keys: [security] on the "
                                     "orchestrator)")
            try:
                server = await stack.enter_async_context(SpanServer.open(store, self.span_address, curve))
            except zmq.ZMQError as e:
                raise TransportError(f"cannot bind the span server at {self.span_address}: {e}") from None
            self.span_address = server.address  # the port it got
            self.span_key = None if curve is None else curve.keys.public.decode()
        self.store = store
        log.info("column pool %s: %d MB%s", store.id, store.capacity >> 20,
                 f", served at {self.pool_path}" if self.pool_path else "")

    def _ready(self) -> Ready:
        pool = None if self.store is None else PoolInfo(id=self.store.id, size=self.store.capacity,
                                                         host=socket.gethostname(), path=self.pool_path,
                                                         address=self.span_address, public_key=self.span_key)
        return Ready(self.worker_id, {n: len(e.tasks) for n, e in self.envs.items()}, pool)

    async def _setup(self, sock: zmq.asyncio.Socket, refusals: RefusalWatch) -> Setup | None:
        """The orchestrator's ``setup``, or None if it says ``stop`` first (other messages before it are
        ignored: they were meant for a predecessor with this name). Says why, once, if its handshake fails."""
        while True:
            if not await sock.poll(1000):
                refusals.check()
                continue
            try:
                msg = decode_orchestrator_message(await sock.recv())
            except WireError as e:
                log.error("ignored a message from the orchestrator: %s", e)
                continue
            if isinstance(msg, Setup):
                return msg
            if isinstance(msg, Stop):
                return None

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        """Consumes assign/cancel/stop; produces rollout records and heartbeats until ``stop``."""
        async with asyncio.TaskGroup() as tg:
            beat = tg.create_task(self._heartbeat(sock))
            while True:
                try:
                    msg = decode_orchestrator_message(await sock.recv())
                except WireError as e:
                    log.error("ignored a message from the orchestrator: %s", e)
                    continue
                if isinstance(msg, Assign):
                    self.groups[msg.group] = tg.create_task(self._run_group(sock, msg))
                elif isinstance(msg, Setup):  # the orchestrator lost us (or restarted): start over
                    for running in self.groups.values():
                        running.cancel()
                    if not self.setup.same_job(msg):
                        log.error("the orchestrator sent another setup; exiting so a new worker loads it")
                        break
                    if msg.session != self.setup.session and self.store is not None:
                        self.store.renew()  # another orchestrator: the spans of the last one's records are gone
                    self.setup = msg
                    await sock.send(pack(self._ready()))
                elif isinstance(msg, Cancel):
                    task = self.groups.pop(msg.group, None)
                    if task is not None:
                        task.cancel()
                elif isinstance(msg, Release):
                    if self.store is not None:
                        self.store.release(msg.rids)
                        if msg.keep is not None:  # re-admitted: the orchestrator holds exactly these
                            self.store.keep_only(msg.keep)
                elif isinstance(msg, Stop):
                    break
            for task in self.groups.values():
                task.cancel()
            beat.cancel()

    async def _heartbeat(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            free = None if self.store is None else self.store.largest_free
            await sock.send(pack(Heartbeat(self.worker_id, len(self.groups), round(rss_mb(), 1), free)))
            await asyncio.sleep(HEARTBEAT_S)

    def _client_config(self, base_url: str) -> Any:
        """verifiers' train client config for a server at ``base_url``: our tokenizer's renderer, and a read timeout
        of ``request_timeout_s`` on every generate call (a keep pause holds a call open, so not a total one)."""
        import verifiers.v1 as vf
        from renderers.configs import DefaultRendererConfig
        from verifiers.v1.configs.client import ClientTimeoutConfig

        return vf.TrainClientConfig(base_url=base_url, renderer=DefaultRendererConfig(),
                                    renderer_model_name=self.tokenizer,
                                    api_key_var=self.setup.api_key_env or NO_API_KEY_VAR,
                                    timeout=ClientTimeoutConfig(read=self.setup.request_timeout_s))

    async def _warm(self) -> None:
        """Build, before ``ready``, the tokenizer renderer verifiers' train client would build on the first
        rollout (shared by every later one): loading a tokenizer imports transformers, seconds of CPU mostly holding
        the GIL, which starved this loop's heartbeats for 2-4 s on a busy machine and got fresh workers declared
        silent (``scheduler.worker_silence_s``) again and again. Before ``ready`` the hub allows minutes. Where the
        tokenizer allows, it is loaded without AutoTokenizer, which imports torch (renderer.py: ~200 MB)."""
        from orchestrator.workers.renderer import warm_renderer

        cfg = self._client_config("http://warm-up.invalid/v1")  # the pool is keyed by the renderer, not the URL
        try:
            how = await warm_renderer(cfg.renderer_model_name, cfg.renderer, cfg.multiplex)
            log.info("renderer of tokenizer %s built: %s; RSS %.0f MB", self.tokenizer, how, rss_mb())
        except Exception as e:  # the first rollout builds it again and fails with the reason, as data
            log.warning("could not build the renderer of tokenizer %s ahead of the first rollout: %s: %s",
                        self.tokenizer, type(e).__name__, e)

    def _model_context(self, server: str, sampling: dict[str, Any]) -> Any:
        """verifiers' model context for ``server`` and ``sampling`` (cache_salt included), reused while the
        policy lasts: at most CONTEXTS_KEPT are kept, the oldest dropped first."""
        import verifiers.v1 as vf

        key = repr((server, sorted(sampling.items())))
        ctx = self._contexts.pop(key, None)
        if ctx is None:
            client = self._client_config(server if self.shim is None else self.shim.url_for(server))
            ctx = vf.ModelContext(model=self.model, client=client, sampling=vf.SamplingConfig(**sampling))
        self._contexts[key] = ctx  # most recently used last
        while len(self._contexts) > CONTEXTS_KEPT:
            del self._contexts[next(iter(self._contexts))]
        return ctx

    def _assigned(self, msg: Assign, rid: str) -> AssignedRollout:
        return AssignedRollout(rid, msg.group, msg.env, msg.task, msg.policy_step, self.worker_id, msg.server)

    async def _run_group(self, sock: zmq.asyncio.Socket, msg: Assign) -> None:
        """Run one group's rollouts; send their records together when the last one ends, or FLUSH_S
        after the latest one finished while others still run (so a slow sibling delays nobody long)."""
        try:
            loaded = self.envs[msg.env]
            task = loaded.tasks[msg.task % len(loaded.tasks)]
            ctx = self._model_context(msg.server, msg.sampling)
            slots = loaded.env.slots(task, len(msg.rids))
        except Exception as e:  # the group's setup failed: each of its rollouts fails; the worker goes on
            error = f"{type(e).__name__}: {e}"
            failed: list[tuple[RolloutHeader, list[Any]]] = [
                (RolloutHeader.failed(self._assigned(msg, rid), Failure.ENV, error), []) for rid in msg.rids]
            await sock.send_multipart(records_message(msg.group, failed), copy=False)
            self.groups.pop(msg.group, None)
            return
        done: asyncio.Queue[tuple[RolloutHeader, list[Any]]] = asyncio.Queue()
        pending: list[tuple[RolloutHeader, list[Any]]] = []
        try:
            async with asyncio.TaskGroup() as tg:
                for rid, slot in zip(msg.rids, slots, strict=True):
                    tg.create_task(self._run_one(done, loaded, slot, ctx, self._assigned(msg, rid), msg.train))
                for _ in msg.rids:
                    try:
                        async with asyncio.timeout(FLUSH_S if pending else None):
                            item = await done.get()
                    except TimeoutError:
                        sent, pending = pending, []  # from here on the orchestrator owns their spans
                        await sock.send_multipart(records_message(msg.group, sent), copy=False)
                        item = await done.get()
                    pending.append(item)
            sent, pending = pending, []
            await sock.send_multipart(records_message(msg.group, sent), copy=False)
        finally:
            self.groups.pop(msg.group, None)
            while not done.empty():
                pending.append(done.get_nowait())
            self._free_unsent(pending)

    def _free_unsent(self, records: list[tuple[RolloutHeader, list[Any]]]) -> None:
        """The spans of records that were never sent (a cancelled group): nobody else will release them."""
        if self.store is not None:
            self.store.release(h.rid for h, _ in records if h.span is not None)

    async def _run_one(self, done: asyncio.Queue[tuple[RolloutHeader, list[Any]]], loaded: LoadedEnv, slot: Any,
                       ctx: Any, base: AssignedRollout, train: bool) -> None:
        """Run one rollout; put its record (header and frames, or a span of the pool) on ``done``. Waits for the
        episode, then (direct) for room in the pool."""
        start = time.monotonic()
        try:
            ep = await loaded.env.run_slot(slot, ctx)
            trace_id = ep.traces[0].id if ep.traces and self.shim is not None else None
            calls = self.shim.take(trace_id) if self.shim is not None and trace_id else None
            header, samples = episode_record(ep, base, round(time.monotonic() - start, 4), train, calls)
            item = await self._columns(header, samples)
        except Exception as e:  # an env that raises fails this rollout, not the worker
            item = (RolloutHeader.failed(base, Failure.ENV, f"{type(e).__name__}: {e}",
                                         wall_s=round(time.monotonic() - start, 4)), [])
        done.put_nowait(item)  # no await between a span's write and here: a cancel cannot lose it

    async def _columns(self, header: RolloutHeader, samples: list[Sample]) -> tuple[RolloutHeader, list[Any]]:
        """Where a rollout's columns go: frames after its header (through), or one span of this worker's pool,
        named in the header (direct), with the token filters it matched (the orchestrator cannot read them)."""
        if not samples:
            return header, []
        header.optional = list(sample_optional(samples))
        if "versions" in header.optional:
            header.versions = [summary(s.versions, s.loss_mask) for s in samples if s.versions is not None]
        if self.store is None:
            return header, sample_frames(samples)[1]
        if self.setup.token_filters:
            header.filters = matched_token_filters(self.setup.token_filters, samples)
        try:
            header.span = await self.store.write(header.rid, samples)
        except PoolTooSmall as e:
            return RolloutHeader.failed(header, Failure.POOL_TOO_SMALL, str(e), wall_s=header.wall_s,
                                        stop=header.stop), []
        return header, []
