"""``orchestrator launch slurm|k8s|status JOB.toml``: the whole job on a cluster, through its own scheduler.

``slurm`` renders the job's sbatch script from ``[launch]`` (launch/sbatch.py), writes it into the job's
directory and submits it (``--dry-run``: prints it and submits nothing). ``k8s`` renders Kubernetes manifests
(launch/k8s.py). ``status`` says what the job's runner last recorded and where the logs are. ``allocation``
is what the sbatch script runs inside the allocation (launch/allocation.py); it is not for typing by hand.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from orchestrator.commands.check import add_set_argument
from orchestrator.config import JobConfig, load_config
from orchestrator.errors import ConfigError
from orchestrator.launch import slurm
from orchestrator.launch.sbatch import JobFiles
from orchestrator.launch.status import JobStatus, read_status

# SLURM's states of a job that has not ended (squeue's job state codes)
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
          "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"}
HELP = "launch the whole job on a cluster: SLURM (sbatch) or Kubernetes (manifests); or say how a launched job is"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="engine", required=True, metavar="ENGINE")
    slurm = sub.add_parser("slurm", help="render the job's sbatch script and submit it",
                           description="render the job's sbatch script from [launch], submit it, print the job id")
    slurm.add_argument("config", type=Path, help="job config (TOML) with a [launch] section")
    slurm.add_argument("--dry-run", action="store_true",
                       help="print the script (sbatch accepts it as it is) and submit nothing; the job directory "
                            "and its logs/ are made, as sbatch needs them")
    add_set_argument(slurm)
    k8s = sub.add_parser("k8s", help="render Kubernetes manifests for the job's roles",
                         description="render the job's Kubernetes manifests (YAML) from [launch] and [launch.k8s]")
    k8s.add_argument("config", type=Path, help="job config (TOML) with a [launch] section")
    k8s.add_argument("--out", type=Path, default=None, metavar="DIR",
                     help="write one file per object into DIR (the Secret mode 0600) instead of all on stdout")
    add_set_argument(k8s)
    status = sub.add_parser("status", help="the launched job's state, steps and logs",
                            description="what the job's runner last recorded: state, each step, logs")
    status.add_argument("config", type=Path, help="the job config it was launched with")
    add_set_argument(status)
    inside = sub.add_parser("allocation", help="(run by the sbatch script) run the job's roles in this allocation")
    inside.add_argument("config", type=Path)
    inside.add_argument("--job-dir", type=Path, required=True)
    add_set_argument(inside)


def load(path: Path, overrides: list[str]) -> JobConfig:
    cfg = load_config(path, overrides)
    if cfg.launch is None:
        raise ConfigError([f"{path}: launch: this job has no [launch] section; add one (configs/launch_demo.toml, "
                           "docs/launch.md)"])
    return cfg


def main(args: argparse.Namespace) -> int:
    cfg = load(args.config, args.overrides)
    if args.engine == "slurm":
        return _slurm(cfg, args)
    if args.engine == "k8s":
        return _k8s(cfg, args)
    if args.engine == "status":
        from orchestrator.launch.report import print_status

        return print_status(cfg, Path.cwd())
    from orchestrator.cli import run_async
    from orchestrator.launch.allocation import run_allocation

    return run_async(run_allocation(cfg, args.config.resolve(), args.overrides, args.job_dir))


def _slurm(cfg: JobConfig, args: argparse.Namespace) -> int:
    from orchestrator.launch.sbatch import render

    assert cfg.launch is not None
    cwd = Path.cwd()
    files = JobFiles.of(cfg, cfg.launch, cwd)
    script = render(cfg, args.config, args.overrides, cwd, cfg.launch.python or sys.executable)
    files.logs.mkdir(parents=True, exist_ok=True)  # sbatch opens --output there before anything runs
    if args.dry_run:
        print(script, end="")
        return 0
    active = _active_job(files)
    if active is not None:
        print(f"error: job {active[0]} of {files.root} is {active[1]}: one job per job directory (they would share its "
              f"output and keys). Wait for it, or scancel {active[0]}", file=sys.stderr)
        return 1
    tmp = files.script.with_name(f".{files.script.name}.{os.getpid()}")
    tmp.write_text(script)
    tmp.replace(files.script)
    job_id = slurm.submit(str(files.script))
    JobStatus(job_id, 0, str(files.root), state="submitted", why="waiting for SLURM to start it").write(files.status)
    print(job_id)
    print(f"submitted job {job_id} ({files.script}); job directory {files.root}\n"
          f"  logs:   {files.logs}/job.log (the runner), orchestrator.log, trainer.log, server-N.log, "
          "env-worker-N.log\n"
          f"  status: orchestrator launch status {args.config}  (squeue -j {job_id}; the runner writes "
          f"{files.status})\n"
          f"  stop:   scancel {job_id}  (the orchestrator saves its state; launch again to resume)", file=sys.stderr)
    return 0


def _active_job(files: JobFiles) -> tuple[str, str] | None:
    """(job id, SLURM state) of the job last launched into ``files`` if SLURM still runs or queues it."""
    status = read_status(files.status)
    if status is None:
        return None
    state = slurm.job_state(status["job_id"])
    return (status["job_id"], state) if state in ACTIVE else None


def _k8s(cfg: JobConfig, args: argparse.Namespace) -> int:
    from orchestrator.launch.k8s import render_manifests, write_manifests

    manifests = render_manifests(cfg, args.config, args.overrides)
    if args.out is None:
        from orchestrator.launch.yaml import dump_all

        print(dump_all(m for _, m in manifests), end="")
        return 0
    for path in write_manifests(manifests, args.out):
        print(path)
    return 0
