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

    from orchestrator.commands.demo import sim_arguments
    from orchestrator.commands.sim_inference import add_arguments
    from orchestrator.config import SimConfig, load_config

    demo = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for sets in (["sim.hang_rate=0.1", "sim.drop_rate=0.2", "sim.latency_max_ms=9.0", "sim.num_experts=32"],
                 ['sim.profile="vllm-0.33"', "sim.dev_mode=false", "sim.num_experts=512", "sim.scale_out=false",
                  'sim.logprobs_mode="processed_logprobs"']):
        cfg = load_config(demo, sets)
        parsed = parser.parse_args(sim_arguments(cfg))
        for f in dataclasses.fields(SimConfig):
            if f.name in ("servers", "seed"):  # the demo's own: how many to start, and seed + i per server
                continue
            expected = getattr(cfg.sim, f.name)
            if f.name == "profile" and expected is None:  # unset: the one inference.backend names
                expected = {"prime-rl": "prime-rl", "vllm": "vllm-0.31"}[cfg.inference.backend]
            assert getattr(parsed, f.name) == expected, f.name
