"""The job's sbatch script: one allocation for every role, and one command inside it.

The script asks SLURM for the nodes every role needs (``LaunchConfig.nodes_needed``) and runs
``orchestrator launch allocation`` in the batch step, which places the roles on ``$SLURM_JOB_NODELIST`` and runs
each as a job step (launch/allocation.py). Its comments say what runs where and how to watch and stop the job,
so the script read alone explains the job. Paths in it are absolute: it runs in ``--chdir``, the directory the
job was launched from.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import JobConfig
from orchestrator.launch.config import ROLES, LaunchConfig

LOGS = "logs"
SCRIPT = "job.sbatch"


@dataclass(frozen=True)
class JobFiles:
    """Where a launched job keeps its files (``[launch] job_dir``, on a filesystem every node sees)."""

    root: Path

    @classmethod
    def of(cls, cfg: JobConfig, launch: LaunchConfig, cwd: Path) -> JobFiles:
        job_dir = Path(launch.job_dir) if launch.job_dir else Path(cfg.run.output_dir) / "launch"
        return cls(job_dir if job_dir.is_absolute() else cwd / job_dir)

    @property
    def logs(self) -> Path:
        return self.root / LOGS

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def script(self) -> Path:
        return self.root / SCRIPT

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"


def render(cfg: JobConfig, config_path: Path, overrides: Sequence[str], cwd: Path, python: str) -> str:
    """The sbatch script of ``cfg``'s job (``cfg.launch`` set), launched from ``cwd``."""
    launch = cfg.launch
    assert launch is not None  # the caller checked
    files = JobFiles.of(cfg, launch, cwd)
    config = config_path if config_path.is_absolute() else cwd / config_path
    inside = [python, "-m", "orchestrator", "launch", "allocation", str(config), "--job-dir", str(files.root)]
    for item in overrides:
        inside += ["--set", item]
    lines = ["#!/bin/bash", f"# {launch.job_name or cfg.run.name}: the RL job of {config}, rendered by "
             "`orchestrator launch slurm`.", "#", *(f"# {line}" for line in describe(launch)), "#",
             f"# Inside the allocation `orchestrator launch allocation` places the roles on $SLURM_JOB_NODELIST, "
             f"makes the job's CURVE keys in {files.keys} (handed to each role as files),",
             "# and runs each role as a job step: the servers first, the orchestrator once they are healthy, env "
             "workers and trainer once it listens.",
             f"# Logs: {files.logs}/<role>.log (this script's: job.log); status: {files.status}.",
             "# Stop: scancel JOBID (SIGTERM to every step; the orchestrator saves its state). Submit again (or "
             "requeue) to resume where the journal says.",
             *(f"#SBATCH {flag}" for flag in sbatch_flags(cfg, launch, files, cwd)),
             "", "set -euo pipefail", *launch.setup, f"exec {shlex.join(inside)}", ""]
    return "\n".join(lines)


def sbatch_flags(cfg: JobConfig, launch: LaunchConfig, files: JobFiles, cwd: Path) -> list[str]:
    flags = [f"--job-name={launch.job_name or cfg.run.name}", f"--nodes={launch.nodes_needed()}",
             "--ntasks-per-node=1", f"--chdir={cwd}", f"--output={files.log('job')}", "--open-mode=append"]
    for name in ("partition", "account", "qos", "time"):
        value = getattr(launch, name)
        if value is not None:
            flags.append(f"--{name}={value}")
    if launch.exclusive:
        flags.append("--exclusive")
    flags.append("--requeue" if launch.requeue else "--no-requeue")
    named = [n for r in ROLES for n in launch.role(r).nodelist]
    if named:
        flags.append(f"--nodelist={','.join(named)}")
    return flags + list(launch.sbatch)


def describe(launch: LaunchConfig) -> list[str]:
    """One line per role: where it runs and what it runs."""
    out = []
    for role in ROLES:
        p = launch.role(role)
        where = (f"on {p.share}'s node{'' if role == 'orchestrator' else 's'}" if p.share else
                 f"on {', '.join(p.nodelist)}" if p.nodelist else f"on {p.own_nodes()} node(s) of its own")
        if role == "servers" and not p.own_nodes() and not p.share:
            out.append("servers: none started (inference.servers as written)")
            continue
        if role == "env_workers" and not p.own_nodes() and not p.share:
            out.append("env workers: the orchestrator's own (local, [[env]] workers)")
            continue
        what = {"servers": f"{launch.servers.per_node} per node, ports {launch.servers.port}+: "
                           f"{launch.servers.command}",
                "env_workers": f"{launch.env_workers.per_node} per node: orchestrator env-worker",
                "orchestrator": f"orchestrator run (env workers on port {launch.orchestrator.worker_port}, trainer on "
                                f"{launch.orchestrator.trainer_port})",
                "trainer": f"{launch.trainer.command}"}[role]
        out.append(f"{role.replace('_', ' ')} {where}: {what}")
    return out
