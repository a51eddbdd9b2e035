"""The stall line: what a step that takes no rollout for ``monitor.stall_warn_s`` waits for, in one warning.

Stale discards and gate rejections are not progress. The line names the first cause that holds: a refill of an
earlier step, a checkpoint (and where it comes from: the weight sync's ``loading``, or the trainer link asked
for it), env workers, inference servers, the servers' own caps (``[scheduler.concurrency]``), or else the
rollouts in flight; then the rollouts in flight, the step's discards, drops and gate rejections, and the failures
by kind.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.inference.pool import InferencePool
    from orchestrator.rollouts.admission import Admission
    from orchestrator.rollouts.groups import GroupTracker
    from orchestrator.rollouts.links import CheckpointSource, WorkerLink

log = logging.getLogger(__name__)


class StallLine:
    def __init__(self, admission: Admission, hub: WorkerLink, pool: InferencePool, tracker: GroupTracker,
                 counts: Counter[str], checkpoints: CheckpointSource | None, max_rejected_batches: int,
                 smallest_group: int = 1) -> None:
        self.admission = admission
        self.hub = hub
        self.pool = pool
        self.tracker = tracker
        self.counts = counts
        self.checkpoints = checkpoints
        self.max_rejected_batches = max_rejected_batches
        self.smallest_group = smallest_group  # a server without room for a group this size is at its cap
        # what the weight sync to a newer policy waits for while it runs, or why its checkpoint was refused
        self.loading: str | None = None

    def warn(self, step: int, count: int, target: int, waited_s: float, rejected: int) -> None:
        """Say, in one line, what step ``step`` (``count`` of ``target``) waits for."""
        failed = {str(kind): n for kind, n in self.tracker.failed.items()}  # str: the log shows the kind's value
        log.warning("step %d has %d of %d after %.0f s without progress: waits for %s; %d rollouts in flight, %d "
                    "stale discarded, %d groups dropped, %d rejected by gates (%d of %d allowed), failures %s", step,
                    count, target, waited_s, self.cause(step), self.tracker.inflight_rollouts,
                    self.counts["stale_rollouts"], self.counts["dropped_groups"], self.counts["rejected_groups"],
                    rejected, self.max_rejected_batches * target, failed or "none")

    def cause(self, step: int) -> str:
        """What step ``step`` waits for, in a clause."""
        adm = self.admission
        oldest = step - adm.cfg.max_async_level
        if adm.refilling is not None and adm.refilling != step:
            return f"step {adm.refilling} first: the trainer lost some of its columns and it is being refilled"
        if adm.policy < oldest:
            source = self.loading or (self.checkpoints.checkpoint_wanted(oldest) if self.checkpoints is not None
                                      else "no trainer link to ask")
            return (f"a checkpoint of policy >= {oldest} (the servers have policy {adm.policy}; no training group "
                    f"opens until then): {source}")
        if not self.hub.has_ready():
            return ("an env worker that can take a group: none is ready (starting, or restarting after a crash), "
                    "or (on the direct data plane) every ready one's column pool is full until the trainer "
                    "acknowledges steps")
        if not any(s.in_rotation for s in self.pool.servers):
            return f"an inference server: none is in rotation ({self.pool.out_of_rotation()})"
        capped = self.pool.capped(self.smallest_group)
        if capped and self.tracker.inflight_rollouts < self.admission.capacity.max_inflight:
            return f"room under the servers' caps ([scheduler.concurrency]: {capped})"
        out = self.pool.out_of_rotation()
        return "rollouts" + (f" (servers out of rotation: {out})" if out else "")
