"""What the worker hub tells the scheduler, on its ``events`` queue (hub.py; the fake: testing/workers.py).

``RecordsIn``: finished rollouts of one worker. ``WorkerLost``: rollouts in flight on a worker that will never
come back. ``PoolGone`` (the direct data plane): a worker's column pool is gone, with the columns of every
rollout it held there; those not yet trained cannot train.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.contracts.protocol import RolloutRecord


@dataclass(frozen=True, slots=True)
class RecordsIn:
    """Finished rollouts from ``worker``, each for a rollout that was in flight there."""

    worker: str
    records: list[RolloutRecord]


@dataclass(frozen=True, slots=True)
class WorkerLost:
    """``worker`` is gone (``why``); ``rids``, in flight on it, will never come back."""

    worker: str
    rids: list[str]
    why: str


@dataclass(frozen=True, slots=True)
class PoolGone:
    """``worker``'s column pool ``pool`` is gone (``why``): rollouts whose columns are in it cannot train."""

    worker: str
    pool: str
    why: str


HubEvent = RecordsIn | WorkerLost | PoolGone
