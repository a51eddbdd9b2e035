from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import JobConfig, load_config, to_toml
from orchestrator.delivery.config import FilesystemTransport, PrimeRLTransport, ShmTransport, ZmqTransport
from orchestrator.errors import ConfigError
from orchestrator.testing.keys import KeySet, make_key_set

REPO = Path(__file__).resolve().parent.parent
JOB_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.toml"))

GOOD = """
[inference]
servers = ["http://127.0.0.1:8000/v1"]

[scheduler]
batch_size = 16

[[env]]
taskset = "orchestrator-arithmetic"
group_size = 4
"""


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_passes_check(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: OK" in out
    assert "[[env]]" in out


def test_shipped_configs_exist() -> None:
    names = {p.name for p in JOB_CONFIGS}
    assert {"demo.toml", "multi_env.toml"} <= names


def test_minimal_config_gets_documented_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.scheduler.batch_size == 16
    assert cfg.scheduler.token_budget is None
    assert cfg.scheduler.max_inflight == 64
    assert cfg.monitor.lag_interval_s == 0.1
    assert cfg.env[0].label == "orchestrator-arithmetic"
    assert cfg.env[0].sampling.max_tokens == 256


def test_the_direct_data_plane_is_accepted_with_zmq(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, GOOD)).transport.data_plane == "through"  # the default
    cfg = load_config(write(tmp_path, GOOD + '\n[transport]\ndata_plane = "direct"\nworker_pool_mb = 8\n'))
    assert (cfg.transport.data_plane, cfg.transport.kind, cfg.transport.keep_acked) == ("direct", "zmq", 0)
    assert cfg.transport.worker_pool_mb == 8
    assert load_config(write(tmp_path, to_toml(cfg), "printed.toml")) == cfg  # and printed as it runs


@pytest.mark.parametrize(("table", "chosen"), [
    ("", ZmqTransport(None, 2, 0, "through", 1024, None)),
    ('kind = "shm"\nshm_pool_mb = 64\n', ShmTransport(None, 2, 64)),
    ('kind = "filesystem"\ndirectory = "b"\ncheckpoint_source = "marker"\nmarker_dir = "m"\n',
     FilesystemTransport("b", 2)),
    ('kind = "prime-rl"\naddress = "tcp://127.0.0.1:5555"\ntrainer_dir = "t"\ndata_ranks = 2\n',
     PrimeRLTransport("t", "zmq", "tcp://127.0.0.1:5555", 2, 2, 2048, 1)),
], ids=["zmq", "shm", "filesystem", "prime-rl"])
def test_a_sender_gets_only_its_kinds_settings(table: str, chosen: object, tmp_path: Path) -> None:
    """One table for every kind in TOML; what its sender is built from is the kind's own type."""
    cfg = load_config(write(tmp_path, GOOD + "\n[transport]\n" + table))
    assert cfg.transport.chosen == chosen


def test_values_are_kept_as_written(tmp_path: Path) -> None:
    text = GOOD.replace("group_size = 4", "group_size = 4\nweight = 3\nargs = { a = [1, 2] }")
    cfg = load_config(write(tmp_path, text))
    assert cfg.env[0].weight == 3.0
    assert cfg.env[0].args == {"a": [1, 2]}
    assert cfg.inference.servers == ("http://127.0.0.1:8000/v1",)


def test_config_is_frozen(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD))
    with pytest.raises(AttributeError):
        cfg.scheduler.max_inflight = 3  # type: ignore[misc]  # the point: a frozen field refuses assignment


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: p.name)
def test_printed_config_loads_back_identical(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path)
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg


def test_include_appends_env_tables(tmp_path: Path) -> None:
    (tmp_path / "envs").mkdir()
    write(tmp_path, '[[env]]\nname = "b"\ntaskset = "x.y"\ngroup_size = 2\n', "envs/b.toml")
    cfg = load_config(write(tmp_path, 'include = ["envs/b.toml"]\n' + GOOD))
    assert [e.label for e in cfg.env] == ["orchestrator-arithmetic", "b"]


def test_error_in_included_file_names_that_file(tmp_path: Path) -> None:
    write(tmp_path, '[[env]]\ntaskset = "x.y"\ngroup_size = "two"\n', "b.toml")
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, 'include = ["b.toml"]\n' + GOOD))
    assert "b.toml: env[0]" in str(e.value)
    assert "env[1].group_size: expected an integer" in str(e.value)


