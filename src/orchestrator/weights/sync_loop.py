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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from orchestrator.contracts.checkpoints import Checkpoint, CheckpointFeed
from orchestrator.errors import CheckpointError, UnloadableCheckpoint
from orchestrator.inference.config import InferenceConfig
from orchestrator.inference.pool import InferencePool
from orchestrator.rollouts.scheduler import Scheduler
from orchestrator.state import OrchestratorState

log = logging.getLogger(__name__)

RECHECK_S = 5.0  # a refused checkpoint is checked again this often (a stat, or a few headers: cheap)


class WeightSyncLoop:
    def __init__(self, pool: InferencePool, sched: Scheduler, state: OrchestratorState, cfg: InferenceConfig) -> None:
        self.pool = pool
        self.sched = sched
        self.state = state
        self.bound_s = cfg.unloadable_checkpoint_s
        self.feed = CheckpointFeed()
        self.tried = -1  # the newest announced step taken from the feed
        self.refused: tuple[Checkpoint, UnloadableCheckpoint] | None = None  # the newest refused, until one loads
        self.since: float | None = None  # the first refusal since a checkpoint last loaded

    async def run(self, announcements: AsyncIterator[Checkpoint]) -> None:
        """Consumes ``announcements``; produces weight syncs and policy changes. Waits for a newer announcement
        or, while a checkpoint is refused, its next recheck. Runs until cancelled, or raises CheckpointError when
        no checkpoint loads for ``unloadable_checkpoint_s`` after a refusal."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._read(announcements))
            while True:
                ckpt = await self._next()
                refused = self.refused[0].step if self.refused is not None else None
                if ckpt.step <= self.sched.policy and ckpt.step != refused:  # a refused one at resume is retried
                    continue
                await self._sync(ckpt)

    async def _read(self, announcements: AsyncIterator[Checkpoint]) -> None:
        async for ckpt in announcements:
            self.feed.offer(ckpt)

    async def _next(self) -> Checkpoint:
        """The newest announced checkpoint not taken yet; while one is refused, that one again every
        RECHECK_S; CheckpointError at the refusal clock's end."""
        loop = asyncio.get_running_loop()
        while True:
            deadline = None if self.since is None else self.since + self.bound_s
            wait = None if deadline is None else min(RECHECK_S, deadline - loop.time())
            if wait is not None and wait <= 0:
                raise self._expired()
            try:
                async with asyncio.timeout(wait):  # not wait_for: on 3.11 it can swallow a cancel
                    ckpt = await self.feed.newer(self.tried)
            except TimeoutError:
                if self.refused is not None and deadline is not None and loop.time() < deadline:
                    return self.refused[0]
                continue
            self.tried = ckpt.step
            return ckpt

    async def _sync(self, ckpt: Checkpoint) -> None:
        sched = self.sched
        ev = sched.evaluator
        if ev is not None and ev.cfg.hold_weights and not ev.idle.is_set():
            log.info("weights of step %d wait for the evaluation round in progress", ckpt.step)
            sched.sync_waits(f"weights of step {ckpt.step} wait for the evaluation round in progress")
            await ev.idle.wait()
        # no evaluation round starts until the new policy is in (set_policy)
        sched.sync_started(f"weights of step {ckpt.step} are loading on the inference servers")
        t0 = asyncio.get_running_loop().time()
        try:
            result = await self.pool.update_weights(ckpt)
        except UnloadableCheckpoint as e:
            self.refuse(ckpt, e)
            return
        if self.refused is not None:
            log.info("checkpoint %d loads: the refusal of checkpoint %d no longer counts", ckpt.step,
                     self.refused[0].step)
        self.refused = self.since = None
        log.info("weights of step %d on %d/%d servers in %.1f s", ckpt.step, len(result.updated),
                 len(self.pool.servers), asyncio.get_running_loop().time() - t0)
        self.state.policy_path = ckpt.path
        await sched.set_policy(ckpt.step)

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
