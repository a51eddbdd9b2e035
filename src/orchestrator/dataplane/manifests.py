"""``ManifestBuilder``: a direct-mode step built from its rollouts' headers alone (docs/data-plane.md).

Advantages and filters as on the through plane, the token filters' verdicts as the env workers reported them
(``FilterSet(in_worker=True)``), and a manifest naming every worker's current pool. A taken rollout whose pool is
no longer its worker's (the worker died or renewed its pool after the step took it) fails with ``worker_died``
and does not train. Used by the direct plane (direct.py) for a step's first build and by unacked.py for a step
built again after the trainer lost some of its pools.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.contracts.manifest import StepManifest, build_manifest
from orchestrator.contracts.protocol import PoolInfo
from orchestrator.rollouts.groups import lose_columns
from orchestrator.scoring.filters import FilterSet
from orchestrator.steps.boundary import StepBuilder, StepResult

log = logging.getLogger(__name__)


class ManifestBuilder:
    """A step's manifest and rows from its groups' headers (see the module docstring). Blocking: the step
    thread."""

    def __init__(self, steps: StepBuilder) -> None:
        self.steps = steps
        # custom filters may read tokens and cannot run here (not built): named once, when the first step is built
        self.filters = FilterSet(steps.filter_configs, steps.vocab_size, in_worker=True)
        self.skipped = sorted(set(self.filters.skipped))

    def __call__(self, step: int, groups: Sequence[Any], dropped: Sequence[Any], pools: Mapping[str, PoolInfo],
                 attempt: int = 0) -> StepResult[StepManifest]:
        """A manifest naming ``pools``; ``attempt`` > 0 for a step built again after the trainer lost some of
        its pools (unacked.py)."""
        for g in groups:
            for worker, pool in sorted({(r.header.worker, r.header.span.pool) for r in g.records
                                        if r.header.span is not None}):
                if pools.get(worker) is None or pools[worker].id != pool:
                    lose_columns(g, worker, pool, "its column pool is gone")
        if self.skipped:
            log.warning("the direct data plane: custom filters %s may read column bytes and are not applied "
                        "(not built yet)", self.skipped)
            self.skipped = []
        b = self.steps
        rows, trained, phase = b.rows(step, groups, dropped, self.filters)
        t = time.perf_counter()
        manifest = build_manifest(b.run, step, [(rec, a) for rec, a in trained if rec.header.samples], pools,
                                  attempt, b.logprobs_mode, b.temperatures, lambda h: b.lag.keep(h, step))
        phase["assemble"] = time.perf_counter() - t
        return b.result(manifest, rows, phase, groups, trained, self.filters)