def test_overrides_apply_and_are_named_in_errors(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    cfg = load_config(path, ["scheduler.max_inflight=32", "env[0].sampling.temperature=0.5", "run.name=abc"])
    assert cfg.scheduler.max_inflight == 32
    assert cfg.env[0].sampling.temperature == 0.5
    assert cfg.run.name == "abc"
    with pytest.raises(ConfigError) as e:
        load_config(path, ["env.0.group_size=0"])
    assert str(e.value).startswith("--set env[0].group_size: env[0].group_size: expected a value >= 1")


def test_all_problems_are_reported_at_once(tmp_path: Path) -> None:
    text = GOOD + "\n[run]\nseed = -1\nmax_steps = 0\nbogus = 1\n"
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert len(e.value.problems) == 3


# Each bad config: (description, text appended to / replacing GOOD, key path the message must name)
BAD = [
    ("unknown top-level key", GOOD + "\n[trainer]\nx = 1\n", "trainer: unknown key"),
    ("unknown nested key", GOOD.replace("batch_size = 16", "batch_size = 16\nmax_inflght = 3"),
     "scheduler.max_inflght: unknown key (did you mean 'max_inflight'?)"),
    ("unknown env key", GOOD + 'grup_size = 3\n', "env[0].grup_size: unknown key"),
    ("wrong type int", GOOD.replace("batch_size = 16", 'batch_size = "16"'),
     "scheduler.batch_size: expected an integer, got a string"),
    ("wrong type bool", GOOD + "group_scoring = 1\n", "env[0].group_scoring: expected true or false"),
    ("wrong type list", GOOD.replace('servers = ["http://127.0.0.1:8000/v1"]', 'servers = "http://x"'),
     "inference.servers: expected an array of a string"),
    ("wrong type table", GOOD + "sampling = 3\n", "env[0].sampling: expected a table"),
    ("missing servers", GOOD.replace('servers = ["http://127.0.0.1:8000/v1"]', "request_timeout_s = 3.0"),
     "inference.servers: at least one server URL is required"),
    ("missing inference", GOOD.replace('[inference]\nservers = ["http://127.0.0.1:8000/v1"]', ""),
     "inference: missing required key"),
    ("missing taskset", GOOD.replace('taskset = "orchestrator-arithmetic"', ""),
     "env[0].taskset: missing required key"),
    ("no env", GOOD[: GOOD.index("[[env]]")], "env: missing required key"),
    ("out of range", GOOD + "weight = 0\n", "env[0].weight: expected a value > 0"),
    ("above range", GOOD + "sampling = { top_p = 1.5 }\n", "env[0].sampling.top_p: expected a value <= 1"),
    ("bad literal", GOOD + '\n[transport]\nkind = "carrier-pigeon"\n', "transport.kind: expected one of"),
    ("both batch size and budget", GOOD.replace("batch_size = 16", "batch_size = 16\ntoken_budget = 100"),
     "scheduler.batch_size / scheduler.token_budget: set exactly one"),
    ("group larger than inflight", GOOD.replace("batch_size = 16", "batch_size = 16\nmax_inflight = 2"),
     "env[0].group_size: 4 is larger than scheduler.max_inflight"),
    ("off-policy below async",
     GOOD.replace("batch_size = 16", "batch_size = 16\nmax_async_level = 3\nmax_off_policy_steps = 2"),
     "scheduler.max_off_policy_steps: must be >="),
    ("buffer below batch", GOOD.replace("batch_size = 16", "batch_size = 16\nmax_buffered_rollouts = 8"),
     "scheduler.max_buffered_rollouts: must be >="),
    ("duplicate env names", GOOD + '\n[[env]]\ntaskset = "orchestrator-arithmetic"\ngroup_size = 2\n',
     "env[1].name: 'orchestrator-arithmetic' is already used"),
    ("not a URL", GOOD.replace("http://127.0.0.1:8000/v1", "127.0.0.1:8000"),
     "inference.servers[0]: expected an http:// or https:// URL"),
    ("prime-rl without a tcp address", GOOD + '\n[transport]\nkind = "prime-rl"\ntrainer_dir = "t"\n',
     "transport.address: kind = 'prime-rl' binds prime-rl's publisher at tcp://HOST:PORT (READY at PORT + 1)"),
    ("prime-rl without its trainer's directory",
     GOOD + '\n[transport]\nkind = "prime-rl"\naddress = "tcp://127.0.0.1:5555"\n',
     "transport.trainer_dir: required when kind = 'prime-rl'"),
    ("prime-rl with markers", GOOD + '\n[transport]\nkind = "prime-rl"\naddress = "tcp://127.0.0.1:5555"\n'
     'trainer_dir = "t"\ncheckpoint_source = "marker"\n',
     "transport.checkpoint_source: kind = 'prime-rl' reads checkpoints from transport.trainer_dir/broadcasts"),
    ("prime-rl files with an address", GOOD + '\n[transport]\nkind = "prime-rl"\nprime_rl_layout = "filesystem"\n'
     'address = "tcp://127.0.0.1:5555"\ntrainer_dir = "t"\n', "transport.address: unused with prime_rl_layout"),
    ("prime-rl port without a next one",
     GOOD + '\n[transport]\nkind = "prime-rl"\naddress = "tcp://127.0.0.1:65535"\ntrainer_dir = "t"\n',
     "transport.address: kind = 'prime-rl' binds"),
    ("prime-rl env named all", GOOD.replace("group_size = 4", 'group_size = 4\nname = "all"') + '\n[transport]\n'
     'kind = "prime-rl"\naddress = "tcp://127.0.0.1:5555"\ntrainer_dir = "t"\n', "env[0].name: 'all' is reserved"),
    ("trainer_dir without prime-rl", GOOD + '\n[transport]\ntrainer_dir = "t"\n',
     "transport.trainer_dir: applies only to kind = 'prime-rl' (kind = 'zmq')"),
    ("filesystem without markers", GOOD + '\n[transport]\nkind = "filesystem"\ndirectory = "b"\n',
     "transport.checkpoint_source: must be 'marker' when kind = 'filesystem'"),
    ("marker without dir", GOOD + '\n[transport]\ncheckpoint_source = "marker"\n',
     "transport.marker_dir: required"),
    ("lag error below warn", GOOD + "\n[monitor]\nlag_warn_ms = 100.0\nlag_error_ms = 10.0\n",
     "monitor.lag_error_ms: must be >="),
    ("not TOML", GOOD + "\n[[env]\n", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "expected"), [(t, k) for _, t, k in BAD], ids=[d for d, _, _ in BAD])
def test_bad_config_exits_2_naming_the_key(
    text: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, text)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert str(path) in err


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml: file not found" in capsys.readouterr().err


def test_bad_override_syntax_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(write(tmp_path, GOOD)), "--set", "scheduler.max_inflight"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_process_exit_status_is_2(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "bogus = 1\n")
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "check", str(path)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 2
    assert "env[0].bogus: unknown key" in proc.stderr
    assert proc.stdout == ""


def test_jobconfig_requires_keyword_arguments() -> None:
    with pytest.raises(TypeError):
        JobConfig()


def secured(keys: KeySet, address: str = "tcp://0.0.0.0:5600") -> str:
    return GOOD.replace("batch_size = 16", f'batch_size = 16\nworker_address = "{address}"') + (
        f'\n[security]\nserver_key = "{keys.server_secret}"\nauthorized_keys = "{keys.authorized_dir}"\n')


def test_keys_allow_binding_other_interfaces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = make_key_set(tmp_path / "keys")
    path = write(tmp_path, secured(keys) + '\n[transport]\naddress = "tcp://10.1.2.3:5555"\n')
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f'server_key = "{keys.server_secret}"' in out
    assert "allow_unauthenticated_trainer = false" in out


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5600", "tcp://localhost:5600", "tcp://[::1]:5600",
                                     "ipc:///tmp/workers.sock"])
