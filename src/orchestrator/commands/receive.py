"""``orchestrator receive ADDRESS``: the reference trainer, for demos and debugging."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from orchestrator.cli import run_async
from orchestrator.errors import ConfigError, KeyFileError

T = TypeVar("T")

HELP = "run the reference trainer: receive batches, print a line per step, announce checkpoints"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="the orchestrator's batch address, e.g. ipc://outputs/demo/trainer.sock")
    p.add_argument("--train-s", type=float, default=0.0, help="seconds to 'train' per step before announcing")
    p.add_argument("--no-announce", action="store_true", help="never announce checkpoints")
    p.add_argument("--steps", type=int, default=None, help="exit after this many steps (default: run forever)")
    p.add_argument("--journal", type=Path, default=None, metavar="FILE",
                   help="append a JSON line per step received; when restarted, resume after its last step")
    p.add_argument("--server-key", type=Path, default=None, metavar="FILE",
                   help="the orchestrator's public key file NAME.key (for a tcp:// address it binds with "
                        "[security] keys; with --client-key)")
    p.add_argument("--client-key", type=Path, default=None, metavar="FILE",
                   help="this trainer's secret key file NAME.key_secret; its public NAME.key must be in the "
                        "orchestrator's security.authorized_keys directory")


def main(args: argparse.Namespace) -> int:
    import zmq.asyncio

    from orchestrator.security import ClientKeys, load_key_pair, load_public_key
    from orchestrator.transport.trainer import ReferenceTrainer

    keys = None
    if args.server_key is not None or args.client_key is not None:
        if args.server_key is None or args.client_key is None:
            raise ConfigError(["--server-key / --client-key: give both (the orchestrator's public key and this "
                               "trainer's secret key) or neither"])
        if not args.address.startswith("tcp://"):
            raise ConfigError([f"--server-key / --client-key: {args.address} is not tcp://; the orchestrator "
                               "uses CURVE on tcp:// only (ipc:// is guarded by file permissions)"])
        keys = ClientKeys(_load("--server-key", load_public_key, args.server_key),
                          _load("--client-key", load_key_pair, args.client_key))
    trainer = ReferenceTrainer(args.address, args.train_s, not args.no_announce, args.steps, journal=args.journal,
                               keys=keys)
    try:
        run_async(trainer.run())
    finally:
        # The last acknowledgements may still be queued (their connection's handshake unfinished, e.g. CURVE
        # waiting on the orchestrator's authenticator). Socket linger only applies when the context is
        # terminated, and pyzmq does not terminate the shared one at exit: do it, so they go out first.
        zmq.asyncio.Context.instance().term()
    return 0


def _load(flag: str, load: Callable[[Path], T], path: Path) -> T:
    """A key file a flag names; a ConfigError (exit 2) naming the flag and the file if it is not usable."""
    try:
        return load(path)
    except KeyFileError as e:
        raise ConfigError([f"{flag}: {p}" for p in e.problems]) from None
