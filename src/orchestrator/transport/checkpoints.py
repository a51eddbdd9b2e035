"""Checkpoint announcements: the trainer says which weights are ready, and where they are.

A ``Checkpoint`` is a step and, optionally, the directory of its weights (else ``inference.weights_path``
names it). The trainer announces one over the ZMQ link (``{"checkpoint": N, "path": P}``, see zmq_link.py)
or as a marker file ``step_<N>.ready`` in a directory (``write_marker``; the file holds the path, UTF-8, or
nothing). Importable without verifiers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Checkpoint:
    """Weights the trainer announced: its step, and where they are (None: ``inference.weights_path`` says)."""

    step: int
    path: str | None = None


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
