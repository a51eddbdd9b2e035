"""What the scheduler uses of the systems around it: the env workers and the source of checkpoints."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from orchestrator.contracts.events import HubEvent
from orchestrator.contracts.protocol import Assign, RolloutRecord


class WorkerLink(Protocol):
    """What the scheduler uses of the env workers (``WorkerHub``; ``testing.workers.FakeWorkerHub``)."""

    events: asyncio.Queue[HubEvent]
    tasks_per_env: dict[str, int]

    def has_ready(self) -> bool: ...
    def assign(self, msg: Assign) -> str: ...  # returns the worker's name
    def cancel(self, group: str, rids: list[str]) -> None: ...
    def release(self, records: Sequence[RolloutRecord]) -> None: ...  # their columns will never be read
    def worker_stats(self) -> dict[str, tuple[int, float | None]]: ...  # name -> (completed, RSS MB)


class CheckpointSource(Protocol):
    """Where checkpoints come from (the batch sender): asked when a step waits for one."""

    def checkpoint_wanted(self, policy: int) -> str: ...  # ask for weights >= policy; a clause for the log line
