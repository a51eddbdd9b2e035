from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from orchestrator.cli import COMMANDS, build_parser, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: orchestrator {command}" in out
    assert "--log-level" in out


def test_top_level_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


def test_unknown_command_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2


def test_demo_passes_every_sim_key_to_the_servers(tmp_path: Path) -> None:
    import dataclasses

    from orchestrator.commands.sim_inference import add_arguments
    from orchestrator.config import SimConfig, load_config

    demo = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for sets in (["sim.hang_rate=0.1", "sim.drop_rate=0.2", "sim.latency_max_ms=9.0", "sim.num_experts=32"],
                 ['sim.profile="vllm-0.33"', "sim.dev_mode=false", "sim.num_experts=512", "sim.scale_out=false",
                  'sim.logprobs_mode="processed_logprobs"']):
        cfg = load_config(demo, sets)
        parsed = parser.parse_args(cfg.sim.arguments(cfg.model.name, cfg.inference.backend))
        for f in dataclasses.fields(SimConfig):
            if f.name in ("servers", "seed"):  # the demo's own: how many to start, and seed + i per server
                continue
            expected = getattr(cfg.sim, f.name)
            if f.name == "profile" and expected is None:  # unset: the one inference.backend names
                expected = {"prime-rl": "prime-rl", "vllm": "vllm-0.31"}[cfg.inference.backend]
            assert getattr(parsed, f.name) == expected, f.name


def test_the_demo_table_shows_a_dash_for_an_environment_without_rollouts_in_a_step() -> None:
    """The issue's case: the final table printed ``nan`` where an environment had no rollout in a step."""
    from rich.console import Console

    from orchestrator.commands.demo import print_summary

    def row(step: int, rewards: dict[str, float]) -> dict[str, object]:
        return {"step": step, "reward_mean": rewards, "rollouts": 8, "failed": 0, "tokens": 99,
                "rollouts_per_s": 10.0, "lag": {"p99": 1.0, "max": 2.0}, "rss_mb": 120.0}

    console = Console(record=True, width=200)
    print_summary(console, [row(0, {"arith": 0.5, "guess": 0.25}), row(1, {"arith": 0.75})], [], Path("out"))
    text = console.export_text()
    assert "nan" not in text
    line = next(line for line in text.splitlines() if line.strip().startswith("│ 1 ") or " 1 │" in line)
    assert [cell.strip() for cell in line.split("│")[1:4]] == ["1", "0.750", "-"], line


def test_a_reader_that_leaves_the_pipe_early_gets_no_traceback(repo: Path) -> None:
    """``orchestrator check CONFIG | head -1``: the command stops quietly, as a shell's pipe writer does (141)."""
    import subprocess
    import sys

    with subprocess.Popen([sys.executable, "-m", "orchestrator", "check", str(repo / "configs" / "demo.toml")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=repo) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        proc.stdout.close()  # the reader leaves before the command writes: its output meets a closed pipe
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err
    assert "Exception ignored" not in err
