"""``orchestrator keys DIR [--name NAME]``: make a CURVE key pair for an orchestrator, env worker or trainer."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HELP = "make a CURVE key pair (NAME.key public, NAME.key_secret secret) for authenticated tcp:// links"

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path, metavar="DIR", help="where the key files go (created with mode 0700)")
    p.add_argument("--name", default="orchestrator",
                   help="base name of the key files, e.g. orchestrator, trainer, worker-host3 (default: orchestrator)")


def main(args: argparse.Namespace) -> int:
    from orchestrator.security import create_key_pair

    if not NAME.fullmatch(args.name):
        print(f"error: --name {args.name!r}: use letters, digits, '.', '_' and '-', starting with a letter or "
              "digit", file=sys.stderr)
        return 1
    try:
        public, secret = create_key_pair(args.directory, args.name)
    except FileExistsError as e:
        print(f"error: {e}; not overwriting keys (peers may hold the public half): remove them first, or choose "
              "another --name", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: cannot write keys in {args.directory}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"""\
wrote {public}  public: hand it to the peers that need it
wrote {secret}  secret (mode 0600): it stays on this host

Next, if these are the orchestrator's keys:
  in the job config:   [security]
                       server_key = "{secret}"
                       authorized_keys = "CLIENTS_DIR"  # each env worker's and trainer's public .key
  on each env worker and trainer host:  --server-key {public.name}  (a copy of {public})
If they are an env worker's or a trainer's keys:
  copy {public} into the orchestrator's authorized_keys directory (read when it starts)
  on this host:  --client-key {secret}  --server-key ORCHESTRATOR.key
  e.g. orchestrator receive tcp://ORCHESTRATOR_HOST:PORT --server-key orchestrator.key --client-key {secret}""")
    return 0
