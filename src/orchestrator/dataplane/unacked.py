"""Direct mode: the steps sent and not yet acknowledged, their release, and their rebuild when the trainer lost some.

On the direct data plane a sent step's columns stay in the env workers' pools until the trainer acknowledges
it. ``UnackedSteps`` keeps, per step sent and not acknowledged (at most ``transport.send_hwm``), its groups, the
rollouts it names and its ``attempt``, and:

- ``acked(step)``: the trainer holds every step <= ``step``: their rollouts' spans are released to their workers;
- ``run(sched)``: consumes the trainer's lost-step reports (``BatchSender.lost_steps``: it could not map some
  pools a manifest named, because their worker died or replaced them before it mapped them) and produces new
  attempts of those steps. A rebuild fails the step's rollouts in the lost pools (``worker_died``, as any lost
  rollout; a group left without survivors is dropped), takes groups from the scheduler until the step is whole again
  (``Scheduler.refill``, by the rules of any step), builds the manifest again with ``attempt + 1`` naming none of
  the pools reported lost (a refilled rollout in one fails too), and hands it to the sender, which sends it and
  every step after it again (``BatchSender.replace``). The trainer accepts only an attempt newer than the one it
  reported, so each step is trained once, whole, in order. A report of an attempt already replaced (receivers repeat
  their report until the newer attempt arrives) changes nothing. One step is rebuilt at a time (a trainer reports
  only the step it waits for); at most MAX_ATTEMPTS builds per step, then TransportError. A pool the trainer cannot
  map while its worker lives (another node: cross-node fetch is not built; a fetch timeout) is logged and named
  again by later steps: a passing failure costs one rebuild, a lasting one a rebuild per step.

Rows: a rebuild writes to rollouts.jsonl the rows of the rollouts it lost (failed), of the groups that dropped
(``"dropped": true``) and of the groups it added, each marked with ``"attempt"``; the step's metrics line stays
the first attempt's.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from orchestrator.contracts.manifest import MAX_ATTEMPTS, StepManifest
from orchestrator.contracts.protocol import PoolInfo, RolloutRecord
from orchestrator.contracts.rows import RolloutRow
from orchestrator.errors import TransportError

if TYPE_CHECKING:
    from orchestrator.contracts.reports import LostStep
    from orchestrator.dataplane.manifests import ManifestBuilder
    from orchestrator.delivery.zmq_link import BatchSender
    from orchestrator.hub.hub import WorkerHub
    from orchestrator.rollouts.groups import Group
    from orchestrator.rollouts.scheduler import Scheduler

log = logging.getLogger(__name__)

LOST_WHY = "the trainer could not map its column pool"


@dataclass
class SentStep:
    groups: list[Group]
    trained: list[RolloutRecord]  # the rollouts the manifest names (their spans are held until acknowledged)
    attempt: int = 0


class UnackedSteps:
    """See the module docstring. ``off_loop(fn, *args)`` runs blocking work in the step thread;
    ``write_rows(rows)`` appends to rollouts.jsonl (blocking: called through ``off_loop``)."""

    def __init__(self, builder: ManifestBuilder, hub: WorkerHub, sender: BatchSender,
                 off_loop: Callable[..., Awaitable[Any]], write_rows: Callable[[list[RolloutRow]], None]) -> None:
        self.builder, self.hub, self.sender = builder, hub, sender
        self.off_loop, self.write_rows = off_loop, write_rows
        self.steps: dict[int, SentStep] = {}
        self.rebuilt = 0

    def pools(self, unreadable: Collection[str] = ()) -> dict[str, PoolInfo]:
        """The pools a manifest may name: every worker's current pool, but those in ``unreadable``."""
        return {w: p for w, p in self.hub.pools.pools().items() if p.id not in unreadable}

    def sent(self, step: int, groups: list[Group], trained: list[RolloutRecord]) -> None:
        """``step`` is built (call before it is sent: an acknowledgement may follow at once)."""
        self.steps[step] = SentStep(groups, [r for r in trained if r.header.span is not None])

    def skipped(self, step: int) -> None:
        """``step`` was not sent (the trainer had it): nobody reads its columns."""
        sent = self.steps.pop(step, None)
        if sent is not None:
            self.hub.release(sent.trained)

    def acked(self, step: int) -> None:
        """The trainer acknowledged every step <= ``step``: their rollouts' columns are free."""
        for s in [s for s in self.steps if s <= step]:
            self.hub.release(self.steps.pop(s).trained)

    async def run(self, sched: Scheduler) -> None:
        """Consumes lost-step reports; produces rebuilt attempts (see the module docstring). Wakes on each
        report of the trainer holding the seat."""
        async for lost in self.sender.lost_steps():
            await self._rebuild(sched, lost)

    def _lose(self, sched: Scheduler, groups: list[Group], pools: Collection[str]
              ) -> tuple[list[Group], list[Group], list[RolloutRecord]]:
        """Fail the rollouts of ``groups`` in ``pools`` (``Scheduler.lose_taken``) and release their spans (a pool
        its worker still has gets them back): the groups kept, those dropped, the records lost."""
        pairs = {(r.header.worker, r.header.span.pool) for g in groups for r in g.records
                 if r.header.span is not None and r.header.span.pool in pools}
        if not pairs:
            return groups, [], []
        kept, dropped, gone = sched.lose_taken(groups, pairs, LOST_WHY)
        self.hub.release(gone)
        return kept, dropped, gone

    async def _rebuild(self, sched: Scheduler, lost: LostStep) -> None:
        step = lost.step
        sent = self.steps.get(step)
        if sent is None or lost.attempt != sent.attempt:  # acknowledged, or this attempt is replaced already
            return
        attempt = sent.attempt + 1
        if attempt >= MAX_ATTEMPTS:
            raise TransportError(f"step {step}: the trainer could not map column pools {list(lost.pools)} in "
                                 f"{MAX_ATTEMPTS} builds; is it on another node than the env workers (cross-node "
                                 "fetch is not built)?")
        live = sorted(f"{p.id} of env worker {w}" for w, p in self.pools().items() if p.id in lost.pools)
        if live:  # not a dead worker's pool: the trainer itself cannot map it (another node? a timeout?)
            log.warning("step %d: the trainer could not map column pools their workers still have (as far as the "
                        "hub knows): %s; this step's rollouts in them fail, later steps name them again", step,
                        ", ".join(live))
        kept, dropped, gone = self._lose(sched, sent.groups, lost.pools)
        log.warning("step %d (attempt %d): the trainer could not map column pools %s; %d rollouts lost, %d of %d "
                    "groups kept; refilling it as attempt %d", step, lost.attempt, list(lost.pools), len(gone),
                    len(kept), len(sent.groups), attempt)
        groups, added = list(kept), []
        while True:  # a group refilled from a lost pool (its worker's death not seen yet, or alive) fails too
            more, more_dropped, more_gone = self._lose(sched, await sched.refill(step, groups), lost.pools)
            groups += more
            added += more
            dropped += more_dropped
            gone += more_gone
            if not more_gone:  # else the step is short again
                break
        result = await self.off_loop(self.builder, step, groups, dropped, self.pools(lost.pools),
                                     attempt)
        assert isinstance(result.batch, StepManifest)
        self.hub.release(result.untrained)
        new_gids = {g.gid for g in [*added, *dropped]}
        gone_rids = {r.rid for r in gone}
        rows = [msgspec.structs.replace(row, attempt=attempt) for row in result.rows
                if row.group in new_gids or row.rollout in gone_rids]
        await self.off_loop(self.write_rows, rows)
        if step not in self.steps:  # acknowledged meanwhile: impossible for a trainer waiting on it, but cheap
            self.hub.release(result.trained)
            return
        self.steps[step] = SentStep(groups, [r for r in result.trained if r.header.span is not None], attempt)
        self.sender.replace(result.batch)
        self.rebuilt += 1
        log.info("step %d: attempt %d sent with %d samples (%d groups added)", step, attempt, result.num_samples,
                 len(added))
