"""``orchestrator env-worker --connect ADDRESS``: host environments for an orchestrator.

The orchestrator starts local workers itself; start this by hand on other hosts to add capacity
(``--connect tcp://ORCHESTRATOR_HOST:PORT``, the address in the orchestrator's startup log; with the
orchestrator's public key and this worker's key pair, ``--server-key`` / ``--client-key``, when it binds
tcp:// with ``[security]`` keys).
"""

from __future__ import annotations

import argparse
import os
import socket

from orchestrator.cli import run_async
from orchestrator.commands.client_keys import add_key_arguments, client_keys, zmq_address
from orchestrator.procs import name_process
from orchestrator.workers.zygote import WORKER_NAME

HELP = "run an env worker (verifiers environments) for an orchestrator"


def span_address(text: str) -> str:
    """An argparse type: ``tcp://HOST:PORT`` (port 0: any free one, logged; HOST not a wildcard: it is the address
    trainers are told to fetch from), else a usage error (exit 2)."""
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if (text.startswith("tcp://") and sep and host and host not in ("*", "0.0.0.0") and port.isdigit()
            and 0 <= int(port) < 65536):
        return text
    raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT with this host's address or name, which trainers "
                                     f"fetch from (not a wildcard; PORT 0: any free port), got {text!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", required=True, metavar="ADDRESS", type=zmq_address,
                   help="the orchestrator's worker address, e.g. tcp://10.0.0.1:5600 or ipc:///path/workers.sock")
    p.add_argument("--id", default=None, help="worker name in logs and metrics (default: host-pid)")
    p.add_argument("--nice", type=int, default=0, metavar="N",
                   help="add N to this process's niceness, so a busy host serves the orchestrator's loop first")
    p.add_argument("--span-address", default=None, metavar="ADDRESS", type=span_address,
                   help="data_plane = direct: serve this worker's column pool to trainers on other hosts here, "
                        "e.g. tcp://10.0.0.2:5700 (CURVE with --client-key when the orchestrator has [security] "
                        "keys; otherwise loopback only)")
    add_key_arguments(p, "env worker")
    # the hub's warm process (workers/zygote.py): imports once, then forks each local worker on request on this fd
    p.add_argument("--forks", type=int, default=None, metavar="FD", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    from orchestrator.workers.quiet import quiet_libraries

    name_process(WORKER_NAME)  # for ps and top: its command line is the interpreter's
    quiet_libraries()  # before verifiers (and transformers) are imported, below
    if args.nice:
        os.nice(args.nice)
    if args.forks is not None:
        from orchestrator.workers.zygote import serve

        parser = argparse.ArgumentParser(prog="orchestrator env-worker")
        add_arguments(parser)
        # returns in each forked worker, with its own command line (its niceness is this process's)
        args = parser.parse_args(serve(args.forks))
    from orchestrator.workers.process import Worker

    keys = client_keys(args, args.connect, "env worker")
    worker_id = args.id or f"{socket.gethostname()}-{os.getpid()}"
    return run_async(Worker(args.connect, worker_id, keys, span_address=args.span_address).run())
