"""The reference trainer: receives batches, checks them, optionally learns, and announces a checkpoint per step.

For demos, tests and debugging (``orchestrator receive``). It behaves like a trainer on the wire: it reads
every step in order, takes ``train_s`` per step, then announces weights ``step + 1`` (with ``checkpoint_dir``:
in the directory ``checkpoint_dir/step_<N>``, which it writes, as a trainer saving its weights would; without
it the orchestrator's ``inference.weights_path`` must name them). With a ``learner`` (``orchestrator receive
--learn``, ``trainer/learner.py``) it trains the tiny policy the simulated servers sample from on each batch
and saves it into that directory before announcing it, so the servers sample from what it learned; without
one it trains nothing and each directory holds the unchanged initial policy (the servers' starting weights),
written once per ``checkpoint_dir`` (in ``.initial/``) and hard-linked into each ``step_<N>``: a checkpoint
that loads, as the orchestrator's check of checkpoints requires, at no cost per step. Each ``step_<N>``
appears whole: written under a temp name, then renamed (an existing one has its file replaced atomically).
With a ``journal`` file it appends one JSON line per step received and, when started again, tells the
orchestrator the last step in it and the checkpoint after it (as a real trainer restarting from its checkpoint
would: weights ``last + 1``, the ones it trained on that step), so tests can check delivery across crashes of
either side: every step once, in order, and no wait for weights that were announced before the crash.

Weights over the wire (``broadcaster``, trainer/broadcast.py): the trainer also sends its weights to the servers
when the orchestrator asks (broadcast mode), right after announcing them and before it trains on (it serves the
requests until the orchestrator has taken the weights: ``serve_transfers``, at most ``transfer_wait_s``, or until the
orchestrator says its run has ended); with
``save_every`` = K it then writes a checkpoint directory only every K steps (the announcements in between carry
no path): what a late or restarted server loads, and what a restarted trainer resumes from (the newest one).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import orjson

from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.contracts.wire import Batch
from orchestrator.policy import FILE as POLICY_FILE
from orchestrator.policy import Policy
from orchestrator.security import ClientKeys
from orchestrator.trainer.broadcast import WeightBroadcaster
from orchestrator.trainer.receiver import BatchReceiver

log = logging.getLogger(__name__)


class Learner(Protocol):
    """What learns from each batch: ``PolicyLearner`` (the simulated servers' tiny policy, trainer/learner.py) or
    ``TorchLearner`` (a real model, trainer/torch_learner.py)."""

    def update(self, batch: Batch) -> Any:
        """Learn from ``batch``; what it saw and did (a dataclass, journaled, and its ``str`` logged)."""
        ...

    def save(self, directory: Path) -> object:
        """Write the current weights into ``directory`` (the checkpoint the orchestrator loads)."""
        ...

    def resume(self, directory: Path) -> bool:
        """Go on from the weights saved in ``directory`` (False: none there)."""
        ...


class BroadcastLearner(Learner, Protocol):
    """A learner whose weights can go over the wire (``receive --broadcast``): both built-in learners are."""

    def weights(self) -> Mapping[str, Any]:
        """The current weights by name (torch tensors or numpy arrays): what a broadcast sends."""
        ...


@dataclass
class ReceivedStep:
    step: int
    samples: int
    tokens: int
    trained_tokens: int
    mean_advantage: float
    routed_shape: tuple[int, ...] | None
    learned: Any = None  # what the learner's update saw and did (its stats dataclass)


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
    learner: Learner | None = None  # learn from each batch and save the weights into the checkpoint
    broadcaster: WeightBroadcaster | None = None  # sends its weights to the servers when the orchestrator asks
    save_every: int = 1  # write a checkpoint directory every this many steps (the others: announced without one)
    transfer_wait_s: float = 600.0  # after announcing, wait at most this for the orchestrator to take the weights

    def __post_init__(self) -> None:
        self.receiver: BatchReceiver | None = None  # while it runs (a subclass holding a step may serve transfers)
        if self.learner is not None and (self.checkpoint_dir is None or not self.announce):
            raise ValueError("a learning trainer needs a checkpoint_dir to save into and must announce checkpoints")
        if self.save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {self.save_every}")

    async def run(self) -> None:
        """Consumes batches; produces checkpoint announcements. Ends after ``max_steps`` or when cancelled."""
        if self.announce and self.checkpoint_dir is not None and self.learner is None:
            # before the first step, so that a checkpoint is announced as soon as its step is in: writing the
            # file (~0.3 s) then would let the next step arrive meanwhile, its checkpoint follow at once, and the
            # orchestrator skip to that newer one (a slow consumer of announcements takes the newest)
            await asyncio.to_thread(initial_policy, self.checkpoint_dir)
        done = read_journal(self.journal)
        last = int(done[-1]["step"]) if done else None
        resumed = None
        if last is not None:
            log.info("trainer: journal %s ends at step %d; asking for the steps after it", self.journal, last)
            self._resume_policy(last + 1)
            if self.announce:  # the weights it would have resumed from: trained on step ``last``
                resumed = Checkpoint(last + 1, await asyncio.to_thread(self._save, last + 1))
        receiver = self.receiver = BatchReceiver(self.address, last_step=last, auto_ack=False, keys=self.keys,
                                                 checkpoint=resumed, broadcaster=self.broadcaster)
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
                saves = self.announce and (batch.step + 1) % self.save_every == 0
                path = await asyncio.to_thread(self._save, batch.step + 1) if saves else None
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
                    await receiver.serve_transfers(batch.step + 1, self.transfer_wait_s)
        finally:
            receiver.close()
            if journal:
                journal.close()

    def _resume_policy(self, step: int) -> None:
        """A learner restarted after checkpoint ``step`` goes on from the policy saved in it, as a trainer would;
        from the newest one before it that was saved when ``save_every`` skipped it (the training since is lost)."""
        if self.learner is None or self.checkpoint_dir is None:
            return
        for saved in range(step, -1, -1):
            if self.learner.resume(self.checkpoint_dir / f"step_{saved}"):
                if saved != step:
                    log.warning("trainer: no checkpoint of step %d saved (save_every = %d): learning on from the "
                                "weights of checkpoint %d; what steps %d..%d taught is lost", step, self.save_every,
                                saved, saved, step - 1)
                else:
                    log.info("trainer: learning on from the weights of checkpoint %d", step)
                return

    async def train(self, batch: Batch) -> None:
        """Training on ``batch``, after it is acknowledged and before its weights are announced: ``train_s`` of
        waiting. A subclass may wait for something else (a test holding the trainer)."""
        if self.train_s:
            await asyncio.sleep(self.train_s)

    def _save(self, step: int) -> str | None:
        """The directory of checkpoint ``step``, written (the learner's policy, else the initial one), or None."""
        if self.checkpoint_dir is None:
            return None
        if self.learner is None:
            return str(save_initial_checkpoint(self.checkpoint_dir, step))
        path = (self.checkpoint_dir / f"step_{step}").resolve()
        publish_dir(path, self.learner.save)
        return str(path)


def save_initial_checkpoint(checkpoint_dir: Path, step: int) -> Path:
    """``checkpoint_dir/step_<step>`` (resolved) holding the unchanged initial policy, hard-linked to the one copy
    written per ``checkpoint_dir``: a checkpoint any simulated server loads, for trainers that learn nothing (the
    reference trainer, tests). It appears whole (``publish_dir``). Blocking."""
    path = (checkpoint_dir / f"step_{step}").resolve()
    initial = initial_policy(checkpoint_dir)
    publish_dir(path, lambda d: link_or_copy(initial, d / POLICY_FILE))
    return path


def publish_dir(path: Path, fill: Callable[[Path], object]) -> None:
    """Make directory ``path`` appear with what ``fill(directory)`` writes, whole: filled under a temp name in
    the same directory, then renamed, so no reader sees it half written. An existing ``path`` is filled in
    place (``fill`` replaces each file atomically)."""
    if path.is_dir():
        fill(path)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed writer of this pid
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def initial_policy(checkpoint_dir: Path) -> Path:
    """``checkpoint_dir/.initial/tiny_policy.npz``: the unchanged initial policy, written once per directory."""
    path = checkpoint_dir / ".initial" / POLICY_FILE
    if not path.exists():
        Policy.initial().save(path.parent)  # atomic: a reader never sees half a file
    return path


def link_initial_policy(checkpoint_dir: Path, step_dir: Path) -> None:
    """Put the initial policy's weights file (``initial_policy``) into ``step_dir``, hard-linked."""
    link_or_copy(initial_policy(checkpoint_dir), step_dir / POLICY_FILE)


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` becomes ``src``'s file: a hard link (no copy of the bytes), a copy where the two are on different
    filesystems (or links are not supported); replaced atomically (temp name, then rename)."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copyfile(src, tmp)
    tmp.replace(dst)


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
