from __future__ import annotations

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
