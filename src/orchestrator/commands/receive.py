"""``orchestrator receive ADDRESS``: the reference trainer, for demos and debugging."""

from __future__ import annotations

import argparse

from orchestrator.cli import run_async

HELP = "run the reference trainer: receive batches, print a line per step, announce checkpoints"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="the orchestrator's batch address, e.g. ipc://outputs/demo/trainer.sock")
    p.add_argument("--train-s", type=float, default=0.0, help="seconds to 'train' per step before announcing")
    p.add_argument("--no-announce", action="store_true", help="never announce checkpoints")
    p.add_argument("--steps", type=int, default=None, help="exit after this many steps (default: run forever)")


def main(args: argparse.Namespace) -> int:
    from orchestrator.transport.trainer import ReferenceTrainer

    trainer = ReferenceTrainer(args.address, args.train_s, not args.no_announce, args.steps)
    run_async(trainer.run())
    return 0
