"""Weights over the wire: the trainer broadcasts each new checkpoint to every inference server at once, the
orchestrator forming the group and running each update (``[inference] weight_transfer = "broadcast"``;
docs/inference-servers.md, "Weights over the wire").

``BroadcastSync(pool, channel, cfg).update(ckpt, servers)`` puts checkpoint ``ckpt`` on ``servers``:

1. **The group.** Formed again when its members, their world sizes or the trainer differ from the group formed
   last, a member left rotation since (it may have restarted: a new engine is in no group), or its last update
   failed. Each member's ranks (``GET /get_world_size``) follow the trainer's (rank 0):
   ``rank_offset = 1 + the world sizes of the members before it``. The trainer is told to join (``JoinGroup``
   over the trainer link): it serves the rendezvous and answers ``listening`` with its port; then every
   member's ``/init_weight_transfer_engine`` and the trainer's ``joined`` (with the tensors it sends) complete
   together, within ``timeout_s`` (gloo bounds the rendezvous on every rank).
2. **The trainer first.** It is asked for the weights of ``ckpt.step`` (``SendWeights``) and answers ``ready``
   (then broadcasts at once) or ``stale`` (it holds newer weights: nothing else happens, the newer announcement
   follows), within ``trainer_timeout_s``. No server is paused before it answers.
3. **Every member at once**, each phase timed: ``pause`` (keep: in-flight requests freeze) -> ``start`` ->
   ``transfer`` (``/update_weights`` on every member while the trainer broadcasts; gloo bounds each chunk by
   ``timeout_s`` on every rank) -> ``finish`` (the step as the weight version) -> ``resume``.

A member that fails any call leaves rotation named in the log, and stays paused with its version unknown: its
weights are partly updated (transfer/vllm_engine.py), its frozen requests must not go on under them. The pool's
probe loads the current weights from disk when the trainer wrote them there (every K steps), else the server
waits for the next broadcast, whose group takes it in; only then is it resumed, and it rejoins. A failed
collective fails every member (a rank that never comes holds the others until the timeout): they all leave and
come back by the next broadcast (the sync loop retries every ``retry_s``). A trainer whose link is gone when the
transfer failed on every member died mid-broadcast: ``TransferError``, the run ends, and ``close`` resumes every
server left paused (no server stays paused; their weights are partly updated and a run that goes on from here
loads a checkpoint first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.contracts.transfer import JoinGroup, Params, SendWeights, TransferEvent, TransferRequest
from orchestrator.delivery.seat import Peer
from orchestrator.errors import InferenceError, TransferError
from orchestrator.inference import transfer
from orchestrator.inference.config import BroadcastConfig
from orchestrator.inference.pool import InferencePool, Server
from orchestrator.inference.server import HttpStatusError

log = logging.getLogger(__name__)

LINK_POLL_S = 0.5  # while waiting for the trainer, its link is checked this often (a dead trainer is named)
MARGIN_S = 10.0  # on top of a bound the trainer's and the servers' side keep themselves (gloo's timeout_s)
PHASES = ("pause", "start", "transfer", "finish", "resume")


class TrainerChannel(Protocol):
    """What a broadcast needs of the trainer link (``BatchSender``, delivery/zmq_link.py)."""

    def broadcast_offer(self) -> tuple[Peer, tuple[str, ...]] | None: ...

    def tell_transfer(self, request: TransferRequest) -> bool: ...

    async def transfer_event(self) -> tuple[bytes, TransferEvent]: ...

    def trainer_connected(self) -> bool: ...


class NotNow(Exception):
    """No broadcast can be asked for now (no trainer, one that cannot send with the backend, or one that does not
    answer): ``str()`` says; ``fallback``: the trainer does not broadcast at all (its checkpoints load from disk)."""

    def __init__(self, why: str, *, fallback: bool = False) -> None:
        super().__init__(why)
        self.fallback = fallback


class Stale(Exception):
    """The trainer holds newer weights than those asked for (``holds``): nothing was sent."""

    def __init__(self, holds: int | None) -> None:
        super().__init__(f"the trainer holds the weights of step {holds}")
        self.holds = holds


class Failed(Exception):
    """The broadcast did not reach any server (the group did not form, or every member failed); retried.
    ``report``: how far it got (its phases, who failed), for metrics."""

    def __init__(self, why: str, report: SyncReport | None = None) -> None:
        super().__init__(why)
        self.report = report


@dataclass
class Group:
    name: str
    trainer: bytes
    sizes: dict[str, int]  # member url -> world size, in rank order
    params: Params
    left: dict[str, int]  # member url -> how often it had left rotation when the group formed (Server.left)


@dataclass
class SyncReport:
    """One sync, for metrics.jsonl: phases' wall times (s), who got the weights and who did not."""

    step: int
    mode: str
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    formed: bool = False  # a group was formed for it (broadcast)

    def row(self) -> dict[str, object]:
        return {"step": self.step, "mode": self.mode, "servers": len(self.updated), "failed": len(self.failed),
                "total_s": round(self.total_s, 4), **{f"{k}_s": round(v, 4) for k, v in self.phases.items()},
                **({"formed": True} if self.formed else {})}


