"""verifiers' environment configuration in ``[[env]]`` tables: passed through, validated by verifiers itself in
``orchestrator check`` (and the env workers), every problem named by our key path. verifiers is imported here
(in this test process), never by ``load_config``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.workers.envconfig import resolve_env

JOB = """
[inference]
servers = ["http://127.0.0.1:9/v1"]
[scheduler]
batch_size = 4

[[env]]
name = "arith"
taskset = "orchestrator-arithmetic"
group_size = 2

[[env]]
name = "hangman"
taskset = "textarena"
args = { game = "Hangman-v0" }
group_size = 2
select = { limit = 16 }

[env.verifiers]
max_concurrent_agents = 2
timeout = { episode = 300 }
retries = { max_retries = 1 }

[env.verifiers.player]
harness = { id = "null", tool_timeout = 30 }
max_turns = 8
max_total_tokens = 4096
timeout = { rollout = 120, scoring = 30 }
retries = { rules = [{ type = "ProviderError", max_retries = 2 }] }
sampling = { temperature = 0.7 }
"""


def write(tmp_path: Path, text: str = JOB) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def problems(tmp_path: Path, *overrides: str) -> list[str]:
    cfg = load_config(write(tmp_path), overrides)
    found: list[str] = []
    for i, env in enumerate(cfg.env):
        try:
            resolve_env(env.taskset, env.args, env.verifiers, env.select, f"env[{i}]")
        except ConfigError as e:
            found += e.problems
    return found


def test_every_option_reaches_verifiers_as_written(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path))
    env = cfg.env[1]
    resolved = resolve_env(env.taskset, env.args, env.verifiers, env.select, "env[1]")
    vf = resolved.config
    assert resolved.seats == ("player",)  # TextArena's seat
    assert vf.taskset.id == "textarena"
    assert vf.taskset.game == "Hangman-v0"
    assert (vf.max_concurrent_agents, vf.timeout.episode, vf.retries.max_retries) == (2, 300.0, 1)
    player = vf.player
    assert (player.harness.id, player.harness.tool_timeout) == ("null", 30.0)
    assert (player.max_turns, player.max_total_tokens) == (8, 4096)
    assert (player.timeout.rollout, player.timeout.scoring) == (120.0, 30.0)
    assert [(r.type, r.max_retries) for r in player.retries.rules] == [("ProviderError", 2)]
    assert player.sampling.temperature == 0.7
    assert player.runtime.type == "subprocess"  # the one default we add: no remote sandbox unless asked
    assert resolved.select.limit == 16
    assert resolved.describe() == "seat player (harness null, runtime subprocess, max_turns 8); at most 16 tasks"


def test_built_in_envs_keep_their_in_process_harness(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path))
    env = cfg.env[0]
    resolved = resolve_env(env.taskset, env.args, env.verifiers, env.select, "env[0]")
    assert resolved.seats == ("agent",)
    assert resolved.config.agent_harnesses()["agent"].id == "orchestrator-arithmetic"
    assert resolved.config.agent.runtime.type == "subprocess"


def test_a_runtime_the_user_sets_is_kept(tmp_path: Path) -> None:
    found = problems(tmp_path, 'env[1].verifiers.player.runtime={ type = "docker", image = "python:3.11" }')
    assert found == []


@pytest.mark.parametrize(("override", "expected"), [
    ("env[1].verifiers.player.max_turns=\"many\"",
     "env[1].verifiers.player.max_turns: Input should be a valid integer"),
    ("env[1].verifiers.player.harness.colour=1", "env[1].verifiers.player.harness.colour: Extra inputs are not "
                                                 "permitted"),
    ("env[1].verifiers.player.runtime.foo=1", "env[1].verifiers.player.runtime.foo: Extra inputs are not permitted"),
    ("env[1].verifiers.player.retries.rules=[{ max_retries = -1 }]",
     "env[1].verifiers.player.retries.rules[0].max_retries: Input should be greater than or equal to 0"),
    ("env[1].verifiers.agent.max_turns=2", "env[1].verifiers.agent: Extra inputs are not permitted (this "
                                           "environment's seats: player;"),
    ("env[1].verifiers.timeout.episode=\"soon\"", "env[1].verifiers.timeout.episode: Input should be a valid number"),
    ("env[1].args.game=\"Chess-v0\"", "env[1].args.game: Input should be 'Wordle-v0', "),
    ("env[1].select.limit=0", "env[1].select.limit: Input should be greater than or equal to 1"),
    ("env[1].select={}", "env[1].select.limit: taskset 'textarena' is endless; set how many of its tasks"),
    ("env[1].verifiers.player.harness.id=\"no-such-harness\"",
     "env[1].verifiers.player.harness.id: harness 'no-such-harness' not found"),
    ("env[0].taskset=\"no-such-taskset\"", "env[0].taskset: taskset 'no-such-taskset' not found"),
    ("env[0].verifiers.taskset={ id = \"x\" }", "env[0].verifiers.taskset: the taskset is set by `taskset`"),
])
def test_a_bad_option_is_named_by_its_key_path(tmp_path: Path, override: str, expected: str) -> None:
    found = problems(tmp_path, override)
    assert any(p.startswith(expected) for p in found), found


def test_check_rejects_a_bad_verifiers_option_with_its_key_path(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, JOB.replace("max_turns = 8", "max_turns = 8\nmax_turn = 9"))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: env[1].verifiers.player.max_turn: Extra inputs are not permitted" in err


def test_check_prints_what_each_environment_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "# env[1] hangman: seat player (harness null, runtime subprocess, max_turns 8); at most 16 tasks" in out
    assert "# env[0] arith: seat agent (harness orchestrator-arithmetic, runtime subprocess); all tasks" in out
    # the printed config loads back to the same one
    again = tmp_path / "again.toml"
    again.write_text(out)
    assert load_config(again) == load_config(path)


def test_loading_a_config_does_not_import_verifiers(tmp_path: Path) -> None:
    code = (f"import sys; from orchestrator.config import load_config; load_config({str(write(tmp_path))!r}); "
            "print('verifiers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
