"""The inference pool: which server a group runs on, which servers are healthy, and weight sync.

Use (the orchestrator)::

    async with InferencePool.open(cfg.inference, cfg.model.name) as pool, asyncio.TaskGroup() as tg:
        tg.create_task(pool.run())                  # background probes: owned by the caller
        server = pool.take(group_size)              # ... pool.release(server, group_size)
        result = await pool.update_weights(Checkpoint(step, path))  # WeightSyncResult(updated, failed)

- **Choice and pinning.** ``take(n)`` picks the in-rotation server with room under its cap (``Server.cap``; none:
  no cap of its own) with the fewest rollouts in flight and counts ``n`` more on it until ``release``: a group of
  ``n`` rollouts is taken once, so the whole group is pinned to one server (``server.url`` is what its env worker
  talks to). None when no server is in rotation or none has room: ``wait_room`` until one may.
- **Health.** ``report_failure`` / ``report_success`` come from whoever talked to the server (the scheduler,
  for env workers' calls: an error, a malformed reply or a request timeout alike). ``failures_to_evict``
  consecutive failures take a server out of rotation; ``run()`` probes servers out of rotation every
  ``probe_interval_s``: one whose ``/health`` answers 200 (any body: real servers send none) is brought to the
  current weights first (else only resumed), then (given the ``model``) must answer a 2-token generate
  request that parses, each call within PROBE_TIMEOUT_S, and only then rejoins. The generate canary keeps
  out a server whose health route answers while its generate route hangs, errs or returns garbage: without
  it such a server would rejoin at once, take its share of new groups and hold them until they time out,
  again and again. A server in rotation that was given work and has not answered (a success or a failure)
  for ``request_timeout_s`` gets the same canary, under ``request_timeout_s``, and leaves rotation if it
  does not answer: a hung server's rollouts do not always time out to say so (steps go on with the other
  servers, and its groups are cancelled as stale first). So a hung server is out within about twice
  ``request_timeout_s`` of its first unanswered request.
  With no server in rotation, ``acquire`` waits (one warning per ``no_server_warn_interval_s`` for the whole
  pool) and resumes when one returns. Every change is logged and counted in ``metrics`` (``evictions``,
  ``rejoins``, ``failed:<kind>``, ``weight_sync_failed``, ``liveness_checks``); ``out_of_rotation()`` says, for
  stall lines, why each server out left and what its last probe found.
- **Weight sync.** ``update_weights(ckpt)`` runs the backend's pause / load / resume (weights.py) on every
  server in rotation at once, each call under ``weight_sync_timeout_s`` and logged every SLOW_CALL_WARN_S
  while it has no answer; after a failed call the resume waits at most RESUME_AFTER_FAILURE_S. So a hung
  server holds one sync (and the new policy, which waits for it) for at most ``weight_sync_timeout_s`` +
  that, then leaves rotation, named in the log; servers out of rotation are synced by the probe before they
  rejoin, so no server serves old weights unnoticed and none is waited for while it is out. No real server
  reports which weights it serves, so ``server.version`` is what the last successful sync loaded, and unknown
  once a server left rotation failing requests after step 0 (it may have restarted on the weights it started
  with): it is synced again before it rejoins.
- **Weights over the wire** (``weight_transfer = "broadcast"``, weights/broadcast.py runs them): a server out of
  rotation whose probe finds it healthy but without the current weights loads them from disk when the trainer
  wrote them there (every K steps); otherwise it waits (``awaiting``), out of rotation, for the next broadcast,
  whose group takes it in. ``syncing(servers)`` holds their sync locks during a broadcast; ``evict`` takes out a
  server whose transfer failed.
- **Servers that come and go** (``inference.discover``, discovery.py): ``add(url)`` puts a new server in the
  pool out of rotation; the probe admits it like any server out of rotation, after ``admit`` (the job's
  preflight for that one server, set by whoever ran the job's preflight) and a weight sync to the target.
  ``remove(url, why)`` takes a server out of rotation and out of the pool at once; rollouts it holds end as
  they end (their failures count against nothing: it is gone).
- **No unloadable checkpoint reaches a server.** With ``check_checkpoints`` (default), ``update_weights``
  first checks the checkpoint's directory (checkpoint_files.py) and refuses one that is missing, holds no
  weight files or a corrupt one (UnloadableCheckpoint) before any call: every server keeps its weights and
  its place in rotation (a real vLLM asked to load such a directory dies at its next forward pass). The probe
  checks the target again before it syncs a server to it (its directory may have been deleted since). The
  same check covers the reload of the saved policy at ``--resume``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.errors import CheckpointError, Failure, InferenceError, UnloadableCheckpoint
from orchestrator.inference.checkpoint_files import why_unloadable
from orchestrator.inference.config import InferenceConfig
from orchestrator.inference.discovery import Resolver, ServerDiscovery, SystemResolver
from orchestrator.inference.replies import parse_generate_reply
from orchestrator.inference.server import HttpInferenceServer, InferenceServer, api_key
from orchestrator.inference.weights import PAUSE_QUERY, resume, weight_sync, weights_dir

log = logging.getLogger(__name__)

SLOW_CALL_WARN_S = 30.0
RESUME_AFTER_FAILURE_S = 30.0  # a resume answers at once on a working server; after a failure it is best effort
PROBE_TIMEOUT_S = 5.0  # each probe call (health, a 2-token generate); at most request_timeout_s
CANARY_PROMPT = [1, 2, 3]  # token ids of the probe's generate request: any model's vocabulary has them
PROBE_CACHE_SALT = "probe"  # the probe's generate requests carry it (tests tell them from rollouts' by it)


def _now() -> float:
    """Every timing rule here reads the running loop's clock (a test's may be virtual: orchestrator.testing.clock)."""
    return asyncio.get_running_loop().time()


@dataclass(eq=False)
class Server:
    """One inference server as the pool sees it: its client and its health, load and weight version."""

    api: InferenceServer
    in_rotation: bool = True
    inflight: int = 0  # rollouts acquired on it
    cap: int | None = None  # rollouts it may have at once (rollouts/concurrency.py); None: no cap of its own
    failures: int = 0  # consecutive
    version: int = 0  # the checkpoint step its last successful sync loaded (0: what it started with; -1: unknown,
    # a weight transfer to it failed part way, or it left rotation failing requests and may have restarted)
    ceiling: int = 0  # the newest weights it may serve: the step of the newest sync begun on it (even one that failed)
    last_error: str = ""
    probe_failures: int = 0  # since it last left rotation
    waiting_since: float | None = None  # given work, and no answer (success or failure) from it since
    answers: int = 0  # successes and failures reported
    checking: bool = False  # a probe or liveness check of it is under way
    sync_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    awaiting: bool = False  # healthy, out of rotation, waiting for a broadcast of the current weights
    out_why: str = ""  # why it last left rotation
    left: int = 0  # times it left rotation (it may have restarted behind any of them: a new engine)
    out_since: float = 0.0  # when (loop time)
    probe_verdict: str = ""  # what its last probe found (the reason it stays out), and when
    probed_at: float | None = None
    admitted: bool = True  # passed the job's preflight (a server added while the job runs: not yet)

    @property
    def url(self) -> str:
        return self.api.url

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more rollouts fit under its cap (an idle server takes any ``n``: one group always runs)."""
        return self.cap is None or self.inflight + n <= self.cap or self.inflight == 0


