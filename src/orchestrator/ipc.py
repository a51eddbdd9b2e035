"""The files behind ``ipc://`` endpoints: whoever binds one makes its directory and removes its file.

libzmq (4.3.5, checked) creates the socket file on ``bind`` and leaves it after ``close``, ``unbind`` and
``term``: without ``remove``, every clean run would leave ``workers.sock``, ``trainer.sock`` and
``trainer.sock.ckpt`` in its output directory. A SIGKILLed run's files stay; the next ``bind`` replaces them
(libzmq unlinks a stale file first). ``tcp://`` addresses have no file: both functions do nothing for them.
"""

from __future__ import annotations

from pathlib import Path

PREFIX = "ipc://"


def ipc_path(address: str) -> Path | None:
    """The socket file of an ``ipc://`` address; None for any other transport."""
    return Path(address.removeprefix(PREFIX)) if address.startswith(PREFIX) else None


def prepare(address: str) -> None:
    """Before binding: make the socket file's directory."""
    if (path := ipc_path(address)) is not None:
        path.parent.mkdir(parents=True, exist_ok=True)


def remove(address: str) -> None:
    """After closing the socket that bound ``address`` (and terminating its context): remove its file."""
    if (path := ipc_path(address)) is not None:
        path.unlink(missing_ok=True)
