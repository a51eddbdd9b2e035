"""The reference trainer: receives batches, checks them, and announces a checkpoint after each step.

For demos, tests and debugging (``orchestrator receive``): it trains nothing, but behaves like a trainer
on the wire: it reads every step in order, takes ``train_s`` per step, then announces weights ``step + 1``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from orchestrator.transport.wire import Batch
from orchestrator.transport.zmq_link import BatchReceiver

log = logging.getLogger(__name__)


@dataclass
class ReceivedStep:
    step: int
    samples: int
    tokens: int
    trained_tokens: int
    mean_advantage: float
    routed_shape: tuple[int, ...] | None


@dataclass
class ReferenceTrainer:
    address: str
    train_s: float = 0.0
    announce: bool = True
    max_steps: int | None = None
    received: list[ReceivedStep] = field(default_factory=list)
    on_batch: Callable[[Batch], None] = lambda _b: None

    async def run(self) -> None:
        """Consumes batches; produces checkpoint announcements. Ends after ``max_steps`` or when cancelled."""
        receiver = BatchReceiver(self.address)
        try:
            while self.max_steps is None or len(self.received) < self.max_steps:
                batch = await receiver.recv()
                self.on_batch(batch)
                routed = batch.columns.get("routed_experts")
                info = ReceivedStep(batch.step, batch.num_samples, batch.num_tokens,
                                    int(np.count_nonzero(batch.columns["loss_mask"])),
                                    float(np.mean(batch.scalars["advantage"])) if batch.num_samples else 0.0,
                                    tuple(routed.shape) if routed is not None else None)
                self.received.append(info)
                log.info("trainer: step %d: %d samples, %d tokens (%d trained), routed experts %s",
                         info.step, info.samples, info.tokens, info.trained_tokens, info.routed_shape)
                if self.train_s:
                    await asyncio.sleep(self.train_s)
                if self.announce:
                    await receiver.announce(batch.step + 1)
        finally:
            receiver.close()
