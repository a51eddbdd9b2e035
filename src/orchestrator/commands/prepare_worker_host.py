"""``orchestrator prepare-worker-host DIR``: make a host ready to run verifiers' own harnesses offline.

Run it once per worker host (and again after upgrading verifiers) while PyPI can be reached; with
``--no-download`` it only re-indexes wheels already in ``DIR/wheels`` (copied from another host). Then
``source DIR/env.sh`` before ``orchestrator run`` (local env workers inherit it) or ``orchestrator env-worker``.
What it downloads and writes: ``orchestrator.workers.host``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "prepare a worker host for verifiers' uv harnesses and TextArena offline (wheel index, NLTK words)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path, metavar="DIR", help="where the kit goes, e.g. ~/.cache/orchestrator-worker")
    p.add_argument("--no-download", dest="download", action="store_false",
                   help="do not download: index the wheels already in DIR/wheels")
    p.add_argument("--package", dest="packages", action="append", default=[], metavar="REQ",
                   help="also put REQ (and its dependencies) in the index, e.g. for another harness's script "
                        "(repeatable)")


def main(args: argparse.Namespace) -> int:
    from orchestrator.workers.host import prepare

    env = prepare(args.directory, download=args.download, extra=args.packages)
    directory = args.directory.resolve()
    wheels = len(list((directory / "wheels").glob("*.whl")))
    print(f"{directory}: {wheels} wheels indexed in {directory / 'simple'}"
          + (f", NLTK words in {env['NLTK_DATA']}" if "NLTK_DATA" in env else " (no textarena: no NLTK words)"))
    print(f"next: source {directory / 'env.sh'}  (before `orchestrator run` or `orchestrator env-worker`)")
    return 0
