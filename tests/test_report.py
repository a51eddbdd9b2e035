"""``orchestrator report``: PNG plots from a run's metrics.jsonl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from orchestrator.cli import main
from orchestrator.commands.report import render_report
from orchestrator.lagmon import LagStats
from orchestrator.steps.outputs import StepOutputs, step_metrics
from orchestrator.testing.steps import rollout_row

PNG = b"\x89PNG\r\n\x1a\n"
NAMES = ["reward", "lag", "rss", "phases", "throughput"]


def write_metrics(out: Path, steps: int) -> None:
    outputs = StepOutputs(out)
    for step in range(steps):
        rows = [rollout_row(env=env, reward=(step + i) % 3 / 2, ok=i != 3, filtered=i == 2, tokens=10 * (i + 1),
                            off_policy=i % 2) for env in ("arith", "guess") for i in range(4)]
        lag = LagStats(50, 0.1, 0.4, 1.0, 2.0 + step, 3.0 + step)
        metrics = step_metrics(step, rows, phase_s={"wait": 1.0, "advantage": 0.01, "assemble": 0.05, "send": 0.02},
                               lag=lag, rss_mb=300.0 + step, wall_s=1.2)
        outputs.write(rows, metrics)


def test_report_renders_every_plot_as_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_metrics(tmp_path, 4)
    assert main(["report", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    expected = [tmp_path / "plots" / f"{n}.png" for n in NAMES]
    assert printed == [str(p) for p in expected]
    for path in expected:
        data = path.read_bytes()
        assert data[:8] == PNG, path
        assert len(data) > 5000  # something was drawn


def test_report_writes_where_asked(tmp_path: Path) -> None:
    write_metrics(tmp_path / "run", 1)
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "elsewhere")]) == 0
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == sorted(f"{n}.png" for n in NAMES)


def test_report_without_metrics_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 1
    assert "metrics.jsonl: cannot read the run's metrics" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    assert main(["report", str(tmp_path)]) == 1
    assert "metrics.jsonl:2: not JSON" in capsys.readouterr().err


def test_report_without_matplotlib_says_how_to_install_it(tmp_path: Path) -> None:
    write_metrics(tmp_path, 1)
    code = ("import sys; sys.modules['matplotlib'] = None  # an install without the plots extra\n"
            "from orchestrator.cli import main; sys.exit(main(['report', sys.argv[1]]))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=180,
                         check=False)
    assert run.returncode == 1
    assert "pip install 'rollout-orchestrator[plots]'" in run.stderr
    assert not (tmp_path / "plots").exists()


def test_eval_rows_get_their_own_plot_and_stay_out_of_the_step_plots(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    write_metrics(tmp_path, 3)
    outputs = StepOutputs(tmp_path)
    for step in (0, 2):  # evaluation rows, among the step rows as a run writes them
        env = {"mean_reward": 0.1 * step, "pass@1": 0.1, "pass@2": 0.2, "pass^2": 0.0, "examples": 4, "errors": 0}
        outputs.metrics.log({"at_step": step + 1, "policy": step, "envs": {"arith": env}}, step=step, prefix="eval")
    assert main(["report", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "plots" / f"{n}.png") for n in [*NAMES, "eval"]]
    assert (tmp_path / "plots" / "eval.png").read_bytes()[:8] == PNG


def test_report_plots_each_servers_cap_when_the_run_kept_caps(tmp_path: Path) -> None:
    outputs = StepOutputs(tmp_path)
    for step in range(3):
        rows = [rollout_row(env="arith", reward=0.5, tokens=10)]
        caps = {url: {"cap": 32 - 8 * step + i, "rule": "trim", "cancelled": 0, "kv_usage": 0.5 + 0.1 * step,
                      "waiting": 0, "preemptions": step} for i, url in enumerate(["http://a/v1", "http://b/v1"])}
        metrics = step_metrics(step, rows, phase_s={"wait": 1.0}, lag=LagStats(1, 0, 0, 0, 0, 0), rss_mb=1.0,
                               wall_s=1.0, extra={"scheduler": {"concurrency": caps}})
        outputs.write(rows, metrics)
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "concurrency.png").read_bytes()[:8] == PNG


def test_report_plots_the_phases_of_weight_syncs_when_the_run_synced(tmp_path: Path) -> None:
    rows = [{"step": 0, "phase_s": {"wait": 1.0}},
            {"step": 1, "phase_s": {"wait": 1.0}, "weight_syncs": [
                {"step": 1, "mode": "broadcast", "servers": 2, "failed": 0, "total_s": 0.9, "form_s": 0.1,
                 "ask_s": 0.01, "pause_s": 0.02, "start_s": 0.01, "transfer_s": 0.6, "finish_s": 0.1,
                 "resume_s": 0.02}]},
            {"step": 2, "phase_s": {"wait": 1.0}, "weight_syncs": [
                {"step": 2, "mode": "filesystem", "servers": 2, "failed": 0, "total_s": 0.5, "pause_s": 0.02,
                 "load_s": 0.4, "resume_s": 0.02}]}]
    (tmp_path / "metrics.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    paths = render_report(tmp_path)
    assert tmp_path / "plots" / "weight_sync.png" in paths
    assert (tmp_path / "plots" / "weight_sync.png").read_bytes()[:8] == PNG
    (tmp_path / "metrics.jsonl").write_bytes(orjson.dumps(rows[0]) + b"\n")
    assert tmp_path / "plots" / "weight_sync.png" not in render_report(tmp_path, tmp_path / "other")