class BroadcastSync:
    def __init__(self, pool: InferencePool, channel: TrainerChannel, cfg: BroadcastConfig) -> None:
        self.pool = pool
        self.channel = channel
        self.cfg = cfg
        self.group: Group | None = None
        self.formed = 0
        self.run_id = uuid.uuid4().hex[:8]  # group names of this run: a trainer never confuses an old one's
        self.left_paused: set[Server] = set()

    def offered(self) -> Peer:
        """The trainer to ask; NotNow when there is none, or it does not send with the configured backend."""
        offer = self.channel.broadcast_offer()
        if offer is None:
            raise NotNow("no trainer is connected to send its weights")
        peer, backends = offer
        if self.cfg.backend not in backends:
            raise NotNow(f"trainer {peer.name} does not send weights with {self.cfg.backend} (it offers "
                         f"{list(backends) or 'none'}: start it with --broadcast, or give its receiver a "
                         "WeightBroadcaster)", fallback=True)
        return peer

    async def update(self, ckpt: Checkpoint, servers: Sequence[Server]) -> SyncReport:
        """Checkpoint ``ckpt`` onto ``servers`` (the module docstring); NotNow, Stale, Failed (nothing reached a
        server), TransferError (the trainer died)."""
        t0 = time.monotonic()
        peer = self.offered()
        report = SyncReport(ckpt.step, "broadcast")
        try:
            return await self._update(peer, ckpt, servers, report)
        except Failed as e:
            e.report = report
            raise
        finally:
            report.total_s = time.monotonic() - t0

    async def _update(self, peer: Peer, ckpt: Checkpoint, servers: Sequence[Server], report: SyncReport
                      ) -> SyncReport:
        if self._reform(peer, servers):
            t = time.monotonic()
            await self._form(peer, servers, report)
            report.phases["form"] = time.monotonic() - t
        group = self.group
        assert group is not None
        members = [s for s in self.pool.servers if s.url in group.sizes]
        t = time.monotonic()
        event = await self._ask(peer, SendWeights(group=group.name, step=ckpt.step, params=group.params,
                                                  buffer_bytes=self.cfg.buffer_mb << 20), ("ready", "stale", "failed"))
        report.phases["ask"] = time.monotonic() - t
        if event.event == "stale":
            raise Stale(event.holds)
        if event.event == "failed":
            self.group = None
            raise Failed(f"the trainer could not start the broadcast of step {ckpt.step}: {event.why}")
        # once the trainer broadcasts, the update runs to its end (each call under its timeout) even when the loop
        # is cancelled (the run ends): stopped between start and finish, a server's layers would stay on the meta
        # device and its next forward pass would crash its engine
        running = asyncio.ensure_future(self._locked(peer, ckpt.step, members, report))
        try:
            await asyncio.shield(running)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await running
            raise
        return report

    async def _locked(self, peer: Peer, step: int, members: list[Server], report: SyncReport) -> None:
        async with self.pool.syncing(members):  # no probe syncs them from disk meanwhile
            await self._run(peer, step, members, report)

    # ------------------------------------------------------------------------------------------- the group

    def _reform(self, peer: Peer, servers: Sequence[Server]) -> bool:
        g = self.group
        # a member that left rotation since may have restarted: its new engine is in no group (a restarted server
        # rejoined by a load from disk, and the next broadcast failed on every member)
        return (g is None or g.trainer != peer.id or list(g.sizes) != [s.url for s in servers]
                or any(g.left[s.url] != s.left for s in servers))

    async def _form(self, peer: Peer, servers: Sequence[Server], report: SyncReport) -> None:
        self.group = None
        report.formed = True
        sizes: dict[str, int] = {}
        got_sizes = await asyncio.gather(*(transfer.world_size(s.api, self.pool.timed) for s in servers),
                                         return_exceptions=True)
        for s, got in zip(servers, got_sizes, strict=True):
            if isinstance(got, InferenceError):
                self._drop(s, f"GET /get_world_size failed: {got}", report)
            elif isinstance(got, BaseException):
                raise got
            else:
                sizes[s.url] = got
        if not sizes:
            raise Failed("no server to form a group with")
        self.formed += 1
        name = f"{self.run_id}-{self.formed}"
        world = 1 + sum(sizes.values())
        c = self.cfg
        ask = JoinGroup(group=name, backend=c.backend, master_address=c.master_address, master_port=c.master_port,
                        world_size=world, timeout_s=c.timeout_s)
        listening = await self._ask(peer, ask, ("listening", "failed"))
        if listening.event == "failed" or listening.port is None:
            raise Failed(f"the trainer could not serve the rendezvous: {listening.why}")
        members = [s for s in servers if s.url in sizes]
        offsets = [1 + sum(list(sizes.values())[:i]) for i in range(len(members))]
        info = {s.url: transfer.init_info(c.backend, master_address=c.master_address, master_port=listening.port,
                                          rank_offset=off, world_size=world, group=name, timeout_s=c.timeout_s,
                                          buffer_bytes=c.buffer_mb << 20)
                for s, off in zip(members, offsets, strict=True)}
        bound = c.timeout_s + MARGIN_S
        joined, *inits = await asyncio.gather(
            self._answer(peer, name, None, ("joined", "failed"), bound),
            *(self.pool.timed(s.api.request("POST", "/init_weight_transfer_engine", body={"init_info": info[s.url]}),
                              f"init_weight_transfer_engine on {s.url}", bound) for s in members),
            return_exceptions=True)
        failed = [(s, e) for s, e in zip(members, inits, strict=True) if isinstance(e, BaseException)]
        for s, e in failed:
            if not isinstance(e, InferenceError):
                raise e
            if not isinstance(e, HttpStatusError):  # down or hung; a 500 is its engine's rendezvous, failed by any rank
                self._drop(s, f"did not answer its init of weight transfer group {name}: {e}", report)
        if not isinstance(joined, TransferEvent) or joined.event != "joined" or joined.params is None or failed:
            why = (joined.why if isinstance(joined, TransferEvent) else str(joined)) or "no tensors"
            raise Failed(f"weight transfer group {name} did not form within {c.timeout_s:g} s: the trainer: {why}; "
                         f"the servers: {[str(e) for _, e in failed] or 'joined'}")
        self.group = Group(name, peer.id, sizes, joined.params, {s.url: s.left for s in members})
        log.info("weight transfer group %s formed: trainer %s and %d server(s), %d ranks, %d tensors (%.1f MB)",
                 name, peer.name, len(members), world, len(joined.params.names), joined.params.nbytes / 2**20)

    # ----------------------------------------------------------------------------------------- an update

    async def _run(self, peer: Peer, step: int, members: list[Server], report: SyncReport) -> None:
        """Pause, start, transfer (with the trainer's broadcast), finish, resume on ``members``; each failure
        takes its server out (``_fail``)."""
        group = self.group
        assert group is not None
        live = list(members)
        for s in live:  # before the pause: tokens of these weights may come from now on
            s.ceiling = max(s.ceiling, step)
        for phase, call in (("pause", self.pool.pause), ("start", self._start)):
            live = await self._phase(phase, live, call, report)
        t = time.monotonic()
        sent = asyncio.ensure_future(self._answer(peer, group.name, step, ("sent", "failed"), None))
        try:
            live = await self._phase("transfer", live, lambda s: transfer.update(s.api, group.params, self.pool.timed),
                                     report, timed=False)
            trainer = await self._trainer_outcome(sent)
        finally:
            sent.cancel()
        report.phases["transfer"] = time.monotonic() - t
        live = await self._phase("finish", live, lambda s: transfer.finish(s.api, step, self.pool.timed), report)
        for s in live:
            s.version = step
            s.awaiting = False
        live = await self._phase("resume", live, self.pool.resume, report)
        report.updated = [s.url for s in live]
        said = "its link went: it died" if trainer is None else trainer or "it sent them"
        if report.failed:
            self.group = None  # a member is gone or its engine failed: the next update forms a new group
            log.warning("weight transfer of step %d failed on %d server(s), reached %d (the trainer: %s): %s", step,
                        len(report.failed), len(live), said, report.failed)
        if not live:
            if trainer is None:
                raise TransferError(f"the trainer {peer.name} died during the broadcast of step {step}: every "
                                    f"server's transfer failed ({next(iter(report.failed.values()), '')}); their "
                                    "weights are partly updated: restart the trainer from its newest checkpoint, "
                                    "then this run with --resume, which goes back to the newest checkpoint on "
                                    "disk (restart the servers if none was written)")
            raise Failed(f"the broadcast of step {step} reached no server (the trainer: {said})")

    async def _start(self, s: Server) -> None:
        await transfer.start(s.api, self.pool.timed)

    async def _phase(self, name: str, servers: list[Server], call: Callable[[Server], Awaitable[None]],
                     report: SyncReport, *, timed: bool = True) -> list[Server]:
        """``call`` on every server at once; the ones that succeeded (the others leave rotation)."""
        t = time.monotonic()
        outcomes = await asyncio.gather(*(call(s) for s in servers), return_exceptions=True)
        if timed:
            report.phases[name] = time.monotonic() - t
        ok = []
        for s, outcome in zip(servers, outcomes, strict=True):
            if isinstance(outcome, InferenceError):
                self._fail(s, f"{name} failed: {outcome}", report)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                ok.append(s)
        return ok

    async def _trainer_outcome(self, sent: asyncio.Future[TransferEvent]) -> str | None:
        """The trainer's side, once the servers' transfers ended: "" (it sent), what went wrong, or None when its
        link went: it died. It answers within gloo's bound on its side (a rank that never came fails it too)."""
        try:
            async with asyncio.timeout(self.cfg.timeout_s + MARGIN_S):
                event = await sent
        except TimeoutError:
            return f"no answer within {self.cfg.timeout_s + MARGIN_S:g} s"
        except NotNow:
            return None
        return "" if event.event == "sent" else f"it failed: {event.why}"

    def _drop(self, server: Server, why: str, report: SyncReport) -> None:
        """``server`` failed while a group formed (nothing was paused, its weights are intact): out of rotation
        until its probe finds it healthy."""
        report.failed[server.url] = why
        self.pool.evict(server, f"weight transfer group for step {report.step}: {why}")

    def _fail(self, server: Server, why: str, report: SyncReport) -> None:
        """``server`` failed during a weight transfer: out of rotation, version unknown, left paused (resumed
        by the sync that brings it the current weights, or by ``close``)."""
        report.failed[server.url] = why
        server.version = -1
        server.awaiting = False
        self.left_paused.add(server)
        self.pool.evict(server, f"weight transfer of step {report.step} failed: {why}")

    # ------------------------------------------------------------------------------------------ the trainer

    async def _ask(self, peer: Peer, request: TransferRequest, wanted: tuple[str, ...]) -> TransferEvent:
        """Send ``request`` to the trainer and wait for its answer (one of ``wanted``), ``trainer_timeout_s``."""
        if not self.channel.tell_transfer(request):
            raise NotNow(f"trainer {peer.name} is not connected")
        step = request.step if isinstance(request, SendWeights) else None
        return await self._answer(peer, request.group, step, wanted, self.cfg.trainer_timeout_s)

    async def _answer(self, peer: Peer, group: str, step: int | None, wanted: tuple[str, ...],
                      timeout_s: float | None) -> TransferEvent:
        """The trainer's next answer about ``group`` (and ``step``) among ``wanted``; answers to other requests
        are dropped. NotNow when its link goes or the timeout passes."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            wait = LINK_POLL_S if deadline is None else min(LINK_POLL_S, deadline - loop.time())
            if wait <= 0:
                raise NotNow(f"trainer {peer.name} did not answer within {timeout_s:g} s")
            try:
                async with asyncio.timeout(wait):
                    who, event = await self.channel.transfer_event()
            except TimeoutError:
                if not self.channel.trainer_connected():
                    raise NotNow(f"trainer {peer.name}'s link is gone") from None
                continue
            if who == peer.id and event.group == group and event.event in wanted and (
                    step is None or event.step == step):
                return event
            log.debug("ignored a weight transfer answer %s of group %s step %s", event.event, event.group,
                      event.step)

    async def close(self) -> None:
        """Resume every server a failed transfer left paused (best effort, each within the pool's resume bound)."""
        paused, self.left_paused = list(self.left_paused), set()
        for s in paused:
            with contextlib.suppress(InferenceError):
                await self.pool.resume(s, after_failure=True)
        if paused:
            log.warning("resumed %d server(s) a failed weight transfer had left paused, with partly updated "
                        "weights: %s", len(paused), [s.url for s in paused])
