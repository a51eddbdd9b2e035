"""Sealed memfd pools shared between processes of one node: create one, hand it out, map it read-only.

Both shared-memory designs use these: the orchestrator's step pool (``kind = "shm"``, shm.py) and each env
worker's column pool (the data plane, ``orchestrator.columns``).

- ``SealedMemfd(name, size)``: an anonymous ``memfd`` of ``size`` bytes, sealed against shrinking and growing
  (a reader may rely on the size: no SIGBUS), mapped read-write by its owner. It has no name in ``/dev/shm``:
  the kernel frees it when the last process holding it (fd or mapping) goes, however it goes.
- ``serve_pool(pool, path)``: hands the pool to whoever connects to the Unix socket ``path``: one message
  ``{"id", "size"}`` (msgpack) with a file descriptor attached (``SCM_RIGHTS``). The descriptor is opened
  read-only (through ``/proc/self/fd``), so a reader can map the pool but never write to it.
- ``map_served_pool(path, pool_id, size)``: the reader's side, blocking, briefly (a local socket, at most
  ``FETCH_TIMEOUT_S``): receive the descriptor, check id, size and seals, map it read-only, close it.

Who may connect to ``path`` is who may open the socket file: keep it in a directory only the job's user can
enter (the output directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import msgpack

from orchestrator.background import background
from orchestrator.errors import TransportError, WireError

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 5.0  # a reader's wait for the pool's fd (a local socket; the owner serves it from its loop)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, the last a NUL


class ServedPool(Protocol):
    """What ``serve_pool`` hands out: a pool's id, its size and its (read-write) fd."""

    @property
    def id(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def fd(self) -> int: ...


class SealedMemfd:
    """An anonymous, size-sealed memfd of ``size`` bytes mapped read-write (``view``: its bytes)."""

    def __init__(self, name: str, size: int) -> None:
        if size < 1:
            raise TransportError(f"a shared-memory pool needs at least one byte, got {size}")
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self.map = mmap.mmap(self.fd, size)
        except OSError as e:
            os.close(self.fd)
            raise TransportError(f"cannot create a {size}-byte shared-memory pool: {e}") from None

    def close(self) -> None:
        """Unmap and close; the memory lives on while another process maps it. A view still alive here keeps
        the mapping until it goes."""
        try:
            self.map.close()
        except BufferError:
            log.warning("shared-memory pool still viewed at close; it is unmapped when the view goes")
        os.close(self.fd)


def check_socket_path(path: str) -> None:
    """TransportError when ``path`` is too long for a Unix socket (the kernel would truncate it)."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise TransportError(f"the Unix socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter "
                             "output directory")


@contextlib.asynccontextmanager
async def serve_pool(pool: ServedPool, path: str) -> AsyncIterator[str]:
    """Hand ``pool``'s fd (read-only) to every process that connects to the Unix socket ``path`` (replacing a
    stale socket file), from a task this context owns; the socket file is removed on exit."""
    listener = _listen(path)
    try:
        async with background(("memfd-pool-server", _serve(pool, listener, path))):
            yield path
    finally:
        listener.close()
        _unlink(path)


def _listen(path: str) -> socket.socket:
    check_socket_path(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _unlink(path)  # a SIGKILLed owner's socket file (ZMQ's bind does the same)
        listener.bind(path)
        listener.listen(16)
        listener.setblocking(False)
    except OSError as e:
        listener.close()
        raise TransportError(f"cannot serve the shared-memory pool at {path}: {e}") from None
    return listener


def _unlink(path: str) -> None:
    Path(path).unlink(missing_ok=True)


async def _serve(pool: ServedPool, listener: socket.socket, path: str) -> None:
    """Consumes connections on ``path``; produces one message with a read-only fd of the pool (as it is at that
    moment) on each. Waits for the next connection; runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, _ = await loop.sock_accept(listener)
        except OSError as e:  # e.g. out of fds: a reader retries on its next batch
            log.warning("shared-memory pool socket %s: accept failed: %s", path, e)
            await asyncio.sleep(0.1)
            continue
        with conn:
            message = msgpack.packb({"id": pool.id, "size": pool.capacity})  # the pool now: its owner may renew it
            try:  # a few bytes into a fresh local socket's empty buffer: never blocks
                readonly = os.open(f"/proc/self/fd/{pool.fd}", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    socket.send_fds(conn, [message], [readonly])
                finally:
                    os.close(readonly)
            except OSError as e:
                log.warning("could not hand the shared-memory pool to a reader on %s: %s", path, e)


def map_served_pool(path: str, pool_id: str, size: int) -> mmap.mmap:
    """Blocking, briefly (at most FETCH_TIMEOUT_S): the pool served at ``path``, checked to be ``pool_id`` of
    ``size`` bytes and sealed, mapped read-only; its fd is closed. WireError saying what is wrong otherwise."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(FETCH_TIMEOUT_S)
            s.connect(path)
            raw, fds, _flags, _addr = socket.recv_fds(s, 1024, 1)
    except OSError as e:
        raise WireError(f"cannot fetch shared-memory pool {pool_id} from {path}: {e}") from None
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise WireError(f"{path} sent {len(fds)} file descriptors, expected the pool's one")
    fd = fds[0]
    try:
        meta = msgpack.unpackb(raw, raw=False)
        if not isinstance(meta, dict) or meta.get("id") != pool_id or meta.get("size") != size:
            got = (meta.get("id"), meta.get("size")) if isinstance(meta, dict) else (meta, None)
            raise WireError(f"{path} serves pool {got[0]} ({got[1]} bytes), expected {pool_id} ({size} bytes): "
                            "its owner restarted in between?")
        if os.fstat(fd).st_size != size or fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise WireError(f"pool {pool_id} from {path} is not a sealed {size}-byte memfd")
        return mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (ValueError, TypeError, OSError, msgpack.UnpackException) as e:
        raise WireError(f"bad shared-memory pool from {path}: {e}") from None
    finally:
        os.close(fd)  # the mapping keeps the memory alive
