"""``orchestrator receive ADDRESS``: the reference trainer, for demos and debugging; ``--learn`` trains the tiny
policy the simulated servers sample from, ``--torch-model DIR`` a real Hugging Face model with PyTorch (the
``[torch]`` extra; trainer/torch_learner.py), reporting every step how far the shipped logprobs are from its own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli import run_async
from orchestrator.commands.client_keys import add_key_arguments, client_keys, file_path, zmq_address
from orchestrator.commands.run import interruptible

if TYPE_CHECKING:
    from orchestrator.trainer.broadcast import WeightBroadcaster
    from orchestrator.trainer.reference import BroadcastLearner

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
    p.add_argument("--torch-model", type=Path, default=None, metavar="DIR",
                   help="train this Hugging Face causal-LM directory with PyTorch on every batch, report the "
                        "train/inference logprob mismatch per step, and save safetensors checkpoints (needs "
                        "--checkpoint-dir and the [torch] extra)")
    p.add_argument("--device", default="cpu", help="--torch-model: torch device (cuda for GPUs; untested here)")
    p.add_argument("--lr", type=float, default=None,
                   help="--learn: step size (default: 1.0); --torch-model: AdamW's (default: 1e-6)")
    p.add_argument("--passes", type=int, default=None,
                   help="gradient steps per batch (default: --learn 2, --torch-model 1)")
    p.add_argument("--temperature", type=float, default=None,
                   help="the sampling temperature of batches that carry none (default: 1.0)")
    p.add_argument("--broadcast", nargs="?", const="gloo", default=None, choices=["gloo", "nccl"],
                   help="send the weights to the inference servers when the orchestrator asks ([inference] "
                        "weight_transfer = 'broadcast'): over gloo (default; CPUs; needs torch) or vLLM's nccl "
                        "(GPUs; needs vLLM; not tested here): the learner's, else the unchanged initial policy")
    p.add_argument("--save-every", type=int, default=1, metavar="K",
                   help="write a checkpoint directory only every K steps (with --broadcast: what servers that join "
                        "late load, and what a restarted trainer resumes from; default: every step)")


def main(args: argparse.Namespace) -> int:
    import zmq.asyncio

    from orchestrator.trainer.reference import ReferenceTrainer

    learns = args.learn or args.torch_model is not None
    if args.learn and args.torch_model is not None:
        print("receive: --learn and --torch-model are two learners: choose one", file=sys.stderr)
        return 2
    if learns and (args.checkpoint_dir is None or args.no_announce):
        print("receive: --learn and --torch-model need --checkpoint-dir (the weights are saved there) and "
              "announcements", file=sys.stderr)
        return 2
    given = {k: v for k in ("lr", "passes", "temperature") if (v := getattr(args, k)) is not None}
    try:
        learner = _learner(args, given) if learns else None
    except (ValueError, OSError, ImportError) as e:
        print(f"receive: {e}", file=sys.stderr)
        return 2
    if args.save_every < 1:
        print("receive: --save-every must be at least 1", file=sys.stderr)
        return 2
    try:
        broadcaster = broadcaster_of(learner, args.broadcast) if args.broadcast else None
    except ImportError as e:
        print(f"receive: {e}", file=sys.stderr)
        return 2
    keys = client_keys(args, args.address, "trainer")
    trainer = ReferenceTrainer(args.address, args.train_s, not args.no_announce, args.steps, journal=args.journal,
                               keys=keys, checkpoint_dir=args.checkpoint_dir, learner=learner,
                               broadcaster=broadcaster, save_every=args.save_every)
    try:  # SIGINT/SIGTERM (scancel): the step in hand is journaled and acknowledged or not at all; exit 130
        return run_async(interruptible(trainer.run()))
    finally:
        # The last acknowledgements may still be queued (their connection's handshake unfinished, e.g. CURVE
        # waiting on the orchestrator's authenticator). Socket linger only applies when the context is
        # terminated, and pyzmq does not terminate the shared one at exit: do it, so they go out first.
        zmq.asyncio.Context.instance().term()


def broadcaster_of(learner: BroadcastLearner | None, backend: str = "gloo") -> WeightBroadcaster:
    """The ``backend`` broadcaster of ``learner``'s weights (none: the unchanged initial policy's)."""
    try:
        from orchestrator.trainer.gloo_broadcast import GlooBroadcaster, as_tensor
        from orchestrator.trainer.nccl_broadcast import NcclBroadcaster
    except ImportError as e:
        raise ImportError(f"--broadcast needs torch: pip install -e '.[torch]' ({e})") from None
    if learner is not None:
        weights = learner.weights
    else:
        from orchestrator.policy import Policy

        initial = {k: as_tensor(v) for k, v in Policy.initial().weights.items()}
        weights = lambda: initial  # noqa: E731
    return NcclBroadcaster(weights) if backend == "nccl" else GlooBroadcaster(weights)


def _learner(args: argparse.Namespace, given: dict[str, Any]) -> BroadcastLearner:
    """The learner the flags name: the tiny policy's (--learn) or a real model's (--torch-model)."""
    if args.torch_model is None:
        from orchestrator.trainer.learner import LearnConfig, PolicyLearner

        return PolicyLearner(LearnConfig(**given))
    try:
        from orchestrator.trainer.torch_learner import TorchLearnConfig, TorchLearner
    except ImportError as e:
        raise ImportError(f"--torch-model needs torch and transformers: pip install -e '.[torch]' ({e})") from None
    if not (args.torch_model / "config.json").is_file():
        raise OSError(f"--torch-model {args.torch_model}: no config.json there (a Hugging Face model directory)")
    return TorchLearner(args.torch_model, TorchLearnConfig(**given, device=args.device))
