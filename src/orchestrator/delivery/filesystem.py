"""Filesystem transport: the wire-format frames of a step in one file, for clusters without a direct link.

Layout of ``step_{step:08d}.batch`` (see docs/wire-format.md, "On disk"): the magic ``ORCHBAT1``, a
little-endian uint64 frame count ``k``, ``k`` little-endian uint64 frame lengths, then the frames
(header first, as ``wire.encode`` makes them), each starting at a multiple of 64 bytes so the receiver's
arrays are aligned.

Orchestrator side, ``FileBatchSender(directory)``: ``await send(batch)`` writes the file in a worker thread
(temp file in the same directory, fsync, ``os.replace``, fsync of the directory), so a reader never sees
a partial file and the event loop never blocks. Back-pressure: at most ``max_pending`` un-consumed
``*.batch`` files may exist; ``send`` waits (polling every ``poll_s``, warning every ``warn_s``) while
there are that many, and never drops a step. Each step is written once, in order; a step that is not
the next one, or whose file already exists, is refused with DuplicateStep.

Trainer side, ``FileBatchReceiver(directory)``: ``recv(timeout)`` (sync) or ``await arecv()`` returns the
next step's ``Batch``; files are read in step order, mapped with ``mmap`` and decoded without copies
(the arrays view the map, which stays valid after the file is deleted). A consumed file is deleted (or
renamed to ``*.batch.done`` with ``keep_done=True``). A corrupt or truncated file raises
CorruptBatchFile inside, is counted in ``rejected``, moved aside to ``*.batch.rejected``, and the
receiver continues with the next step; so are duplicates (DuplicateStep). When the next step's file is
missing but later ones exist, the receiver waits for it (logging an error every ``warn_s``): it never
skips ahead silently. Checkpoint announcements use marker files (``zmq_link.write_marker``).

Importable without verifiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import re
import struct
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from orchestrator.contracts.checkpoints import Checkpoint, marker_announcements
from orchestrator.contracts.wire import Batch, decode, encode
from orchestrator.delivery.sender import Sender
from orchestrator.errors import DuplicateStep, TransportError, WireError

log = logging.getLogger(__name__)

MAGIC = b"ORCHBAT1"
ALIGN = 64
MAX_FRAMES = 1 << 16  # far above any real batch (one frame per column); guards a corrupt count
_NAME = re.compile(r"step_(\d+)\.batch")


class CorruptBatchFile(WireError):
    """A batch file that cannot be decoded: bad magic, truncated, or frames the wire format rejects."""


def batch_path(directory: Path, step: int) -> Path:
    """The file that holds ``step``."""
    return directory / f"step_{step:08d}.batch"


def pending_steps(directory: Path) -> dict[int, Path]:
    """Un-consumed batch files in ``directory`` by step (temp, done and rejected files are not listed)."""
    out: dict[int, Path] = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return out
    for entry in entries:
        m = _NAME.fullmatch(entry.name)
        if m:
            out[int(m.group(1))] = Path(entry.path)
    return out


def _layout(lengths: list[int]) -> tuple[int, list[int]]:
    """Offsets of each frame in the file and the file's total size."""
    pos = len(MAGIC) + 8 + 8 * len(lengths)
    starts = []
    for n in lengths:
        pos = -(-pos // ALIGN) * ALIGN
        starts.append(pos)
        pos += n
    return pos, starts


def write_frame_file(path: Path, frames: Iterable[Any], *, magic: bytes = MAGIC, durable: bool = True) -> int:
    """Write ``frames`` (bytes, memoryviews, contiguous arrays) as a frame file; returns its size in bytes.
    ``durable``: atomically (temp file in the same directory, fsync, rename, fsync of the directory);
    otherwise straight to ``path`` (step dumps, whose directory is renamed into place as a whole)."""
    views = [memoryview(f) for f in frames]
    for i, v in enumerate(views):
        if not v.c_contiguous:
            raise ValueError(f"{path}: frame {i} is not C-contiguous; nothing written")
    views = [v.cast("B") for v in views]
    lengths = [v.nbytes for v in views]
    size, starts = _layout(lengths)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp") if durable else path
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if durable else os.O_TRUNC), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(magic + struct.pack(f"<Q{len(lengths)}Q", len(lengths), *lengths))
            for view, start in zip(views, starts, strict=True):
                f.write(b"\0" * (start - f.tell()))
                f.write(view)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if durable:
            tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return size


