"""The weight sync loop: checkpoint announcements in; the new weights on every inference server, then a new policy.

``WeightSyncLoop(pool, sched, state, cfg.inference).run(sender.announcements(marker))`` runs for the whole job
(owned by the orchestrator's TaskGroup). Announcements go into a ``CheckpointFeed``, so a sync that falls behind
loads the newest checkpoint next, never a backlog. Each sync waits for an evaluation round that holds weights,
then ``pool.update_weights``: pause, load, resume on every server in rotation; the servers' policy changes only
after that (``sched.set_policy``).

A checkpoint the pool refuses as unloadable (``inference.check_checkpoints``: its directory is missing, holds no
weight files or a corrupt one) reaches no server: they keep their weights and stay in rotation. The refusal is
logged once as an ERROR naming the step, the path and why, and a step that waits for a newer policy names it in
its stall line. The refused checkpoint is checked again every RECHECK_S (a trainer or a shared filesystem
may complete it late) until a newer one is announced. If no checkpoint has loaded ``unloadable_checkpoint_s``
after the first refusal, the run stops: CheckpointError, exit status 1, naming the checkpoint, path and why. A
checkpoint that loads (a newer one, or the refused one mended) cancels that clock.

With weights over the wire (``weight_transfer = "broadcast"``, given the trainer ``channel``), each sync is a
broadcast from the trainer (``BroadcastSync``, broadcast.py) to every server in rotation and every one waiting
for the current weights; no directory is checked or loaded. A trainer that does not offer broadcasts gets its
checkpoints loaded from disk when they have a path (a WARNING once), else the sync waits for one that does. A
broadcast that reached no server (the group did not form, every transfer failed) or servers still waiting for the
current weights (they joined late or came back, and the weights are not on disk) get another broadcast every
``retry_s``: of the newest announced checkpoint, or of the current one again (the trainer answers ``stale`` if it
holds newer weights, whose announcement then drives the next sync). A trainer that died mid-broadcast ends the
run (TransferError); on the way out the servers it left paused are resumed.

Every sync's phases (pause, load or start/transfer/finish, resume; and for a broadcast the trainer's answer and
the group's formation) go into ``reports``, which the step's metrics take (``take_reports``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from orchestrator.contracts.checkpoints import Checkpoint, CheckpointFeed
from orchestrator.errors import CheckpointError, UnloadableCheckpoint
from orchestrator.inference.config import InferenceConfig
from orchestrator.inference.pool import InferencePool, Server
from orchestrator.rollouts.scheduler import Scheduler
from orchestrator.state import OrchestratorState
from orchestrator.weights.broadcast import BroadcastSync, Failed, NotNow, Stale, SyncReport, TrainerChannel

log = logging.getLogger(__name__)

RECHECK_S = 5.0  # a refused checkpoint is checked again this often (a stat, or a few headers: cheap)
MAX_REPORTS = 64  # sync reports kept for the next step's metrics (one or two a step; more: a step that waits)


class WeightSyncLoop:
    def __init__(self, pool: InferencePool, sched: Scheduler, state: OrchestratorState, cfg: InferenceConfig, *,
                 channel: TrainerChannel | None = None) -> None:
        self.pool = pool
        self.sched = sched
        self.state = state
        self.bound_s = cfg.unloadable_checkpoint_s
        self.feed = CheckpointFeed()
        self.tried = -1  # the newest announced step taken from the feed
        self.refused: tuple[Checkpoint, UnloadableCheckpoint] | None = None  # the newest refused, until one loads
        self.since: float | None = None  # the first refusal since a checkpoint last loaded
        broadcast = cfg.weight_transfer == "broadcast" and channel is not None
        self.broadcast = BroadcastSync(pool, channel, cfg.broadcast) if broadcast and channel is not None else None
        self.retry_s = cfg.broadcast.retry_s
        self.retry: Checkpoint | None = None  # a broadcast to try again (it reached no server, or could not start)
        self.reports: list[SyncReport] = []
        self._told: set[str] = set()  # warnings given once

    async def run(self, announcements: AsyncIterator[Checkpoint]) -> None:
        """Consumes ``announcements``; produces weight syncs and policy changes. Waits for a newer announcement
        or, while a checkpoint is refused, its next recheck. Runs until cancelled, or raises CheckpointError when
        no checkpoint loads for ``unloadable_checkpoint_s`` after a refusal."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._read(announcements))
                while True:
                    ckpt = await self._next()
                    refused = self.refused[0].step if self.refused is not None else None
                    catch_up = self.broadcast is not None and ckpt.step == self.pool.target.step
                    if ckpt.step <= self.sched.policy and ckpt.step != refused and not catch_up:
                        continue  # a refused one at resume is retried; so is the current one, for servers waiting
                    await self._sync(ckpt)
        finally:
            if self.broadcast is not None:
                await self.broadcast.close()

    def take_reports(self) -> list[dict[str, object]]:
        """The syncs finished since the last call, as metrics rows."""
        rows, self.reports = [r.row() for r in self.reports], []
        return rows

    async def _read(self, announcements: AsyncIterator[Checkpoint]) -> None:
        async for ckpt in announcements:
            self.feed.offer(ckpt)

    async def _next(self) -> Checkpoint:
        """The newest announced checkpoint not taken yet; while one is refused, that one again every
        RECHECK_S; while a broadcast is to be tried again (or servers wait for the current weights), that one
        (or the current one) every ``retry_s``; CheckpointError at the refusal clock's end."""
        loop = asyncio.get_running_loop()
        while True:
            deadline = None if self.since is None else self.since + self.bound_s
            wait = None if deadline is None else min(RECHECK_S, deadline - loop.time())
            if wait is not None and wait <= 0:
                raise self._expired()
            if self.broadcast is not None:  # a failed broadcast, or servers that start to wait: seen within retry_s
                wait = self.retry_s if wait is None else min(wait, self.retry_s)
            try:
                async with asyncio.timeout(wait):  # not wait_for: on 3.11 it can swallow a cancel
                    ckpt = await self.feed.newer(self.tried)
            except TimeoutError:
                if self.refused is not None and deadline is not None and loop.time() < deadline:
                    return self.refused[0]
                retry = self._retry()
                if retry is not None:
                    return retry
                continue
            self.tried = ckpt.step
            return ckpt

    def _retry(self) -> Checkpoint | None:
        """What to broadcast again now: a failed one (unless a newer one came), else the current weights while
        servers wait for them; None when nothing is owed."""
        if self.broadcast is None:
            return None
        if self.retry is not None:
            latest = self.feed.latest
            return latest if latest is not None and latest.step > self.retry.step else self.retry
        if self.pool.awaiting():
            return self.pool.target
        return None

    async def _sync(self, ckpt: Checkpoint) -> None:
        sched = self.sched
        ev = sched.evaluator
        if ev is not None and ev.cfg.hold_weights and not ev.idle.is_set():
            log.info("weights of step %d wait for the evaluation round in progress", ckpt.step)
            sched.sync_waits(f"weights of step {ckpt.step} wait for the evaluation round in progress")
            await ev.idle.wait()
        # no evaluation round starts until the new policy is in (set_policy)
        sched.sync_started(f"weights of step {ckpt.step} are loading on the inference servers")
        if self.broadcast is not None and await self._broadcast(ckpt):
            return
        t0 = asyncio.get_running_loop().time()
        try:
            result = await self.pool.update_weights(ckpt)
        except UnloadableCheckpoint as e:
            self.refuse(ckpt, e)
            return
        self._report(SyncReport(ckpt.step, "filesystem", result.updated, result.failed, result.phases,
                                asyncio.get_running_loop().time() - t0))
        if self.refused is not None:
            log.info("checkpoint %d loads: the refusal of checkpoint %d no longer counts", ckpt.step,
                     self.refused[0].step)
        self.refused = self.since = None
        log.info("weights of step %d on %d/%d servers in %.1f s", ckpt.step, len(result.updated),
                 len(self.pool.servers), asyncio.get_running_loop().time() - t0)
        self._synced(ckpt)
        await sched.set_policy(ckpt.step)

    async def _broadcast(self, ckpt: Checkpoint) -> bool:
        """``ckpt`` by broadcast (BroadcastSync); whether that settled it (False: load it from disk instead, the
        trainer not offering broadcasts and the checkpoint having a path)."""
        assert self.broadcast is not None
        sched = self.sched
        self.retry = None
        servers = [s for s in self.pool.servers if (s.in_rotation or s.awaiting) and s.version != ckpt.step]
        if not servers:
            if ckpt.step > sched.policy:  # no server can take them now: again once one is healthy
                self.retry = ckpt
                self._once("no server", "weights of step %d wait: no inference server is healthy to take them",
                           ckpt.step)
                sched.sync_refused(f"weights of step {ckpt.step} wait for a healthy inference server")
            else:  # those that waited for the current weights got them from disk meanwhile
                await sched.set_policy(sched.policy)
            return True
        previous = self.pool.target
        if ckpt.step > previous.step:  # a server the probe brings back meanwhile gets these weights, not the old
            self.pool.target = ckpt
        try:
            report = await self._broadcast_to(ckpt, servers, previous)
        except NotNow as e:
            if e.fallback and ckpt.path is not None:
                self._once("fallback", "%s: loading checkpoints from disk instead", e)
                return False
            self._once(str(e), "weights of step %d wait: %s (tried again every %g s)", ckpt.step, e, self.retry_s)
            self.retry = ckpt
            sched.sync_refused(f"weights of step {ckpt.step} wait: {e}")
            return True
        except Stale as e:
            log.info("weights of step %d: %s; its newer weights are announced next", ckpt.step, e)
            sched.sync_refused(f"weights of step {ckpt.step}: {e}")
            return True
        except Failed as e:
            if e.report is not None:
                self._report(e.report)
            log.error("weights of step %d: %s; tried again in %g s (inference.broadcast.retry_s)", ckpt.step, e,
                      self.retry_s)
            self.retry = ckpt
            sched.sync_refused(f"weights of step {ckpt.step}: {e}; tried again every {self.retry_s:g} s")
            return True
        self._report(report)
        self._told.clear()
        for s in self.pool.servers:  # one that rejoined during the broadcast on the old weights, in a race
            if s.in_rotation and s.version != ckpt.step:
                self.pool.evict(s, f"it rejoined with the weights of step {s.version} during the broadcast of step "
                                   f"{ckpt.step}; it waits for these")
        if ckpt.step > sched.policy:
            log.info("weights of step %d on %d/%d servers by broadcast in %.2f s (%s)", ckpt.step, len(report.updated),
                     len(self.pool.servers), report.total_s,
                     ", ".join(f"{k} {v:.2f}" for k, v in report.phases.items()))
            self._synced(ckpt)
            await sched.set_policy(ckpt.step)
        else:  # the current weights again, for servers that waited for them
            log.info("weights of step %d brought to %d server(s) that waited for them", ckpt.step,
                     len(report.updated))
            await sched.set_policy(sched.policy)
        return True

    async def _broadcast_to(self, ckpt: Checkpoint, servers: list[Server], previous: Checkpoint) -> SyncReport:
        """``broadcast.update``; the pool's target goes back to ``previous`` when no server got ``ckpt``."""
        assert self.broadcast is not None
        try:
            return await self.broadcast.update(ckpt, servers)
        except (NotNow, Stale, Failed):
            self.pool.target = previous
            raise

    def _synced(self, ckpt: Checkpoint) -> None:
        """The servers hold ``ckpt`` now: the state says where its weights are (a resumed run reloads them), and
        which synced checkpoint was on disk last (weights over the wire: what a resumed run goes back to)."""
        self.state.policy_path = ckpt.path
        if ckpt.path is not None or self.pool.cfg.weights_path is not None:
            self.state.disk_step, self.state.disk_path = ckpt.step, ckpt.path

    def _report(self, report: SyncReport) -> None:
        self.reports = [*self.reports[-(MAX_REPORTS - 1):], report]

    def _once(self, key: str, msg: str, *args: object) -> None:
        """A WARNING the first time ``key`` comes up (until a broadcast succeeds), DEBUG after."""
        level = logging.DEBUG if key in self._told else logging.WARNING
        self._told.add(key)
        log.log(level, msg, *args)

    def refuse(self, ckpt: Checkpoint, e: UnloadableCheckpoint) -> None:
        """Checkpoint ``ckpt`` was refused (also by the reload at ``--resume``): start the clock unless it runs,
        log the refusal once per checkpoint and reason, and say it in stall lines."""
        now = asyncio.get_running_loop().time()
        if self.since is None:
            self.since = now
        again = self.refused is not None and (self.refused[0].step, self.refused[1].why) == (e.step, e.why)
        self.refused = (ckpt, e)
        left = self.since + self.bound_s - now
        stop_at = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
        keep = f"the servers keep the weights of step {self.sched.policy}, in rotation"
        if again:
            log.debug("%s (checked again)", e)
        else:
            log.error("%s; no server is asked to load it: %s; the run stops at %s (exit 1) unless a checkpoint "
                      "loads by then (inference.unloadable_checkpoint_s = %g)", e, keep, stop_at, self.bound_s)
        self.sched.sync_refused(f"{e}; {keep}; the run stops at {stop_at} unless a checkpoint loads")

    def _expired(self) -> CheckpointError:
        assert self.refused is not None
        return CheckpointError(
            f"{self.refused[1]}; no checkpoint has loaded for {self.bound_s:g} s since the first was refused "
            "(inference.unloadable_checkpoint_s), so the run stops: make the trainer's checkpoints loadable (or "
            "fix inference.weights_path), or set inference.check_checkpoints = false if this host does not see "
            "the servers' files at the same paths")


def back_to_disk(state: OrchestratorState, cfg: InferenceConfig) -> bool:
    """A resumed run with weights over the wire whose policy's weights went to the servers by broadcast and are on
    no disk goes back to the newest synced checkpoint that is (``state.disk_step``: a restarted trainer resumes
    from its newest checkpoint too); whether it did (a WARNING says so)."""
    if cfg.weight_transfer != "broadcast" or state.policy_path is not None or cfg.weights_path is not None \
            or state.policy_step == state.disk_step:
        return False
    log.warning("resumed with weights over the wire: the weights of step %d went to the servers by broadcast and are "
                "on no disk; the run goes back to those of step %d, the newest checkpoint on disk%s", state.policy_step,
                state.disk_step, "" if state.disk_path else " (none: the servers' own weights)")
    state.policy_step, state.policy_path = state.disk_step, state.disk_path
    return True