@dataclass
class WeightSyncResult:
    step: int
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # url -> reason
    phases: dict[str, float] = field(default_factory=dict)  # pause, load, resume: the slowest server's (s)


class InferencePool:
    def __init__(self, cfg: InferenceConfig, servers: Sequence[InferenceServer], model: str | None = None, *,
                 discovery: ServerDiscovery | None = None, connect: Callable[[str], InferenceServer] | None = None
                 ) -> None:
        """``model``: the served model's name, for the probe's generate canary (None: probes check health only).
        ``discovery``: follow a DNS name as the server list (``connect`` makes the client of a server it finds)."""
        if not servers:
            raise ValueError("an inference pool needs at least one server (inference.servers)")
        if (discovery is None) != (connect is None):
            raise ValueError("discovery and connect go together: a server found must be connected to")
        self.cfg = cfg
        self.model = model
        self.servers = [Server(api) for api in servers]
        self.discovery, self._connect = discovery, connect
        # the job's preflight of one server that joins while the job runs (InferenceError naming what is wrong);
        # set by whoever ran the job's preflight (engines.py); None: a new server is admitted on its probe alone
        self.admit: Callable[[InferenceServer], Awaitable[None]] | None = None
        self.weights = weight_sync(cfg.backend)
        self._changed = asyncio.Event()  # rotation, a release or a cap changed: an acquire may succeed now
        self._warned_at = -float("inf")
        self.target = Checkpoint(0)  # the weights every server should serve
        self.metrics: Counter[str] = Counter()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, cfg: InferenceConfig, model: str | None = None, *, resolver: Resolver | None = None
                   ) -> AsyncIterator[InferencePool]:
        """The pool over ``cfg.servers`` over HTTP, with its own session (closed on exit). With
        ``cfg.discover``, also every server its name resolves to (``resolver``, default the system's), waiting for
        the first; ``run()`` then follows the name. A connection per call: vLLM's server ends a connection after an
        error its handlers do not catch (a failed ``collective_rpc``), and a pooled one would fail the next call
        ("Connection reset by peer", "Server disconnected": observed on vLLM 0.31 and 0.32, even with the
        connection marked to close, whose small reply had already given it back)."""
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=True)
        key = api_key(cfg.api_key_env)
        async with aiohttp.ClientSession(connector=connector) as session:
            def connect(url: str) -> InferenceServer:
                return HttpInferenceServer(url, session, key)

            urls, discovery = list(cfg.servers), None
            if cfg.discover is not None:
                discovery = ServerDiscovery(cfg.discover, resolver or SystemResolver(), cfg.discover_interval_s)
                urls += [u for u in await discovery.first() if u not in urls]
            yield cls(cfg, [connect(url) for url in urls], model, discovery=discovery,
                      connect=connect if discovery is not None else None)

    def urls(self) -> list[str]:
        """Every server's URL, in rotation or not."""
        return [s.url for s in self.servers]

    def add(self, url: str) -> Server:
        """A server found while the job runs: in the pool, out of rotation until its probe admits it."""
        assert self._connect is not None  # only discovery adds servers
        server = Server(self._connect(url), in_rotation=False, admitted=False, out_why="new: not admitted yet",
                        out_since=_now())
        self.servers.append(server)
        self.metrics["servers_added"] += 1
        log.info("inference server %s found (inference.discover); it joins rotation after preflight and a weight sync",
                 url)
        return server

    def remove(self, url: str, why: str) -> None:
        """``url`` is gone: out of rotation and out of the pool now (rollouts it holds end as they end)."""
        for server in self.servers:
            if server.url == url:
                self._set_rotation(server, False, f"gone: {why}")
                self.servers.remove(server)
                self.metrics["servers_removed"] += 1
                if server.admitted:
                    log.info("inference server %s removed from the pool (%s)", url, why)
                self._changed.set()
                return

    # ------------------------------------------------------------------------------- choice and pinning

    def take(self, n: int = 1) -> Server | None:
        """The least-loaded server in rotation with room for ``n`` rollouts under its cap, with ``n`` rollouts
        counted on it until ``release(server, n)``; None when none is in rotation or none has room. An idle server
        has room for any ``n``: a cap below a group's size still lets one group run."""
        room = [s for s in self.servers if s.in_rotation and s.has_room(n)]
        if not room:
            return None
        server = min(room, key=lambda s: s.inflight)
        server.inflight += n
        if server.waiting_since is None:
            server.waiting_since = _now()
        return server

    async def wait_room(self) -> None:
        """Wait until a server may have room: one rejoins rotation, a release, a cap change; at most
        ``no_server_warn_interval_s``, warning (at that interval) while no server is in rotation."""
        if not any(s.in_rotation for s in self.servers):
            self._warn_no_server()
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.cfg.no_server_warn_interval_s):  # wait_for can lose a cancel
                await self._changed.wait()

    def capped_out(self, n: int) -> bool:
        """Whether servers are in rotation and every one is at its cap for ``n`` more rollouts."""
        live = [s for s in self.servers if s.in_rotation]
        return bool(live) and not any(s.has_room(n) for s in live)

    def release(self, server: Server, n: int = 1) -> None:
        server.inflight -= n
        self._changed.set()

    def set_cap(self, server: Server, cap: int | None) -> None:
        """``server`` may have ``cap`` rollouts at once from now (None: no cap of its own)."""
        if cap != server.cap:
            server.cap = cap
            self._changed.set()

    def capped(self, n: int) -> str:
        """The servers whose caps hold back a group of ``n`` now (every one in rotation without room), for a
        stall line; "" if none."""
        if not self.capped_out(n):
            return ""
        return ", ".join(f"{s.url} at its cap of {s.cap}" for s in self.servers if s.in_rotation)

    def _warn_no_server(self) -> None:
        now = _now()
        if now - self._warned_at < self.cfg.no_server_warn_interval_s:
            return
        self._warned_at = now
        self.metrics["no_server_waits"] += 1
        log.warning("no inference server in rotation (%d out: %s); work waits until one returns",
                    len(self.servers), self.out_of_rotation())

    # ------------------------------------------------------------------------------------------ health

    def report_success(self, server: Server) -> None:
        server.failures = 0
        server.waiting_since = None
        server.answers += 1

    def report_failure(self, server: Server, kind: Failure, detail: str, *, evict: bool = False) -> None:
        """Count a failed request; evict the server after ``failures_to_evict`` in a row (or now: ``evict``)."""
        server.waiting_since = None  # an answer, of a kind (a timeout is the pool's own verdict)
        server.answers += 1
        server.failures += 1
        server.last_error = f"{kind}: {detail}"
        self.metrics[f"failed:{kind}"] += 1
        if server.in_rotation and (evict or server.failures >= self.cfg.failures_to_evict):
            self._set_rotation(server, False, f"{server.failures} failure(s) in a row, last: {server.last_error}")
            if self.target.step > 0:
                # it may have restarted on the weights it started with (a test's sim did, and rejoined labelled
                # with the step it had before, and the next broadcast failed on its new engine): synced again
                # before it rejoins. At step 0 a restart holds the target's weights.
                server.version = -1

    def evict(self, server: Server, why: str) -> None:
        """A weight sync to ``server`` failed (``why``): out of rotation now, counted."""
        self.metrics["weight_sync_failed"] += 1
        server.last_error = why
        if not server.in_rotation:
            server.out_why = why
        self._set_rotation(server, False, why)

    def awaiting(self) -> list[Server]:
        """Servers out of rotation that wait for a broadcast of the current weights."""
        return [s for s in self.servers if s.awaiting and not s.in_rotation]

    def _set_rotation(self, server: Server, on: bool, why: str) -> None:
        if server.in_rotation == on:
            return
        server.in_rotation = on
        server.probe_failures = 0
        server.waiting_since = None
        self.metrics["rejoins" if on else "evictions"] += 1
        if on:
            server.failures = 0
            log.info("inference server %s rejoins rotation (%s)", server.url, why)
        else:
            server.out_why, server.out_since, server.probe_verdict, server.probed_at = why, _now(), "", None
            server.left += 1
            log.warning("inference server %s leaves rotation: %s", server.url, why)
        self._changed.set()

    async def run(self) -> None:
        """Every ``probe_interval_s``: probe each server out of rotation, and check each one in rotation that
        has been waited on too long; consumes nothing, produces rejoins and evictions.

        Waits on a timer only. A server whose ``/health`` answers 200 is synced to the target weights (unless
        it holds them already), passes the generate canary (with a ``model``), then rejoins. A server in
        rotation given work ``request_timeout_s`` ago with no answer since gets a liveness check (with a
        ``model``). Each server has at most one check running, as a task owned here. Runs until cancelled
        (owned by the caller's TaskGroup)."""
        async with asyncio.TaskGroup() as tg:
            if self.discovery is not None:
                tg.create_task(self.discovery.run(self))
            while True:
                await asyncio.sleep(self.cfg.probe_interval_s)
                now = _now()
                for server in self.servers:
                    if server.checking:
                        continue
                    if not server.in_rotation:
                        check = self._probe(server)
                    elif (self.model is not None and server.waiting_since is not None and not server.sync_lock.locked()
                          and now - server.waiting_since >= self.cfg.request_timeout_s):
                        check = self._check_live(server)
                    else:
                        continue
                    server.checking = True
                    tg.create_task(self._checking(server, check))

    async def _checking(self, server: Server, check: Awaitable[None]) -> None:
        try:
            await check
        finally:
            server.checking = False

    async def _check_live(self, server: Server) -> None:
        """A server in rotation whose work has waited ``request_timeout_s`` with no answer must answer the
        canary within ``request_timeout_s`` too, or leave rotation now. Rollouts on a hung server do not always
        time out to say so: cancelled as stale (steps run on with the other servers) or with their group,
        they never answer, and the server would keep taking its share of new groups."""
        assert server.waiting_since is not None
        waited, answers = _now() - server.waiting_since, server.answers
        self.metrics["liveness_checks"] += 1
        try:
            await self._canary(server, self.cfg.request_timeout_s)
        except InferenceError as e:
            if server.answers == answers and server.in_rotation:  # nothing answered meanwhile
                self.report_failure(server, e.kind, f"its work waited {waited:.0f} s with no answer, and {e}",
                                    evict=True)
            return
        server.waiting_since = _now() if server.inflight else None  # alive: long rollouts

    async def _canary(self, server: Server, timeout_s: float) -> None:
        """A 2-token generate request that must answer and parse within ``timeout_s`` (InferenceError else)."""
        body = {"model": self.model, "token_ids": CANARY_PROMPT, "cache_salt": PROBE_CACHE_SALT,
                "sampling_params": {"max_tokens": 2, "logprobs": 1, "temperature": 1.0}}
        raw = await self.timed(server.api.request("POST", "/inference/v1/generate", body=body),
                                f"a 2-token generate request to {server.url}", timeout_s)
        parse_generate_reply(raw, len(CANARY_PROMPT))

    async def _probe(self, server: Server) -> None:
        """Health, weights, canary (the ``run`` docstring); the first failure ends the probe, logged once per
        eviction (then at debug level: a server may stay out for hours)."""
        timeout_s = min(self.cfg.request_timeout_s, PROBE_TIMEOUT_S)
        try:
            await self.timed(server.api.request("GET", "/health"), f"/health of {server.url}", timeout_s)
            if not server.admitted:
                if self.admit is not None:
                    await self.admit(server.api)
                server.admitted = True
            if server.version == self.target.step:
                # resumed: a pause may have reached it after the resume of a failed sync (e.g. it was stopped);
                # labelled: it may have restarted, and an engine starts as "default"
                async with server.sync_lock:
                    def timed(call: Awaitable[bytes], what: str, **_: bool) -> Awaitable[bytes]:
                        return self.timed(call, what, timeout_s)
                    await resume(server.api, timed)
                    await self.weights.label(server.api, server.version, timed)
            while True:
                while server.version != self.target.step:  # newer weights may be announced while it loads
                    if not await self._on_disk(server):
                        return  # it waits for the next broadcast, out of rotation
                    await self._sync_one(server, self.target)  # ends with a resume
                if self.model is not None:
                    await self._canary(server, timeout_s)
                # a sync that began during the canary left it out (not in rotation then): sync it first
                if server.version == self.target.step:
                    break
            self._set_rotation(server, True, f"healthy on probe, weights of step {server.version}")
        except (InferenceError, CheckpointError) as e:
            server.last_error = str(e)
            server.awaiting = False  # not healthy: no broadcast waits for it
            # INFO when the reason is new (the first failure, or another cause than the last one's), else DEBUG:
            # a server may stay out for hours; the stall lines repeat the last verdict (out_of_rotation)
            level = logging.INFO if str(e) != server.probe_verdict else logging.DEBUG
            server.probe_failures += 1
            server.probe_verdict, server.probed_at = str(e), _now()
            log.log(level, "inference server %s stays out of rotation: %s", server.url, e)

    async def _on_disk(self, server: Server) -> bool:
        """Whether the target's weights load from disk (checked when announced; they may have been deleted
        since). With weights over the wire they often are not (the trainer writes a checkpoint every K steps):
        then ``server`` waits for the next broadcast (``awaiting``) and False; otherwise the CheckpointError."""
        try:
            await self.loadable(self.target)
        except CheckpointError as e:
            if self.cfg.weight_transfer != "broadcast":
                raise
            if not server.awaiting:
                log.info("inference server %s is healthy and waits, out of rotation, for the next broadcast to bring "
                         "it the weights of step %d (not on disk: %s)", server.url, self.target.step, e)
            server.awaiting = True
            server.probe_verdict = f"healthy, waiting for a broadcast of the weights of step {self.target.step}"
            server.probed_at = _now()
            return False
        return True

    def out_of_rotation(self) -> str:
        """The servers out of rotation, in a clause for a stall line: why each left, and its last probe's
        verdict (a probe that keeps failing says why here, not once an hour in the log)."""
        now = _now()
        parts = []
        for s in self.servers:
            if s.in_rotation:
                continue
            if s.probed_at is None:  # a check started while it was in rotation may still hold it
                probe = "no probe has finished yet" + (" (a check is under way)" if s.checking else "")
            else:
                probe = f"its last probe ({s.probe_failures} failed) {now - s.probed_at:.0f} s ago: {s.probe_verdict}"
            parts.append(f"{s.url} out for {now - s.out_since:.0f} s ({s.out_why}); {probe}")
        return "; ".join(parts)

    async def timed(self, call: Awaitable[bytes], what: str, timeout_s: float | None = None, *,
                    after_failure: bool = False) -> bytes:
        """``call`` under ``timeout_s`` (default ``weight_sync_timeout_s``; ``after_failure``: at most
        RESUME_AFTER_FAILURE_S), logging every SLOW_CALL_WARN_S while it has no answer: a hung server holds a
        weight sync, and the job, for at most the timeout."""
        if timeout_s is None:
            timeout_s = self.cfg.weight_sync_timeout_s
            if after_failure:
                timeout_s = min(timeout_s, RESUME_AFTER_FAILURE_S)
        # the call runs in this task (no task of its own to outlive the wait); a timer only logs while it waits
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        warning: asyncio.TimerHandle

        def still_waiting() -> None:
            nonlocal warning
            log.warning("%s: no answer after %.0f s (gives up after %.0f s)", what, loop.time() - t0, timeout_s)
            warning = loop.call_later(SLOW_CALL_WARN_S, still_waiting)

        warning = loop.call_later(SLOW_CALL_WARN_S, still_waiting)
        try:
            async with asyncio.timeout(timeout_s) as limit:
                return await call
        except TimeoutError:
            if limit.expired():  # ours, not a TimeoutError the call raised itself
                raise InferenceError(f"{what} took more than {timeout_s:g} s", Failure.TIMEOUT) from None
            raise
        finally:
            warning.cancel()

    # ------------------------------------------------------------------------------------- weight sync

    async def update_weights(self, ckpt: Checkpoint) -> WeightSyncResult:
        """Pause, load ``ckpt``'s weights and resume on every server in rotation at once.

        A server that fails any call leaves rotation (and is counted in ``failed``); the probe in ``run()``
        syncs it and brings it back. A server out of rotation is not waited for: the probe syncs it to the
        newest weights before it rejoins, so a hung server holds one sync, not every sync while it hangs.
        CheckpointError when there is no path for the weights; UnloadableCheckpoint (``check_checkpoints``)
        when its directory cannot be loaded: then no server is called, every one keeps its weights and its
        place in rotation, and the target stays the last good checkpoint."""
        await self.loadable(ckpt)  # before any server is paused: a bad load kills a real vLLM's engine
        self.target = ckpt
        result = WeightSyncResult(ckpt.step)
        live = [s for s in self.servers if s.in_rotation]
        phases: list[dict[str, float]] = [{} for _ in live]
        outcomes = await asyncio.gather(*(self._sync_one(s, ckpt, p) for s, p in zip(live, phases, strict=True)),
                                        return_exceptions=True)
        result.phases = {k: max(p.get(k, 0.0) for p in phases) for k in ("pause", "load", "resume")}
        for server, outcome in zip(live, outcomes, strict=True):
            if isinstance(outcome, InferenceError):
                result.failed[server.url] = str(outcome)
                self.metrics["weight_sync_failed"] += 1
                server.last_error = f"weight sync to step {ckpt.step} failed: {outcome}"
                self._set_rotation(server, False, server.last_error)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                result.updated.append(server.url)
        if result.failed:
            log.warning("weight sync to step %d failed on %d of %d servers: %s", ckpt.step, len(result.failed),
                        len(self.servers), result.failed)
        return result

    async def pause(self, server: Server) -> None:
        """Pause ``server`` in keep mode (its in-flight requests freeze), within ``weight_sync_timeout_s``."""
        await self.timed(server.api.request("POST", "/pause", query=PAUSE_QUERY), f"pause on {server.url}")

    async def resume(self, server: Server, *, after_failure: bool = False) -> None:
        await resume(server.api, self.timed, after_failure=after_failure)

    @contextlib.asynccontextmanager
    async def syncing(self, servers: Iterable[Server]) -> AsyncIterator[None]:
        """Hold the sync locks of ``servers`` (in a fixed order) while they take new weights together; the time
        their requests were frozen does not count as waiting for an answer."""
        ordered = sorted(servers, key=lambda s: s.url)
        async with contextlib.AsyncExitStack() as stack:
            for server in ordered:
                await stack.enter_async_context(server.sync_lock)
            t0 = _now()
            try:
                yield
            finally:
                for server in ordered:
                    if server.waiting_since is not None:
                        server.waiting_since = min(_now(), server.waiting_since + _now() - t0)

    async def label(self) -> None:
        """Label the weights of every server in rotation as the target's step (weights.py ``label``): at the start
        of a run that loads none, so replies name that step, not the engine's "default". A server that fails it
        leaves rotation (and is labelled before it rejoins)."""
        live = [s for s in self.servers if s.in_rotation]
        outcomes = await asyncio.gather(*(self.weights.label(s.api, self.target.step, self.timed) for s in live),
                                        return_exceptions=True)
        for server, outcome in zip(live, outcomes, strict=True):
            if isinstance(outcome, InferenceError):
                self._set_rotation(server, False, f"labelling its weights as step {self.target.step} failed: {outcome}")
            elif isinstance(outcome, BaseException):
                raise outcome

    async def loadable(self, ckpt: Checkpoint) -> str:
        """The directory of ``ckpt``'s weights; CheckpointError without one, UnloadableCheckpoint when
        ``check_checkpoints`` finds it cannot be loaded (checkpoint_files.py, in a worker thread)."""
        path = weights_dir(ckpt, self.cfg.weights_path)
        if self.cfg.check_checkpoints:
            why = await asyncio.to_thread(why_unloadable, path)
            if why is not None:
                self.metrics["checkpoints_refused"] += 1
                raise UnloadableCheckpoint(ckpt.step, path, why)
        return path

    async def _sync_one(self, server: Server, ckpt: Checkpoint, phases: dict[str, float] | None = None) -> None:
        """The backend's pause / load / resume; one sync per server at a time; logged when slow."""
        path = weights_dir(ckpt, self.cfg.weights_path)
        async with server.sync_lock:
            t0 = _now()
            server.ceiling = max(server.ceiling, ckpt.step)  # before the pause: tokens of it may come from now on
            try:
                await self.weights.sync(server.api, ckpt, path, self.timed, phases)
            finally:
                if server.waiting_since is not None:  # the pause froze its requests: that time is not waiting
                    server.waiting_since = min(_now(), server.waiting_since + _now() - t0)
            server.version = ckpt.step
            server.awaiting = False
            log.debug("%s loaded step %d from %s in %.1f s", server.url, ckpt.step, path, _now() - t0)
