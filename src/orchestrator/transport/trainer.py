"""The reference trainer: receives batches, checks them, optionally learns, and announces a checkpoint per step.

For demos, tests and debugging (``orchestrator receive``). It behaves like a trainer on the wire: it reads
every step in order, takes ``train_s`` per step, then announces weights ``step + 1`` (with ``checkpoint_dir``:
in the directory ``checkpoint_dir/step_<N>``, which it creates, as a trainer saving its weights would; without
it the orchestrator's ``inference.weights_path`` must name them). With a ``learner`` (``orchestrator receive
--learn``, ``transport/learner.py``) it trains the tiny policy the simulated servers sample from on each batch
and saves it into that directory before announcing it, so the servers sample from what it learned; without
one it trains nothing and each directory holds the unchanged initial policy (written once per
``checkpoint_dir``, then hard-linked): a real server fails to load a directory without weights, and its engine
dies (``orchestrator.sim.engine``), so a trainer announces none.
With a ``journal`` file it appends one JSON line per step received and, when started again, tells the
orchestrator the last step in it and the checkpoint after it (as a real trainer restarting from its checkpoint
would: weights ``last + 1``, the ones it trained on that step), so tests can check delivery across crashes of
either side: every step once, in order, and no wait for weights that were announced before the crash.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from orchestrator.policy import FILE, Policy
from orchestrator.security import ClientKeys
from orchestrator.transport.checkpoints import Checkpoint
from orchestrator.transport.learner import LearnStats, PolicyLearner
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
    learned: LearnStats | None = None  # what the learner's update saw and did


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
    learner: PolicyLearner | None = None  # learn from each batch and save the policy into the checkpoint

    def __post_init__(self) -> None:
        if self.learner is not None and (self.checkpoint_dir is None or not self.announce):
            raise ValueError("a learning trainer needs a checkpoint_dir to save into and must announce checkpoints")

    async def run(self) -> None:
        """Consumes batches; produces checkpoint announcements. Ends after ``max_steps`` or when cancelled."""
        if self.announce and self.checkpoint_dir is not None and self.learner is None:
            # before the first step, so that a checkpoint is announced as soon as its step is in: writing the
            # file (~0.3 s) then would let the next step arrive meanwhile, its checkpoint follow at once, and the
            # orchestrator skip to that newer one (a slow consumer of announcements takes the newest)
            await asyncio.to_thread(unchanged_policy_file, self.checkpoint_dir)
        done = read_journal(self.journal)
        last = int(done[-1]["step"]) if done else None
        resumed = None
        if last is not None:
            log.info("trainer: journal %s ends at step %d; asking for the steps after it", self.journal, last)
            self._resume_policy(last + 1)
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
                learned = await asyncio.to_thread(self.learner.update, batch) if self.learner else None
                info = ReceivedStep(batch.step, batch.num_samples, batch.num_tokens,
                                    int(np.count_nonzero(batch.columns["loss_mask"])),
                                    float(np.mean(batch.scalars["advantage"])) if batch.num_samples else 0.0,
                                    tuple(routed.shape) if routed is not None else None, learned)
                self.received.append(info)
                # the checkpoint is written before the step is journaled and acknowledged: a trainer restarted
                # after its journal's last step finds that step's policy saved
                path = await asyncio.to_thread(self._save, batch.step + 1) if self.announce else None
                if journal:
                    journal.write(orjson.dumps(asdict(info), option=orjson.OPT_APPEND_NEWLINE))
                    journal.flush()
                await receiver.ack(batch.step)  # after the journal line, so a killed trainer loses no step
                log.info("trainer: step %d: %d samples, %d tokens (%d trained), routed experts %s%s",
                         info.step, info.samples, info.tokens, info.trained_tokens, info.routed_shape,
                         "" if learned is None else f" | {learned}")
                await self.train(batch)
                if self.announce:
                    await receiver.announce(batch.step + 1, path)
        finally:
            receiver.close()
            if journal:
                journal.close()

    def _resume_policy(self, step: int) -> None:
        """A learner restarted after checkpoint ``step`` goes on from the policy saved in it, as a trainer would."""
        if self.learner is not None and self.checkpoint_dir is not None:
            policy = Policy.load(self.checkpoint_dir / f"step_{step}")
            if policy is not None:
                self.learner.policy = policy
                log.info("trainer: learning on from the policy of checkpoint %d", step)

    async def train(self, batch: Batch) -> None:
        """Training on ``batch``, after it is acknowledged and before its weights are announced: ``train_s`` of
        waiting. A subclass may wait for something else (a test holding the trainer)."""
        if self.train_s:
            await asyncio.sleep(self.train_s)

    def _save(self, step: int) -> str | None:
        """The directory of checkpoint ``step`` (created; the learner's policy saved in it), or None."""
        if self.checkpoint_dir is None:
            return None
        path = (self.checkpoint_dir / f"step_{step}").resolve()
        path.mkdir(parents=True, exist_ok=True)
        if self.learner is not None:
            self.learner.save(path)
        else:
            link_unchanged_policy(self.checkpoint_dir, path)
        return str(path)


UNCHANGED = ".unchanged"  # checkpoint_dir/.unchanged/tiny_policy.npz: the policy a trainer that learns nothing links


def unchanged_policy_file(checkpoint_dir: Path) -> Path:
    """The initial policy's weights file of ``checkpoint_dir``, written (atomically) if it is not there yet."""
    source = checkpoint_dir / UNCHANGED / FILE
    if not source.exists():
        Policy.initial().save(source.parent)
    return source


def link_unchanged_policy(checkpoint_dir: Path, step_dir: Path) -> None:
    """Put the initial policy's weights file into ``step_dir``: written once per ``checkpoint_dir``,
    hard-linked into each step (a copy where links fail: another filesystem). A server loading the same file
    again reads nothing new (``orchestrator.sim.policy``)."""
    source = unchanged_policy_file(checkpoint_dir)
    target = step_dir / FILE
    if target.exists():
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


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
