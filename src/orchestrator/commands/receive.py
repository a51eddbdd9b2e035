"""``orchestrator receive ADDRESS``: the reference trainer, for demos and debugging; ``--learn`` trains the tiny
policy the simulated servers sample from."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orchestrator.cli import run_async
from orchestrator.commands.client_keys import add_key_arguments, client_keys, file_path, zmq_address

HELP = "run the reference trainer: receive batches, print a line per step, announce checkpoints"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", type=zmq_address, help="the orchestrator's batch address, e.g. ipc://outputs/demo/trainer.sock")
    p.add_argument("--train-s", type=float, default=0.0, help="seconds to 'train' per step before announcing")
    p.add_argument("--no-announce", action="store_true", help="never announce checkpoints")
    p.add_argument("--steps", type=int, default=None, help="exit after this many steps (default: run forever)")
    p.add_argument("--journal", type=file_path, default=None, metavar="FILE",
                   help="append a JSON line per step received; when restarted, resume after its last step")
    add_key_arguments(p, "trainer")
    p.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help="announce checkpoint N with the directory DIR/step_N, written whole: the unchanged "
                        "initial policy (hard-linked to one copy in DIR/.initial), or with --learn what it "
                        "learned; without it the orchestrator's inference.weights_path names the weights")
    p.add_argument("--learn", action="store_true",
                   help="train the simulated servers' tiny policy on every batch (clipped policy-gradient steps) "
                        "and save it into each checkpoint directory (needs --checkpoint-dir)")
    p.add_argument("--lr", type=float, default=None, help="--learn: step size (default: 1.0)")
    p.add_argument("--passes", type=int, default=None, help="--learn: gradient steps per batch (default: 2)")
    p.add_argument("--temperature", type=float, default=None,
                   help="--learn: the sampling temperature of batches that carry none (default: 1.0)")


def main(args: argparse.Namespace) -> int:
    import zmq.asyncio

    from orchestrator.transport.learner import LearnConfig, PolicyLearner
    from orchestrator.transport.trainer import ReferenceTrainer

    if args.learn and (args.checkpoint_dir is None or args.no_announce):
        print("receive: --learn needs --checkpoint-dir (it saves the policy there) and announcements",
              file=sys.stderr)
        return 2
    given = {k: v for k in ("lr", "passes", "temperature") if (v := getattr(args, k)) is not None}
    try:
        config = LearnConfig(**given)
    except ValueError as e:
        print(f"receive: {e}", file=sys.stderr)
        return 2
    keys = client_keys(args, args.address, "trainer")
    learner = PolicyLearner(config) if args.learn else None
    trainer = ReferenceTrainer(args.address, args.train_s, not args.no_announce, args.steps, journal=args.journal,
                               keys=keys, checkpoint_dir=args.checkpoint_dir, learner=learner)
    try:
        run_async(trainer.run())
    finally:
        # The last acknowledgements may still be queued (their connection's handshake unfinished, e.g. CURVE
        # waiting on the orchestrator's authenticator). Socket linger only applies when the context is
        # terminated, and pyzmq does not terminate the shared one at exit: do it, so they go out first.
        zmq.asyncio.Context.instance().term()
    return 0