def test_loopback_and_ipc_need_no_keys(address: str, tmp_path: Path) -> None:
    text = GOOD.replace("batch_size = 16", f'batch_size = 16\nworker_address = "{address}"')
    cfg = load_config(write(tmp_path, text))
    assert cfg.scheduler.worker_address == address
    assert cfg.security.server_keys(address) is None


def test_prime_rl_on_another_host_needs_the_opt_in(tmp_path: Path) -> None:
    text = GOOD + '\n[transport]\nkind = "prime-rl"\naddress = "tcp://10.1.2.3:5555"\ntrainer_dir = "t"\n'
    with pytest.raises(ConfigError, match="prime-rl's trainer has no CURVE support"):
        load_config(write(tmp_path, text))
    cfg = load_config(write(tmp_path, text + "\n[security]\nallow_unauthenticated_trainer = true\n"))
    assert cfg.security.allow_unauthenticated_trainer


def test_key_paths_are_relative_to_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Like run.output_dir and the other paths (only ``include`` is relative to the including file)."""
    make_key_set(tmp_path / "keys")
    (tmp_path / "configs").mkdir()
    path = write(tmp_path / "configs", secured(KeySet(Path("keys"))))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path)
    assert cfg.security.server_key == "keys/server/orchestrator.key_secret"  # as written, not resolved
    server = cfg.security.server_keys("tcp://0.0.0.0:5600")
    assert server is not None
    assert len(server.authorized) == 1
    assert cfg.security.server_keys("ipc:///tmp/workers.sock") is None  # file permissions guard ipc://
    monkeypatch.chdir(tmp_path / "configs")
    with pytest.raises(ConfigError, match=r"security\.server_key: keys/server/orchestrator\.key_secret: no such file"):
        load_config(path)
