"""scripts/perf's shared tools: every figure carries the machine and the commit it came from (``_machine.py``), and
the regression check (``regress.py``) reads the recorded commit and judges a move by its direction and size."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import orchestrator

PERF = Path(__file__).resolve().parent.parent / "scripts" / "perf"

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse avx avx2 {extra} hypervisor

processor\t: 1
model name\t: Another CPU
flags\t\t: fpu avx512f
"""


@pytest.fixture
def perf(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/perf on the path, as when a script runs: its modules import each other by name."""
    monkeypatch.syspath_prepend(str(PERF))
    return importlib.import_module("regress")


@pytest.mark.parametrize(("extra", "avx512"), [("", False), ("avx512f avx512bw", True)])
def test_the_cpu_is_read_from_the_first_processor(perf: ModuleType, tmp_path: Path, extra: str,
                                                  avx512: bool) -> None:
    machine = importlib.import_module("_machine")
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO.format(extra=extra))
    info = machine.cpu_info(path)
    assert info == {"cpu": "AMD EPYC", "cpu_family_model": "25/1", "avx2": True, "avx512": avx512,
                    "hypervisor": True}
    label = machine.machine_label({**info, "cores": 2})
    assert label == f"AMD EPYC 25/1, 2 cores, {'AVX-512' if avx512 else 'AVX2'}, VM"
    assert machine.cpu_info(tmp_path / "absent")["cpu"] is None


def test_a_script_json_names_its_machine_and_the_commit_of_the_code_it_ran(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(PERF / "synth_step.py"), "--rollouts", "4", "--turns", "1", "--tokens",
                          "16", "--layers", "0", "--top-k", "0", "--group-size", "2", "--out", str(tmp_path / "d"),
                          "--json"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    machine = json.loads(out.stdout.splitlines()[-1])["machine"]
    assert set(machine) >= {"cpu", "cores", "avx2", "avx512", "commit", "python", "date", "load_1m"}
    assert machine["cores"] >= 1
    assert machine["python"] == ".".join(map(str, sys.version_info[:3]))
    root = Path(orchestrator.__file__).resolve().parents[2]  # the tree the script imported, as this test does
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    assert machine["commit"].removesuffix("-dirty") == (head or "unknown")


def test_the_recorded_commit_is_the_last_table_row_that_names_one(perf: ModuleType, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\n## Headline figures\n\n| date | commit | machine |\n|---|---|---|\n"
                      "| 2026-11-24 | `cd23bfc` | VM |\n| 2026-11-25 | - | VM |\n| 2026-11-26 | `abc1234-dirty` | x |\n"
                      "| 2026-11-27 | main | x |\n\n## Other\n\n| 1 | `fedcba9` | y |\n")
    assert perf.recorded_commit(readme) == "abc1234"
    readme.write_text("# Benchmarks\n\n## Headline figures\n\n| date | commit |\n|---|---|\n| today | - |\n")
    with pytest.raises(ValueError, match="no row with a commit"):
        perf.recorded_commit(readme)
    readme.write_text("# Benchmarks\n")
    with pytest.raises(ValueError, match="no '## Headline figures' section"):
        perf.recorded_commit(readme)


def test_the_readme_records_a_commit_git_knows(perf: ModuleType) -> None:
    commit = perf.recorded_commit(PERF / "README.md")
    found = subprocess.run(["git", "-C", str(PERF), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                           capture_output=True, text=True, check=False)
    assert found.returncode == 0, f"scripts/perf/README.md's last recorded commit {commit} is not in this repository"


@pytest.mark.parametrize(("figure", "now", "then", "verdict", "overlap"), [
    ("orch_cpu_ms_per_rollout", [0.62, 0.60], [0.50, 0.49], "worse", False),  # +23%, lower is better
    ("orch_cpu_ms_per_rollout", [0.55, 0.40], [0.50, 0.49], "same", True),
    ("max_worker_rss_ready_mb", [273.0], [475.0], "better", False),
    ("sim_requests_per_s", [142.0, 200.0], [183.0, 190.0], "same", True),  # medians 171 vs 186.5: -8%
    ("sim_requests_per_s", [110.0, 140.0], [183.0, 139.0], "worse", True),  # -22%, higher is better; runs overlap
])
def test_a_figure_is_worse_only_past_the_threshold_the_wrong_way(perf: ModuleType, figure: str, now: list[float],
                                                                 then: list[float], verdict: str,
                                                                 overlap: bool) -> None:
    bench = next(b for b in perf.BENCHES if b.figure == figure)
    result = perf.compare(bench, now, then, 0.2)
    assert (result["verdict"], result["runs_overlap"]) == (verdict, overlap)
    assert perf.compare(bench, now, [], 0.2)["verdict"] == "not measured"


def test_the_check_refuses_a_commit_it_cannot_find() -> None:
    out = subprocess.run([sys.executable, str(PERF / "regress.py"), "--against", "0123456789abcdef"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "regress: cannot start:" in out.stderr