def read_frame_file(path: Path, *, magic: bytes = MAGIC, error: type[WireError] = CorruptBatchFile
                    ) -> list[memoryview]:
    """Map a frame file and return its frames as views of the map (page-aligned, so every frame is
    64-byte aligned); ``error`` (naming the file) if it is not one or is truncated."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < len(magic) + 8:
            raise error(f"{path}: {size} bytes, shorter than the file header")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mapped)  # frames are slices of it; it is unmapped when the last one is freed
    if view[: len(magic)] != magic:
        raise error(f"{path}: bad magic {bytes(view[:len(magic)])!r}, expected {magic!r}")
    (count,) = struct.unpack_from("<Q", view, len(magic))
    if not 1 <= count <= MAX_FRAMES or size < len(magic) + 8 + 8 * count:
        raise error(f"{path}: frame count {count} does not fit a {size}-byte file")
    lengths = list(struct.unpack_from(f"<{count}Q", view, len(magic) + 8))
    end, starts = _layout(lengths)
    if end != size:
        raise error(f"{path}: {size} bytes, its frame table implies {end} (truncated or padded)")
    return [view[a:a + n] for a, n in zip(starts, lengths, strict=True)]


def write_batch_file(path: Path, frames: list[Any]) -> int:
    """Write a batch's wire frames to ``path`` atomically; bytes written."""
    return write_frame_file(path, frames)


def read_batch_file(path: Path) -> Batch:
    """Map ``path`` and decode it without copies; CorruptBatchFile (naming the file) if it is invalid."""
    frames = read_frame_file(path)
    try:
        return decode(frames)
    except WireError as e:
        raise CorruptBatchFile(f"{path}: {e}") from None


class FileBatchSender(Sender[None]):
    """Orchestrator side: one file per step in ``directory``; at most ``max_pending`` un-consumed files.

    A step counts as acknowledged once its file is durably in the directory (the trainer will find it there),
    so ``acked`` is the last step written and ``unacked`` is always empty: nothing is kept in memory. The bound
    is the directory's: ``send`` waits while ``max_pending`` files are not consumed. With ``resume``, a step
    whose file is already there is adopted, not written again (``send`` returns False); without it, leftover
    batch files are refused at start, as they belong to another run. Checkpoints are announced with marker
    files (``marker_announcements``)."""

    kind = "filesystem"

    def __init__(self, directory: str | Path, *, max_pending: int = 2, warn_s: float = 30.0,
                 poll_s: float = 0.05, resume: bool = False) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        super().__init__(str(directory), max_pending, warn_s)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_pending, self.poll_s = max_pending, poll_s
        self.resume = resume
        self.marker_dir: Path | None = None  # where checkpoints are announced (set by ``announcements``)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, directory: str | Path, max_pending: int = 2, *, resume: bool = False, warn_s: float = 30.0
                   ) -> AsyncIterator[FileBatchSender]:
        """A sender for the orchestrator; TransportError if ``directory`` holds another run's batch files."""
        sender = cls(directory, max_pending=max_pending, resume=resume, warn_s=warn_s)
        leftover = await asyncio.to_thread(pending_steps, sender.directory)
        if leftover and not resume:
            raise TransportError(f"{sender.directory} holds batch files of steps {sorted(leftover)[:5]} from an "
                                 "earlier run: remove them, or pass --resume to continue that run")
        yield sender
        pending = await asyncio.to_thread(pending_steps, sender.directory)
        if pending:
            log.info("closing with %d batch files not yet read by the trainer in %s", len(pending), sender.directory)

    def announcements(self, marker_dir: Path | None = None) -> AsyncIterator[Checkpoint]:
        """Checkpoint steps from marker files (the filesystem transport has no message channel)."""
        if marker_dir is None:
            raise TransportError("the filesystem transport needs transport.checkpoint_source = 'marker'")
        self.marker_dir = marker_dir
        return marker_announcements(marker_dir)

    def checkpoint_wanted(self, policy: int) -> str:
        """No channel to ask on: says where the marker files are expected."""
        return (f"the trainer announces checkpoints as marker files step_<N>.ready in {self.marker_dir} "
                f"(write_marker); none of step >= {policy} has been read")

    async def _delivered_before(self, step: int) -> bool:
        return self.resume and await asyncio.to_thread(batch_path(self.directory, step).exists)

    async def _wait_room(self, step: int) -> None:
        """Wait (never drop) while ``max_pending`` files are not yet consumed, re-counting them every ``poll_s``
        in a worker thread, warning every ``warn_s``."""
        loop = asyncio.get_running_loop()
        started = warned = loop.time()
        try:
            while len(await asyncio.to_thread(pending_steps, self.directory)) >= self.max_pending:
                self.waiting = True
                await asyncio.sleep(self.poll_s)
                now = loop.time()
                if now - warned >= self.warn_s:
                    warned = now
                    log.warning("trainer has not consumed the %d batch files in %s for %.0f s; step %d waits",
                                self.max_pending, self.directory, now - started, step)
        finally:
            self.waiting = False

    async def _deliver(self, batch: Batch) -> tuple[None, int]:
        """The step's file, written in a worker thread; nothing to keep (the file is durable)."""
        return None, await asyncio.to_thread(self._write, batch)

    def _recorded(self, step: int) -> None:
        self.window.acknowledge(step)  # durably in the directory: the trainer will find it

    def _write(self, batch: Batch) -> int:
        path = batch_path(self.directory, batch.step)
        if path.exists():
            raise DuplicateStep(f"refusing to write step {batch.step}: {path} already exists")
        return write_batch_file(path, encode(batch))


