"""``orchestrator receive ADDRESS``: the reference trainer, for demos and debugging."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.cli import run_async

HELP = "run the reference trainer: receive batches, print a line per step, announce checkpoints"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="the orchestrator's batch address, e.g. ipc://outputs/demo/trainer.sock")
    p.add_argument("--train-s", type=float, default=0.0, help="seconds to 'train' per step before announcing")
    p.add_argument("--no-announce", action="store_true", help="never announce checkpoints")
    p.add_argument("--steps", type=int, default=None, help="exit after this many steps (default: run forever)")
    p.add_argument("--journal", type=Path, default=None, metavar="FILE",
                   help="append a JSON line per step received; when restarted, resume after its last step")


def main(args: argparse.Namespace) -> int:
    from orchestrator.transport.trainer import ReferenceTrainer

    trainer = ReferenceTrainer(args.address, args.train_s, not args.no_announce, args.steps, journal=args.journal)
    run_async(trainer.run())
    return 0
