"""``orchestrator launch status JOB.toml``: the launched job as its runner last recorded it, SLURM's word on it, the
orchestrator's last step, and where every log is."""

from __future__ import annotations

import time
from pathlib import Path

import orjson

from orchestrator.config import JobConfig
from orchestrator.launch import slurm
from orchestrator.launch.sbatch import JobFiles
from orchestrator.launch.status import read_status


def print_status(cfg: JobConfig, cwd: Path) -> int:
    """Print the job's status; 1 when it was never launched (no status file)."""
    assert cfg.launch is not None
    files = JobFiles.of(cfg, cfg.launch, cwd)
    status = read_status(files.status)
    if status is None:
        print(f"no job launched from here yet: {files.status} does not exist (orchestrator launch slurm CONFIG)")
        return 1
    try:
        queued = slurm.job_state(status["job_id"]) or "no longer in the queue"
    except slurm.SlurmError as e:
        queued = f"unknown ({e})"
    age = time.time() - status["updated"]
    print(f"job {status['job_id']} (attempt {status['attempt']}): {status['state']}"
          f"{': ' + status['why'] if status['why'] else ''}; SLURM: {queued}; recorded {age:.0f} s ago")
    print(f"  orchestrator: {last_step(Path(cfg.run.output_dir), cfg.run.max_steps)}")
    for name, step in status["steps"].items():
        extra = f", exit {step['exit']}" if step["exit"] is not None else ""
        extra += f", {step['restarts']} restart(s)" if step["restarts"] else ""
        print(f"  {name:<14} {step['state']:<10} on {','.join(step['nodes'])}{extra}: {step['log']}")
    print(f"  runner's log: {files.log('job')}")
    return 0


def last_step(output_dir: Path, max_steps: int) -> str:
    """The orchestrator's progress from its metrics.jsonl: the last step done, of how many."""
    path = output_dir / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            rows = [orjson.loads(line) for line in f.read().splitlines() if line.strip()]
    except (OSError, orjson.JSONDecodeError):
        return f"no step done yet ({path})"
    steps = [r["step"] for r in rows if not r.get("eval") and "step" in r]
    return f"step {max(steps)} of {max_steps - 1} done ({path})" if steps else f"no step done yet ({path})"
