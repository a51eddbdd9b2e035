"""``--server-key`` / ``--client-key``: the CURVE flags of every command that connects to an orchestrator
(``receive``, ``env-worker``). Not a subcommand."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from orchestrator.errors import ConfigError, KeyFileError
from orchestrator.security import LOCAL_KEYS_ENV, ClientKeys, KeyPair

T = TypeVar("T")


def zmq_address(text: str) -> str:
    """An argparse type: ``tcp://HOST:PORT`` or ``ipc://PATH``, else a usage error (exit 2) saying so."""
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if text.startswith("tcp://") and sep and host and port.isdigit() and 0 < int(port) < 65536:
        return text
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT or ipc://PATH (as the orchestrator logs it at "
                                     f"start), got {text!r}")


def file_path(text: str) -> Path:
    """An argparse type: a path for a file this command writes (not a directory, in a directory that exists)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path, e.g. {path / 'journal.jsonl'}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its directory {path.parent} does not exist")
    return path


def add_key_arguments(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument("--server-key", type=Path, default=None, metavar="FILE",
                   help="the orchestrator's public key file NAME.key (for a tcp:// address it binds with "
                        "[security] keys; with --client-key)")
    p.add_argument("--client-key", type=Path, default=None, metavar="FILE",
                   help=f"this {who}'s secret key file NAME.key_secret; its public NAME.key must be in the "
                        "orchestrator's security.authorized_keys directory")


def client_keys(args: argparse.Namespace, address: str, who: str) -> ClientKeys | None:
    """The keys the flags name (ConfigError naming the flag and file if unusable), else the ones a local
    worker's environment holds, else None."""
    from orchestrator.security import load_key_pair, load_public_key

    if args.server_key is None and args.client_key is None:
        local = [os.environ.pop(name, "") for name in LOCAL_KEYS_ENV]  # popped: children do not inherit them
        return ClientKeys(local[0].encode(), KeyPair(local[1].encode(), local[2].encode())) if all(local) else None
    if args.server_key is None or args.client_key is None:
        raise ConfigError([f"--server-key / --client-key: give both (the orchestrator's public key and this {who}'s "
                           "secret key) or neither"])
    if not address.startswith("tcp://"):
        raise ConfigError([f"--server-key / --client-key: {address} is not tcp://; the orchestrator uses CURVE on "
                           "tcp:// only (ipc:// is guarded by file permissions)"])
    return ClientKeys(_load("--server-key", load_public_key, args.server_key),
                      _load("--client-key", load_key_pair, args.client_key))


def _load(flag: str, load: Callable[[Path], T], path: Path) -> T:
    """A key file a flag names; a ConfigError (exit 2) naming the flag and the file if it is not usable."""
    try:
        return load(path)
    except KeyFileError as e:
        raise ConfigError([f"{flag}: {p}" for p in e.problems]) from None
