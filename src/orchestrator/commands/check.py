"""``orchestrator check FILE``: validate a job config and print it resolved (defaults filled in)."""

from __future__ import annotations

import argparse

from orchestrator.config import load_config, to_toml

HELP = "validate a job config and print the resolved config"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job config (TOML)")
    add_set_argument(p)


def add_set_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set scheduler.max_inflight=32 or env[0].group_size=4 "
                        "(repeatable; VALUE is read as TOML, else as a string)")


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    print(f"# {args.config}: OK ({len(cfg.env)} environment{'s' if len(cfg.env) != 1 else ''})")
    print(to_toml(cfg), end="")
    return 0
