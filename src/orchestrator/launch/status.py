"""The job's status file (``JOB_DIR/status.json``): what the allocation's runner says about the job, for
``orchestrator launch status`` and for whoever reads the job directory.

Written whole at every change (a temp file, then a rename): a reader never sees half of one. Holds the job's
state (``submitted``: by ``orchestrator launch slurm``; then the runner's ``starting``, ``running``, ``completed``,
``failed``, ``stopped``), why it ended, the plan (which node runs
what, the addresses), and each step: its node, SLURM step id, state, exit status, restarts and log file.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

STATES = ("submitted", "starting", "running", "completed", "failed", "stopped")


@dataclass
class StepStatus:
    role: str
    nodes: list[str]
    log: str
    state: str = "starting"  # starting, ready, exited, restarting, stopped
    step: str | None = None  # SLURM's step id, once known
    exit: int | None = None
    restarts: int = 0


@dataclass
class JobStatus:
    job_id: str
    attempt: int  # 0 for the first run of the job, +1 per requeue (SLURM_RESTART_COUNT)
    job_dir: str
    state: str = "starting"
    why: str = ""
    plan: dict[str, Any] = field(default_factory=dict)
    steps: dict[str, StepStatus] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def write(self, path: Path) -> None:
        self.updated = time.time()
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2))
        tmp.replace(path)


def read_status(path: Path) -> dict[str, Any] | None:
    """The status file's contents, or None if there is none yet."""
    try:
        return dict(orjson.loads(path.read_bytes()))
    except FileNotFoundError:
        return None
