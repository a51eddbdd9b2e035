"""Checkpoint sources: how the trainer says which weights are ready, and where they are.

A ``Checkpoint`` is a step and, optionally, the directory of its weights (else ``inference.weights_path``
names it). Three sources, one per kind of trainer:

- **ZMQ announcements** (``{"checkpoint": N, "path": P}`` on the trainer channel, see zmq_link.py): the sender's
  reader offers each to a ``CheckpointFeed``.
- **Marker files** ``step_<N>.ready`` in a directory (``write_marker``; the file holds the path, UTF-8, or
  nothing): ``marker_announcements`` yields each once, in increasing order.
- **prime-rl broadcasts**: prime-rl's trainer writes the weights of its step N into
  ``<trainer_dir>/broadcasts/step_N/`` and touches ``STABLE`` in it when the directory is complete
  (``src/prime_rl/transports/weights/filesystem.py`` at prime-rl 559b447); ``latest_broadcast`` finds the
  newest complete one, which becomes ``Checkpoint(N, that directory)``. The trainer deletes old ones (all but
  the newest two), so a reader that falls behind jumps to the newest, as prime-rl's own watcher does.

A ``CheckpointFeed`` keeps only the newest checkpoint offered: a weight sync that falls behind loads the newest
weights next, never a backlog of older ones (whose directories may be gone). Importable without verifiers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

BROADCASTS = "broadcasts"
STABLE = "STABLE"


@dataclass(frozen=True)
class Checkpoint:
    """Weights the trainer announced: its step, and where they are (None: ``inference.weights_path`` says)."""

    step: int
    path: str | None = None


class CheckpointFeed:
    """The newest checkpoint offered so far; ``updates()`` yields it each time a newer one arrives."""

    def __init__(self) -> None:
        self.latest: Checkpoint | None = None
        self._offered = asyncio.Event()  # set on every newer offer; each waiter checks ``latest`` itself

    def offer(self, ckpt: Checkpoint) -> bool:
        """Keep ``ckpt`` if it is newer than the latest (a repeat or an older step is ignored); whether it was."""
        if self.latest is not None and ckpt.step <= self.latest.step:
            return False
        self.latest = ckpt
        self._offered.set()
        return True

    async def newer(self, step: int) -> Checkpoint:
        """The latest checkpoint as soon as it is newer than ``step`` (at once if it is). Safe to cancel (a
        wait under a timeout), unlike a step of ``updates()``, which ends the generator."""
        while self.latest is None or self.latest.step <= step:
            self._offered.clear()
            await self._offered.wait()
        return self.latest

    async def updates(self) -> AsyncIterator[Checkpoint]:
        """The latest checkpoint now (if any), then each newer one; a slow consumer skips to the newest."""
        seen = -1
        while True:
            ckpt = await self.newer(seen)
            seen = ckpt.step
            yield ckpt


def write_marker(directory: Path, step: int, path: str | None = None) -> Path:
    """Announce checkpoint ``step`` (weights in ``path``) with a marker file, atomically (temp file, rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / f"step_{step}.ready"
    tmp = directory / f".step_{step}.{os.getpid()}.tmp"
    tmp.write_text(path or "")
    tmp.replace(marker)
    return marker


async def marker_announcements(marker_dir: Path, poll_s: float = 0.1) -> AsyncIterator[Checkpoint]:
    """Checkpoints announced as marker files ``step_<N>.ready`` in ``marker_dir`` (``write_marker``), each once,
    in increasing order; polls the directory in a worker thread every ``poll_s``."""
    seen = -1
    while True:
        found = await asyncio.to_thread(_markers, marker_dir, seen)
        for ckpt in found:
            seen = ckpt.step
            yield ckpt
        await asyncio.sleep(poll_s)


def _markers(marker_dir: Path, after: int) -> list[Checkpoint]:
    out = []
    for p in marker_dir.glob("step_*.ready"):
        digits = p.stem.removeprefix("step_")
        if digits.isdigit() and int(digits) > after:
            try:
                path = p.read_text().strip() or None
            except (OSError, UnicodeDecodeError):  # unreadable: the weights_path template names it
                path = None
            out.append(Checkpoint(int(digits), path))
    return sorted(out, key=lambda c: c.step)


def broadcast_dir(trainer_dir: Path, step: int) -> Path:
    """Where prime-rl's trainer writes the weights of its step ``step``."""
    return trainer_dir / BROADCASTS / f"step_{step}"


def broadcast_steps(trainer_dir: Path) -> list[int]:
    """The steps of every ``broadcasts/step_N`` directory, complete or not, ascending (blocking: a listing)."""
    try:
        entries = list(os.scandir(trainer_dir / BROADCASTS))
    except FileNotFoundError:
        return []
    steps = [e.name.removeprefix("step_") for e in entries if e.name.startswith("step_")]
    return sorted(int(s) for s in steps if s.isdigit())


def latest_broadcast(trainer_dir: Path) -> Checkpoint | None:
    """The newest ``broadcasts/step_N`` holding ``STABLE``, as ``Checkpoint(N, absolute path)`` (blocking)."""
    for step in reversed(broadcast_steps(trainer_dir)):
        path = broadcast_dir(trainer_dir, step)
        if (path / STABLE).exists():
            return Checkpoint(step, str(path.resolve()))
    return None
