"""``DirectPlane``: columns stay in the env workers' pools; the trainer gets a manifest (docs/data-plane.md).

A step is built from headers alone (``ManifestBuilder``, manifests.py). The rollouts a step names are
held until the trainer acknowledges it (unacked.py, which also builds again a step the trainer lost); the
survivors it leaves out are released at once. The column bytes are read here only for a due step dump or
samples table (readback.py), before the step is sent, in the step thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec

from orchestrator.contracts.manifest import StepManifest
from orchestrator.contracts.protocol import PoolInfo
from orchestrator.dataplane.manifests import ManifestBuilder
from orchestrator.dataplane.plane import OffLoop
from orchestrator.dataplane.readback import Readback
from orchestrator.dataplane.unacked import UnackedSteps
from orchestrator.errors import WireError
from orchestrator.rollouts.groups import Group
from orchestrator.security import KeyPair
from orchestrator.steps.boundary import StepBuilder
from orchestrator.steps.dump import dump_due
from orchestrator.steps.phases import Built, StepPipeline

if TYPE_CHECKING:
    from orchestrator.contracts.rows import RolloutRow
    from orchestrator.contracts.wire import Batch
    from orchestrator.delivery.zmq_link import BatchSender
    from orchestrator.hub.hub import WorkerHub
    from orchestrator.rollouts.scheduler import Scheduler
    from orchestrator.sinks import Sinks

log = logging.getLogger(__name__)


class DirectPlane:
    """See the module docstring. ``dump_steps``: ``pipeline.dump_steps`` (a due dump reads the step's columns
    back)."""

    def __init__(self, builder: StepBuilder, hub: WorkerHub, sender: BatchSender, sinks: Sinks, off_loop: OffLoop,
                 write_rows: Callable[[list[RolloutRow]], None], keys: KeyPair | None,
                 dump_steps: int | Sequence[int]) -> None:
        self.hub, self.sender, self.sinks, self.off_loop = hub, sender, sinks, off_loop
        self.manifests = ManifestBuilder(builder)
        # the steps sent and not yet acknowledged (bounded by send_hwm), released on acknowledgement, built
        # again when the trainer reports one lost
        self.unacked = UnackedSteps(self.manifests, hub, sender, off_loop, write_rows)
        assert sender.pool is None  # no shared-memory pool: its own acknowledgement hook would be replaced
        sender.on_ack = self.unacked.acked
        self.readback = Readback(keys)  # with our key pair for CURVE span servers
        self.dump_steps = dump_steps

    async def build(self, pipeline: StepPipeline, step: int, groups: Sequence[Group], dropped: Sequence[Group],
                    phase_s: dict[str, float]) -> Built:
        """The manifest of the pools as of now; the columns a due dump or samples table reads, read now (no span
        of the step is released before its acknowledgement); the survivors the step leaves out released."""
        pools = self.unacked.pools()
        result = await self.off_loop(self.manifests, step, groups, dropped, pools)
        self.unacked.sent(step, list(groups), result.trained)  # before any acknowledgement
        dump = dump_due(self.dump_steps, step)
        shown: list[Group] = list(groups)  # the groups the samples table and the dump read columns from
        dumped = None
        if dump or self.sinks.samples_due(step):
            shown, dumped = await self.off_loop(self._read_back, shown, result.batch, pools, dump)
        self.hub.release(result.untrained)  # filtered rollouts' columns are never read
        return Built(result, shown, dumped)

    def after_send(self, step: int, sent: bool) -> None:
        if not sent:  # the trainer had it: nobody reads these columns
            self.unacked.skipped(step)

    async def run(self, sched: Scheduler) -> None:
        """The pool announcements, and the rebuilds of steps the trainer lost, for as long as the run lasts."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._announce_pools())
            tg.create_task(self.unacked.run(sched))

    async def _announce_pools(self) -> None:
        """Consumes the pools env workers announce; produces announcements to the trainer, so it maps each pool
        before a step names it. Wakes on each worker's ``ready``."""
        while True:
            worker, pool = await self.hub.pools.news.get()
            self.sender.announce_pool(worker, msgspec.structs.asdict(pool))

    def _read_back(self, groups: list[Group], manifest: StepManifest, pools: dict[str, PoolInfo], dump: bool
                   ) -> tuple[list[Group], Batch | None]:
        """Blocking (the step thread): the opt-in column reads (readback.py). For a dump, every record's columns
        and the step's batch; for the samples table only, its few rollouts'."""
        if not dump:
            return self.readback.groups(groups, pools, limit=self.sinks.samples), None
        shown = self.readback.groups(groups, pools)
        try:
            return shown, self.readback.batch(manifest)
        except WireError as e:  # a pool gone since the build: the trainer will report the step lost; no dump
            log.warning("step %d: not dumped: its columns cannot be read back: %s", manifest.step, e)
            return shown, None
