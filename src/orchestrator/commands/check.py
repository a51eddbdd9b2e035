"""``orchestrator check FILE [--servers]``: validate a job config and print it resolved (defaults filled in);
each environment's verifiers configuration is validated by verifiers itself (imported here, a few seconds);
with ``--servers``, also run the preflight checks of every inference server it names (read-only) and of the
``[teacher]``'s servers when an env distils, and check
what can be checked now of ``inference.weights_path`` (checkpoint_files.weights_path_report: the directory above
``{step}`` exists and the newest checkpoint already there loads; steps not written yet are not a problem)."""

from __future__ import annotations

import argparse

from orchestrator.config import InferenceConfig, JobConfig, load_config, to_toml
from orchestrator.errors import ConfigError

HELP = "validate a job config and print the resolved config"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job config (TOML)")
    p.add_argument("--servers", action="store_true",
                   help="also check each inference server: reachable, serves model.name, admin routes of the "
                        "backend, tokenizer, one generate round trip; each [teacher] server: reachable, serves "
                        "teacher.model, context, tokenizer, one scoring round trip; and inference.weights_path: its "
                        "directory exists, the newest checkpoint in it loads (exit 1 naming every problem)")
    add_set_argument(p)


def add_set_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set scheduler.max_inflight=32 or env[0].group_size=4 "
                        "(repeatable; VALUE is read as TOML, else as a string)")


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    envs = check_environments(cfg, args.config)  # ConfigError: exit 2 naming each key
    print(f"# {args.config}: OK ({len(cfg.env)} environment{'s' if len(cfg.env) != 1 else ''})")
    print("\n".join(envs))
    print(to_toml(cfg), end="")
    if args.servers:
        from orchestrator.cli import run_async

        run_async(check_servers(cfg))  # a PreflightError exits 1 with every problem (cli.main)
    return 0


def check_environments(cfg: JobConfig, source: str) -> list[str]:
    """Resolve each ``[[env]]``'s verifiers configuration with verifiers; a line per environment saying what
    runs (seats, harnesses, runtimes, tasks). ConfigError listing every problem, each with its key path."""
    from orchestrator.workers.envconfig import resolve_env

    problems: list[str] = []
    lines: list[str] = []
    for i, env in enumerate(cfg.env):
        try:
            resolved = resolve_env(env.taskset, env.args, env.verifiers, env.select, f"env[{i}]")
        except ConfigError as e:
            problems += [f"{source}: {p}" for p in e.problems]
            continue
        lines.append(f"# env[{i}] {env.label}: {resolved.describe()}")
    if problems:
        raise ConfigError(problems)
    return lines


async def check_servers(cfg: JobConfig) -> None:
    import asyncio
    from pathlib import Path

    from orchestrator.assets import tokenizer_dir
    from orchestrator.inference.logprobs import LogprobsCheck
    from orchestrator.inference.pool import InferencePool
    from orchestrator.inference.preflight import PreflightError, encode_probe, preflight, preflight_teacher

    tokenizer = Path(cfg.model.tokenizer) if cfg.model.tokenizer else tokenizer_dir()
    problem, weights = await asyncio.to_thread(check_weights_path, cfg.inference)
    async with InferencePool.open(cfg.inference) as pool:
        try:
            temperatures = [e.sampling.temperature for e in cfg.env]
            checked = await preflight([s.api for s in pool.servers], backend=cfg.inference.backend,
                                      model=cfg.model.name, tokenizer=tokenizer, resume=False,
                                      transfer=cfg.inference.transfer_backend,
                                      logprobs=LogprobsCheck.of(cfg.inference, temperatures,
                                                                prime_rl_trainer=cfg.transport.kind == "prime-rl"))
        except PreflightError as e:
            raise PreflightError(e.problems + ([problem] if problem else [])) from None
    if problem is not None:
        raise PreflightError([problem])
    for r in checked.servers:
        print(f"# {r.url}: OK ({cfg.inference.backend}, {cfg.model.name!r}, max_model_len {r.max_model_len})")
    if cfg.teacher is not None and any(e.distills for e in cfg.env):
        lengths = [r.max_model_len for r in checked.servers if r.max_model_len]
        for r in await preflight_teacher(cfg.teacher, encoded=encode_probe(tokenizer),
                                         policy_max_len=max(lengths) if lengths else None):
            print(f"# teacher {r.url}: OK ({cfg.teacher.model!r}, max_model_len {r.max_model_len})")
    print(f"# logprobs_mode: {checked.logprobs_mode} ({checked.logprobs.how}); batches say so to the trainer")
    if weights:
        print(f"# inference.weights_path: {weights}")


def check_weights_path(inference: InferenceConfig) -> tuple[str | None, str]:
    """(a problem or None, what was checked) of ``inference.weights_path`` on this host; blocking."""
    from orchestrator.inference.checkpoint_files import weights_path_report

    if inference.weights_path is None:
        return None, ""  # checkpoints come with their paths; each is checked when announced
    if not inference.check_checkpoints:
        return None, "not checked (inference.check_checkpoints = false)"
    return weights_path_report(inference.weights_path)
