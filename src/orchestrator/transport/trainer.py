"""The reference trainer: receives batches, checks them, and announces a checkpoint after each step.

For demos, tests and debugging (``orchestrator receive``): it trains nothing, but behaves like a trainer
on the wire: it reads every step in order, takes ``train_s`` per step, then announces weights ``step + 1``
(with ``checkpoint_dir``: in the directory ``checkpoint_dir/step_<N>``, which it creates, as a trainer
saving its weights would; without it the orchestrator's ``inference.weights_path`` must name them).
With a ``journal`` file it appends one JSON line per step received and, when started again, tells the
orchestrator the last step in it and the checkpoint after it (as a real trainer restarting from its checkpoint
would: weights ``last + 1``, the ones it trained on that step), so tests can check delivery across crashes of
either side: every step once, in order, and no wait for weights that were announced before the crash.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from orchestrator.security import ClientKeys
from orchestrator.transport.checkpoints import Checkpoint
from orchestrator.transport.receiver import BatchReceiver
from orchestrator.transport.wire import Batch

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
    journal: Path | None = None
    keys: ClientKeys | None = None  # CURVE: for an orchestrator that binds tcp:// with [security] keys
    checkpoint_dir: Path | None = None

    async def run(self) -> None:
        """Consumes batches; produces checkpoint announcements. Ends after ``max_steps`` or when cancelled."""
        done = read_journal(self.journal)
        last = int(done[-1]["step"]) if done else None
        resumed = None
        if last is not None:
            log.info("trainer: journal %s ends at step %d; asking for the steps after it", self.journal, last)
            if self.announce:  # the weights it would have resumed from: trained on step ``last``
                resumed = Checkpoint(last + 1, await asyncio.to_thread(self._save, last + 1))
        receiver = BatchReceiver(self.address, last_step=last, auto_ack=False, keys=self.keys, checkpoint=resumed)
        # a line per step, on the loop: the reference trainer does nothing else meanwhile
        journal = open(self.journal, "ab") if self.journal else None  # noqa: SIM115, ASYNC230 - closed below
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
                if journal:
                    journal.write(orjson.dumps(asdict(info), option=orjson.OPT_APPEND_NEWLINE))
                    journal.flush()
                await receiver.ack(batch.step)  # after the journal line, so a killed trainer loses no step
                log.info("trainer: step %d: %d samples, %d tokens (%d trained), routed experts %s",
                         info.step, info.samples, info.tokens, info.trained_tokens, info.routed_shape)
                await self.train(batch)
                if self.announce:
                    await receiver.announce(batch.step + 1, await asyncio.to_thread(self._save, batch.step + 1))
        finally:
            receiver.close()
            if journal:
                journal.close()

    async def train(self, batch: Batch) -> None:
        """Training on ``batch``, after it is acknowledged and before its weights are announced: ``train_s`` of
        waiting. A subclass may wait for something else (a test holding the trainer)."""
        if self.train_s:
            await asyncio.sleep(self.train_s)

    def _save(self, step: int) -> str | None:
        """The directory of checkpoint ``step`` (created; it would hold the weights), or None."""
        if self.checkpoint_dir is None:
            return None
        path = (self.checkpoint_dir / f"step_{step}").resolve()
        path.mkdir(parents=True, exist_ok=True)
        return str(path)


def read_journal(path: Path | None) -> list[dict[str, Any]]:
    """The steps a ``ReferenceTrainer`` journal records, in the order received (a torn last line is skipped)."""
    if path is None or not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return out
