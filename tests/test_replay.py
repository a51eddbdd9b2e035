"""scripts/perf: a synthetic dump written by synth_step.py replays through every phase of the real pipeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.steps.dump import load_dump

PERF = Path(__file__).resolve().parent.parent / "scripts" / "perf"
PHASES = ["advantage", "filter", "assemble", "send", "dump", "gc", "metrics", "write"]
PNG = b"\x89PNG\r\n\x1a\n"


def script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(PERF / name), *args], capture_output=True, text=True, timeout=180,
                          check=False)


def last_json(out: str) -> dict[str, object]:
    result = json.loads(out.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


@pytest.mark.slow
def test_replay_of_a_synthetic_dump_runs_every_phase(tmp_path: Path) -> None:
    dump = tmp_path / "step_synth"
    made = script("synth_step.py", "--rollouts", "16", "--turns", "2", "--tokens", "128", "--layers", "2",
                  "--top-k", "2", "--group-size", "4", "--out", str(dump), "--json")
    assert made.returncode == 0, made.stderr
    assert last_json(made.stdout)["rollouts"] == 16
    assert len(load_dump(dump).groups) == 4

    plot = tmp_path / "lag.png"
    run = script("replay_step.py", str(dump), "--json", "--synthetic-traffic", "4", "--repeat", "2", "--dump",
                 "--plot", str(plot))
    assert run.returncode == 0, run.stderr
    result = last_json(run.stdout)
    phases = result["phases"]
    assert isinstance(phases, dict)
    assert list(phases) == PHASES
    for name in PHASES:
        assert set(phases[name]) >= {"wall_s", "max_lag_ms", "p99_lag_ms"}
        assert phases[name]["wall_s"] > 0
    assert {"max_lag_ms", "p99_lag_ms", "wall_s"} <= set(result)
    assert result["runs"] == 2
    assert result["batch_matches_dump"] is True  # the replayed step rebuilt the dumped batch byte for byte
    assert plot.read_bytes()[:8] == PNG


def test_replay_refuses_a_source_it_cannot_read(tmp_path: Path) -> None:
    run = script("replay_step.py", str(tmp_path / "nowhere"), "--json")
    assert run.returncode == 2
    assert "neither a dump directory nor synthetic" in run.stderr
