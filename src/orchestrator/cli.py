"""The ``orchestrator`` command line: a thin entry point.

Each subcommand lives in ``orchestrator.commands.<name>`` and exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``main(args) -> int``. Command modules import their heavy dependencies
inside ``main`` so ``orchestrator check`` and ``--help`` stay fast. Logging handlers are set here only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.procs import die_with_parent

T = TypeVar("T")

# subcommand -> module under orchestrator.commands
COMMANDS = {
    "check": "check",
    "sim-inference": "sim_inference",
    "env-worker": "env_worker",
    "run": "run",
    "eval": "eval",
    "demo": "demo",
    "receive": "receive",
    "real-stack": "real_stack",
    "report": "report",
    "keys": "keys",
    "prepare-worker-host": "prepare_worker_host",
    "launch": "launch",
}

EXIT_CONFIG = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestrator",
        description="Rollout orchestrator for LLM reinforcement learning.",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"orchestrator.commands.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        p.add_argument("--log-level", default=argparse.SUPPRESS,
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level (default: INFO)")
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a long-running command's coroutine on uvloop (the default asyncio loop where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; kept for odd platforms
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()  # first: until then a child stopped (SIGSTOP) as its parent dies stays behind
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        code = int(args._module.main(args))
        sys.stdout.flush()  # here, not at exit: a reader that left (`| head`) is the BrokenPipeError below
        return code
    except ConfigError as e:
        print(f"config error ({len(e.problems)} problem{'s' if len(e.problems) != 1 else ''}):",
              file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return EXIT_CONFIG
    except BaseExceptionGroup as group:
        named = [e for e in _leaves(group) if isinstance(e, OrchestratorError)]
        if not named:
            raise
        for err in named:  # a component failed for a reason it could name: say it, exit 1
            print(f"error: {err}", file=sys.stderr)
        return 1
    except OrchestratorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `orchestrator check CONFIG | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not raise again
        return 141  # 128 + SIGPIPE, as a shell reports a pipe's writer


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


if __name__ == "__main__":
    sys.exit(main())