class FileBatchReceiver:
    """Trainer side: the next step's batch from ``directory``; invalid files are counted in ``rejected``.

    Not thread-safe: call ``recv`` / ``arecv`` from one task or thread at a time.
    """

    def __init__(self, directory: str | Path, *, next_step: int | None = None, keep_done: bool = False,
                 poll_s: float = 0.05, warn_s: float = 30.0) -> None:
        self.directory = Path(directory)
        self.next_step = next_step  # None: start at the lowest step present
        self.keep_done, self.poll_s, self.warn_s = keep_done, poll_s, warn_s
        self.last_step: int | None = None
        self.rejected: dict[str, int] = {}
        self._gap_logged = 0.0

    def recv(self, timeout: float | None = None) -> Batch:
        """The next step's batch; blocks, polling every ``poll_s``; TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self.try_recv()
            if batch is not None:
                return batch
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no batch for step {self.next_step} in {self.directory} after {timeout} s")
            time.sleep(self.poll_s)

    async def arecv(self) -> Batch:
        """``recv`` for asyncio: each poll runs in a worker thread; cancellation is safe between polls."""
        while True:
            batch = await asyncio.to_thread(self.try_recv)
            if batch is not None:
                return batch
            await asyncio.sleep(self.poll_s)

    def try_recv(self) -> Batch | None:
        """The next step's batch if its file is there, else None; rejects invalid files on the way."""
        while True:
            files = pending_steps(self.directory)
            for step in sorted(s for s in files if self.next_step is not None and s < self.next_step):
                old = files.pop(step)
                self._reject(old, DuplicateStep(f"{old}: step {step} is a duplicate: the next step is "
                                                 f"{self.next_step} (last received: {self.last_step})"))
            if not files:
                return None
            step = self.next_step if self.next_step is not None else min(files)
            path = files.get(step)
            if path is None:
                # the sender writes in order, so a later file without this one means this step went missing
                # (or was written while the directory was being listed: a second listing settles that)
                if step not in pending_steps(self.directory):
                    self._log_gap(step, files)
                return None
            try:
                batch = read_batch_file(path)
                if batch.step != step:
                    raise CorruptBatchFile(f"{path}: holds step {batch.step}, its name says {step}")
            except FileNotFoundError:
                return None  # removed under us (another reader?); look again next poll
            except (CorruptBatchFile, OSError) as e:
                error = e if isinstance(e, CorruptBatchFile) else CorruptBatchFile(f"{path}: unreadable: {e}")
                self._reject(path, error)
                self.next_step = step + 1  # the step is lost, counted and logged; keep going
                continue
            self._consumed(path)
            self.last_step, self.next_step = step, step + 1
            return batch

    def _consumed(self, path: Path) -> None:
        if self.keep_done:
            path.replace(path.with_name(path.name + ".done"))
        else:
            path.unlink(missing_ok=True)

    def _reject(self, path: Path, error: WireError) -> None:
        key = type(error).__name__
        self.rejected[key] = self.rejected.get(key, 0) + 1
        log.error("rejected a batch file: %s (moved aside to %s.rejected)", error, path.name)
        try:
            path.replace(path.with_name(path.name + ".rejected"))
        except FileNotFoundError:
            pass

    def _log_gap(self, step: int, files: dict[int, Path]) -> None:
        now = time.monotonic()
        if self._gap_logged == 0.0 or now - self._gap_logged >= self.warn_s:
            self._gap_logged = now
            log.error("step %d is missing from %s while later steps %s wait; not skipping it",
                      step, self.directory, sorted(files)[:5])
