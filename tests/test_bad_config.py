"""Malformed job configs through the real command line: ``check`` and ``run`` exit 2 and start nothing.

Every case names what stderr must say: the file (or ``--set``), the full key path and what was expected.
Most cases call ``orchestrator.cli.main`` in this process (fast); a few run ``python -m orchestrator`` as a
real process. tests/test_config.py covers ``check`` on other keys; the cases here add ``run``, includes,
overrides, arrays of tables and the cross-checks it does not reach. The tests after the table show configs
that are wrong but are not rejected before anything starts (bugs: they fail until config.py checks them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.testing.procs import processes_mentioning

BASE = """\
[run]
name = "bad"
output_dir = "{out}"
max_steps = 2

[inference]
servers = ["http://127.0.0.1:9/v1"]

[scheduler]
batch_size = 8

[[env]]
name = "arith"
taskset = "orchestrator-arithmetic"
group_size = 4
"""

INCLUDE = 'include = ["envs/b.toml"]\n'

# key files as `orchestrator keys` writes them (Z85 keys from the ZMQ CURVE documentation)
PUBLIC_KEY = 'curve\n    public-key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"\n'
SECRET_KEY = PUBLIC_KEY + '    secret-key = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"\n'
SECURITY = '\n[security]\nserver_key = "{dir}/keys/orchestrator.key_secret"\nauthorized_keys = "{dir}/authorized"\n'
KEY_FILES = {"keys/orchestrator.key_secret": SECRET_KEY, "authorized/trainer.key": PUBLIC_KEY}
WORKERS_ON_ALL_INTERFACES = BASE.replace("batch_size = 8", 'batch_size = 8\nworker_address = "tcp://0.0.0.0:5600"')
PRIME_RL = '\n[transport]\nkind = "prime-rl"\naddress = "tcp://10.1.2.3:5555"\ntrainer_dir = "trainer"\n'


@dataclass(frozen=True)
class Case:
    """A bad config: the job file's text ({out} is the output dir), extra files, ``--set`` options, and
    what stderr must say: ``{source}: {key}: `` then ``expected``. ``{dir}`` in ``text``, ``sets`` and ``source``
    is the job's folder."""

    id: str
    text: str
    expected: str
    source: str = "{dir}/job.toml"
    key: str | None = None  # None: no key path applies (a file that cannot be read as TOML)
    files: dict[str, str] = field(default_factory=dict)
    sets: tuple[str, ...] = ()


def line_of(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


SYNTAX_ERROR = BASE.replace("batch_size = 8", "batch_size = 8\nmax_inflight = ")

CASES = [
    # [scheduler.concurrency]: thresholds out of order, a bound above max_inflight
    Case("concurrency-thresholds-out-of-order", BASE + "\n[scheduler.concurrency]\ntrim_to = 0.85\n",
         "must be below scheduler.concurrency.trim_above", key="scheduler.concurrency.trim_to"),
    Case("concurrency-floor-above-max-inflight", BASE + "\n[scheduler.concurrency]\nmin_per_server = 100\n",
         "must be <= scheduler.max_inflight (100 > 64)", key="scheduler.concurrency.min_per_server"),
    # unknown keys: top level, nested, inside [[env]] and inside an array of tables
    Case("unknown-top-level-scalar", "verbose = true\n" + BASE, "unknown key; valid keys: run, model,", key="verbose"),
    Case("unknown-nested-key", BASE + '\n[transport]\naddres = "ipc:///tmp/x"\n',
         "unknown key (did you mean 'address'?)", key="transport.addres"),
    Case("unknown-key-in-env-subtable", BASE + "sampling = { temprature = 0.5 }\n",
         "unknown key (did you mean 'temperature'?)", key="env[0].sampling.temprature"),
    Case("unknown-key-in-filter-table",
         BASE + '\n[[pipeline.filters]]\nname = "gibberish"\nenforce = false\narg = {}\n',
         "unknown key (did you mean 'args'?)", key="pipeline.filters[0].arg"),
    # wrong types
    Case("string-for-number", BASE.replace('servers = ["http://127.0.0.1:9/v1"]',
                                           'servers = ["http://127.0.0.1:9/v1"]\nrequest_timeout_s = "10s"'),
         "expected a number, got a string '10s'", key="inference.request_timeout_s"),
    Case("boolean-for-integer", BASE.replace("max_steps = 2", "max_steps = true"),
         "expected an integer, got a boolean True", key="run.max_steps"),
    Case("float-for-integer", BASE.replace("batch_size = 8", "batch_size = 8\nmax_inflight = 8.5"),
         "expected an integer, got a float 8.5", key="scheduler.max_inflight"),
    Case("bad-array-item", BASE.replace('servers = ["http://127.0.0.1:9/v1"]',
                                        'servers = ["http://127.0.0.1:9/v1", 8000]'),
         "expected a string, got an integer 8000", key="inference.servers[1]"),
    Case("array-of-tables-for-table", BASE.replace("[inference]", "[[inference]]"),
         "expected a table, got an array", key="inference"),
    Case("string-for-args-table", BASE + 'args = "max_operand=5"\n', "expected a table, got a string",
         key="env[0].args"),
    Case("bad-dump-step-item", BASE + '\n[pipeline]\ndump_steps = [1, "2"]\n',
         "expected an integer, got a string '2'", key="pipeline.dump_steps[1]"),
    # missing required keys
    Case("filter-without-enforce", BASE + '\n[[pipeline.filters]]\nname = "gibberish"\n',
         "missing required key; expected true or false", key="pipeline.filters[0].enforce"),
    Case("included-env-without-taskset", INCLUDE + BASE, "missing required key; expected a string",
         source="{dir}/envs/b.toml: env[0]", key="env[1].taskset",
         files={"envs/b.toml": '[[env]]\nname = "b"\ngroup_size = 2\n'}),
    # out of range (bounds are checked, never clamped)
    Case("above-upper-bound", BASE + "\n[sim]\nnum_experts = 70000\n", "expected a value <= 65535, got 70000",
         key="sim.num_experts"),
    Case("niceness-above-19", BASE.replace("batch_size = 8", "batch_size = 8\nworker_nice = 20"),
         "expected a value <= 19, got 20", key="scheduler.worker_nice"),
    Case("nan-temperature", BASE + "sampling = { temperature = nan }\n", "expected a finite number, got nan",
         key="env[0].sampling.temperature"),
    Case("negative-interval", BASE.replace('servers = ["http://127.0.0.1:9/v1"]',
                                           'servers = ["http://127.0.0.1:9/v1"]\nprobe_interval_s = -1.0'),
         "expected a value > 0, got -1.0", key="inference.probe_interval_s"),
    Case("lag-window-too-small", BASE + "\n[monitor]\nlag_window = 8\n", "expected a value >= 16, got 8",
         key="monitor.lag_window"),
    # combinations that cannot work
    Case("max-concurrent-below-group", BASE + "max_concurrent = 2\n", "must be >= group_size (2 < 4)",
         key="env[0].max_concurrent"),
    Case("filesystem-without-directory", BASE + '\n[transport]\nkind = "filesystem"\n',
         "required when kind = 'filesystem'", key="transport.directory"),
    Case("direct-data-plane-keeping-acked-steps", BASE + '\n[transport]\ndata_plane = "direct"\nkeep_acked = 2\n',
         "'direct' needs kind = 'zmq' and keep_acked = 0", key="transport.data_plane"),
    Case("direct-data-plane-on-shm", BASE + '\n[transport]\ndata_plane = "direct"\nkind = "shm"\n',
         "'direct' needs kind = 'zmq' and keep_acked = 0", key="transport.data_plane"),
    Case("span-address-with-a-fixed-port", BASE + '\n[transport]\ndata_plane = "direct"\n'
         'span_address = "tcp://127.0.0.1:7000"\n', "expected tcp://HOST:0", key="transport.span_address"),
    Case("span-address-through", BASE + '\n[transport]\nspan_address = "tcp://127.0.0.1:0"\n',
         "and data_plane = 'direct'", key="transport.span_address"),
    Case("span-address-on-the-network-without-keys", BASE + '\n[transport]\ndata_plane = "direct"\n'
         'span_address = "tcp://10.1.2.3:0"\n', "without CURVE keys", key="transport.span_address"),
    Case("worker-pool-of-zero-mb", BASE + '\n[transport]\nworker_pool_mb = 0\n', ">= 1",
         key="transport.worker_pool_mb"),
    Case("layers-without-top-k", BASE + "\n[sim]\nlayers = 2\n", "set both (routed experts) or neither",
         key="sim.layers / sim.top_k"),
    Case("latency-range-reversed", BASE + "\n[sim]\nlatency_ms = 10.0\nlatency_max_ms = 5.0\n",
         "must be >= sim.latency_ms", key="sim.latency_max_ms"),
    Case("negative-dump-step", BASE + "\n[pipeline]\ndump_steps = [0, -3]\n",
         "expected a step number >= 0, got -3", key="pipeline.dump_steps[1]"),
    Case("neither-batch-size-nor-budget", BASE.replace("batch_size = 8", "max_inflight = 8"),
         "set exactly one of them", key="scheduler.batch_size / scheduler.token_budget"),
    # on-policy distillation: an env that distils needs a [teacher]; the teacher's own keys
    Case("opd-without-teacher", BASE + 'algorithm = "opd"\n', "'opd' scores every sample under a teacher: add a "
         "[teacher] table", key="env[0].algorithm"),
    Case("unknown-algorithm", BASE + 'algorithm = "distill"\n', "expected one of 'reward', 'opd', 'reward+opd'",
         key="env[0].algorithm"),
    Case("opd-weight-zero", BASE + "opd_weight = 0.0\n", "expected a value > 0, got 0.0", key="env[0].opd_weight"),
    Case("teacher-without-model", BASE + '\n[teacher]\nservers = ["http://127.0.0.1:9/v1"]\n',
         "missing required key; expected a string (the teacher's served model name)", key="teacher.model"),
    Case("teacher-server-not-a-url", BASE + '\n[teacher]\nservers = ["127.0.0.1:9"]\nmodel = "t"\n',
         "expected an http:// or https:// URL, got '127.0.0.1:9'", key="teacher.servers[0]"),
    Case("teacher-without-servers", BASE + '\n[teacher]\nservers = []\nmodel = "t"\n',
         "at least one teacher server URL is required", key="teacher.servers"),
    # the environment list
    Case("empty-env-list", "env = []\n" + BASE[: BASE.index("[[env]]")],
         "at least one [[env]] table is required", key="env"),
    Case("env-is-not-tables", "env = 3\n" + BASE[: BASE.index("[[env]]")],
         "expected [[env]] tables, got an integer", key="env"),
    Case("env-items-are-not-tables", 'env = ["arith"]\n' + BASE[: BASE.index("[[env]]")],
         "expected a table, got a string", key="env[0]"),
    Case("no-servers", BASE.replace('servers = ["http://127.0.0.1:9/v1"]', "servers = []"),
         "at least one server URL is required", key="inference.servers"),
    Case("duplicate-name-across-include", INCLUDE + BASE, "'arith' is already used by env[0]",
         source="{dir}/envs/b.toml: env[0]", key="env[1].name",
         files={"envs/b.toml": '[[env]]\nname = "arith"\ntaskset = "orchestrator-guess-number"\ngroup_size = 2\n'}),
    # CURVE keys: set in pairs, usable files, and nothing reachable from other hosts without them
    Case("server-key-without-authorized-keys", BASE + SECURITY[: SECURITY.index("authorized_keys")],
         "required when security.server_key is set", key="security.authorized_keys", files=KEY_FILES),
    Case("missing-server-key-file", BASE + SECURITY, "no such file; make keys with `orchestrator keys DIR --name",
         key="security.server_key", files={"authorized/trainer.key": PUBLIC_KEY}),
    Case("public-key-as-server-key", BASE + SECURITY, "holds only a public key; expected the secret key file",
         key="security.server_key", files={**KEY_FILES, "keys/orchestrator.key_secret": PUBLIC_KEY}),
    Case("not-a-key-file", BASE + SECURITY, "not a CURVE key file (no public-key line)", key="security.server_key",
         files={**KEY_FILES, "keys/orchestrator.key_secret": "[run]\n"}),
    Case("missing-authorized-keys-dir", BASE + SECURITY, "no such directory; create it and copy the public",
         key="security.authorized_keys", files={"keys/orchestrator.key_secret": SECRET_KEY}),
    Case("secret-key-among-authorized-keys", BASE + SECURITY, "holds a secret key; expected a public key file",
         key="security.authorized_keys", files={**KEY_FILES, "authorized/trainer.key": SECRET_KEY}),
    Case("workers-on-all-interfaces-without-keys", WORKERS_ON_ALL_INTERFACES,
         "tcp://0.0.0.0:5600 can be reached from other hosts, and without CURVE keys anyone who reaches it can "
         "connect as an env worker. Make keys (`orchestrator keys keys --name orchestrator`",
         key="scheduler.worker_address"),
    Case("trainer-address-on-a-lan-without-keys", BASE + '\n[transport]\naddress = "tcp://10.1.2.3:5555"\n',
         "or bind 127.0.0.1", key="transport.address"),
    Case("prime-rl-on-a-lan-without-opt-in", BASE + PRIME_RL,
         "unauthenticated and unencrypted (prime-rl's trainer has no CURVE support)", key="transport.address"),
    Case("unauthenticated-trainer-opt-in-for-zmq", BASE + "\n[security]\nallow_unauthenticated_trainer = true\n",
         "applies only to transport.kind = 'prime-rl'", key="security.allow_unauthenticated_trainer"),
    Case("set-server-key-to-a-public-key", BASE + SECURITY, "holds only a public key",
         source="--set security.server_key", key="security.server_key", files=KEY_FILES,
         sets=("security.server_key={dir}/authorized/trainer.key",)),
    # files that cannot be read
    Case("toml-syntax-error", SYNTAX_ERROR,
         f"not valid TOML: Invalid value (at line {line_of(SYNTAX_ERROR, 'max_inflight')}"),
    Case("toml-syntax-error-in-include", INCLUDE + BASE, "not valid TOML: Invalid value (at line 2",
         source="{dir}/envs/b.toml", files={"envs/b.toml": '[[env]]\ntaskset = \n'}),
    Case("missing-include", INCLUDE + BASE, "file not found", source="{dir}/envs/b.toml"),
    Case("include-is-not-a-list", 'include = "envs/b.toml"\n' + BASE,
         "expected a list of file paths, got 'envs/b.toml'", key="include"),
    Case("include-holds-other-tables", INCLUDE + BASE,
         "unknown key (an included file holds only [[env]] tables)", source="{dir}/envs/b.toml", key="run",
         files={"envs/b.toml": '[run]\nmax_steps = 3\n'}),
    # bad --set overrides
    Case("set-index-out-of-range", BASE, "index 3 out of range (1 entries)", source="--set env[3].group_size",
         sets=("env[3].group_size=2",)),
    Case("set-wrong-type", BASE, "expected an integer, got a string 'lots'", source="--set scheduler.max_inflight",
         key="scheduler.max_inflight", sets=("scheduler.max_inflight=lots",)),
    Case("set-unknown-key", BASE, "unknown key (did you mean 'batch_size'?)", source="--set scheduler.batch_sise",
         key="scheduler.batch_sise", sets=("scheduler.batch_sise=8",)),
    Case("set-without-key", BASE, "expected KEY=VALUE", source="--set =5", sets=("=5",)),
    Case("set-below-a-scalar", BASE, "run.name is not a table", source="--set run.name.first",
         sets=("run.name.first=x",)),
]


def write_case(case: Case, tmp_path: Path) -> Path:
    for name, text in case.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    job = tmp_path / "job.toml"
    job.write_text(case.text.replace("{out}", str(tmp_path / "out")).replace("{dir}", str(tmp_path)))
    return job


def argv(command: str, job: Path, sets: tuple[str, ...] = ()) -> list[str]:
    return [command, str(job), *(a for s in sets for a in ("--set", s.replace("{dir}", str(job.parent))))]


def assert_names_the_problem(err: str, case: Case, tmp_path: Path) -> None:
    assert err.startswith("config error ("), err
    where = case.source.replace("{dir}", str(tmp_path))
    prefix = f"{where}: {case.key}: " if case.key else f"{where}: "
    assert prefix in err, f"{prefix!r} not in stderr:\n{err}"
    assert case.expected in err, f"{case.expected!r} not in stderr:\n{err}"


def test_base_config_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cases below break a config that passes: each is rejected for the reason it names."""
    job = write_case(Case("base", BASE, ""), tmp_path)
    assert main(["check", str(job)]) == 0
    assert "OK (1 environment)" in capsys.readouterr().out


@pytest.mark.timeout(30)  # a case that wrongly passed validation would start a run against a dead server
@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_config_exits_2_and_starts_nothing(case: Case, command: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    job = write_case(case, tmp_path)
    assert main(argv(command, job, case.sets)) == 2
    out, err = capsys.readouterr()
    assert out == ""  # check prints no resolved config, run no progress
    assert_names_the_problem(err, case, tmp_path)
    assert not (tmp_path / "out").exists()  # nothing started: no output dir, no sockets


def test_every_problem_of_a_config_is_named_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = INCLUDE + BASE + "grup_size = 3\n" + "\n[sim]\nerror_rate = 1.5\n"
    job = write_case(Case("many", text, "", files={"envs/b.toml": '[[env]]\ntaskset = "x"\ngroup_size = 0\n'}),
                     tmp_path)
    assert main(argv("run", job, ("run.max_steps=0",))) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error (4 problems):"), err
    for needle in (f"{job}: env[0].grup_size: unknown key", f"{job}: sim.error_rate: expected a value <= 1",
                   f"{tmp_path}/envs/b.toml: env[0]: env[1].group_size: expected a value >= 1, got 0",
                   "--set run.max_steps: run.max_steps: expected a value >= 1, got 0"):
        assert needle in err, needle
    assert not (tmp_path / "out").exists()


SUBPROCESS_CASES = [c for c in CASES if c.id in ("unknown-key-in-env-subtable", "toml-syntax-error",
                                                  "missing-include", "set-wrong-type")]


@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize("case", SUBPROCESS_CASES, ids=[c.id for c in SUBPROCESS_CASES])
def test_real_process_exits_2_and_starts_nothing(case: Case, command: str, tmp_path: Path) -> None:
    job = write_case(case, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "orchestrator", *argv(command, job, case.sets)],
                          capture_output=True, text=True, timeout=180, check=False,
                          env={**os.environ, "HOME": str(tmp_path / "home")})
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert_names_the_problem(proc.stderr, case, tmp_path)
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------
# Wrong configs that are not rejected up front. Each test states the behaviour the bug report asks for.


@pytest.mark.parametrize(("section", "key"), [
    ('[pipeline]\nadvantage = "no_such_module_xyz:advantage"', "pipeline.advantage"),
    ('[[pipeline.filters]]\nname = "no_such_filter"\nenforce = true', "pipeline.filters[0].name"),
    ('[[pipeline.filters]]\nname = "repetition"\nenforce = false\nargs = { windw = 10 }', "pipeline.filters[0].args"),
], ids=["advantage-module", "filter-name", "filter-args"])
def test_check_rejects_hooks_that_cannot_be_resolved(section: str, key: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Was: ``check`` accepts an advantage or filter that cannot be imported or called; only ``run`` finds
    out, after it has started (see the next test), and its message names no file."""
    job = write_case(Case("hook", BASE + "\n" + section + "\n", ""), tmp_path)
    code = main(["check", str(job)])
    err = capsys.readouterr().err
    assert code == 2, f"check accepted a {key} that run cannot use"
    assert f"{job}: {key}: " in err, err


@pytest.mark.slow
def test_run_with_an_unresolvable_hook_starts_nothing(tmp_path: Path) -> None:
    """Was: ``run`` creates the output dir, binds its sockets and starts an env worker before it imports
    ``pipeline.advantage``; it then exits 2 with a message that names no file."""
    job = write_case(Case("hook", BASE + '\n[pipeline]\nadvantage = "no_such_module_xyz:advantage"\n', ""), tmp_path)
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(job)], capture_output=True, text=True,
                          timeout=180, check=False, env={**os.environ, "HOME": str(tmp_path / "home")})
    assert proc.returncode == 2, proc.stderr
    assert processes_mentioning(str(tmp_path / "out")) == []  # whatever it started is gone again
    assert "started env worker" not in proc.stderr, "an env worker was started for a config that cannot run"
    out = tmp_path / "out"
    assert not out.exists(), f"output dir created, holding {sorted(p.name for p in out.iterdir())}"
    assert f"{job}: pipeline.advantage: " in proc.stderr, proc.stderr


def test_infinite_env_weight_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was: ``weight = inf`` passes (only ``> 0`` is checked); ``run`` then crashes in the scheduler's mixing
    (``ValueError: Probabilities contain NaN``, a traceback and exit 1) once the workers are up."""
    job = write_case(Case("weight", BASE + "weight = inf\n", ""), tmp_path)
    assert main(["check", str(job)]) == 2, "check accepted env[0].weight = inf"
    assert f"{job}: env[0].weight: " in capsys.readouterr().err


BAD_WORKER_ADDRESS = BASE.replace("batch_size = 8", 'batch_size = 8\nworker_address = "127.0.0.1:5600"')
ADDRESS_CASES = [
    pytest.param(BASE + '\n[transport]\naddress = "localhost:5555"\n', "transport.address", id="transport"),
    pytest.param(BAD_WORKER_ADDRESS, "scheduler.worker_address", id="scheduler"),
]


@pytest.mark.parametrize(("text", "key"), ADDRESS_CASES)
def test_check_rejects_a_zmq_address_without_a_scheme(text: str, key: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Was: ZMQ addresses are not checked (see the next test for what ``run`` then does)."""
    job = write_case(Case("address", text, ""), tmp_path)
    assert main(["check", str(job)]) == 2, f"check accepted {key} without tcp:// or ipc://"
    assert f"{job}: {key}: " in capsys.readouterr().err


@pytest.mark.parametrize(("text", "key"), ADDRESS_CASES)
def test_run_rejects_a_zmq_address_without_a_scheme(text: str, key: str, tmp_path: Path) -> None:
    """Was: ``run`` creates the output dir and then dies in ``bind`` with a ``zmq.error.ZMQError: Invalid
    argument`` traceback (exit 1) instead of a config error. A real process: in this one the failed
    ``scheduler.worker_address`` bind would leak a ZMQ context (see the next test)."""
    job = write_case(Case("address", text, ""), tmp_path)
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(job)], capture_output=True, text=True,
                          timeout=180, check=False, env={**os.environ, "HOME": str(tmp_path / "home")})
    assert proc.returncode == 2, proc.stderr[-600:]
    assert f"{job}: {key}: " in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_failed_worker_address_bind_leaks_nothing(tmp_path: Path) -> None:
    """Was: when ``WorkerHub.open`` cannot bind ``scheduler.worker_address`` it leaves its ZMQ context and
    socket open (no try/finally around ``bind``); the next garbage collection in that process then blocks
    for ever in ``zmq.Context.__del__`` -> ``term()``. An embedding process (or a test) calling
    ``Orchestrator.open`` with a bad or busy address hangs."""
    job = write_case(Case("address", BAD_WORKER_ADDRESS, ""), tmp_path)
    code = ("import gc, sys\nfrom orchestrator.cli import main\n"
            "try:\n    main(['run', sys.argv[1]])\nexcept Exception as e:\n    print(type(e).__name__)\n"
            "gc.collect()\nprint('collected')\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True, text=True, timeout=180,
                              check=False, env={**os.environ, "HOME": str(tmp_path / "home")})
    except subprocess.TimeoutExpired:  # a hang guard: the process takes seconds, more on a busy machine
        pytest.fail("the process did not end within 180 s: gc.collect() hangs after a failed bind of "
                    "scheduler.worker_address")
    assert "collected" in proc.stdout, proc.stderr[-600:]


def test_missing_include_names_the_including_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was: a missing include is reported as ``<dir>/envs/b.toml: file not found``: neither the job
    file that names it nor the key (``include[1]``) is in the message."""
    job = write_case(Case("include", 'include = ["envs/a.toml", "envs/b.toml"]\n' + BASE, "",
                          files={"envs/a.toml": '[[env]]\nname = "a"\ntaskset = "orchestrator-arithmetic"\n'}),
                     tmp_path)
    assert main(["check", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/envs/b.toml: file not found" in err, err
    assert f"{job}: include[1]: " in err, err


def test_set_problem_is_attributed_to_the_set_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was: ``--set scheduler.max_async_level.x=1`` (below a key the file does not set) is
    reported against the job file, which never mentions it: ``job.toml: scheduler.max_async_level: expected
    an integer, got a table``."""
    job = write_case(Case("set", BASE, ""), tmp_path)
    assert main(["check", str(job), "--set", "scheduler.max_async_level.x=1"]) == 2
    err = capsys.readouterr().err
    assert "scheduler.max_async_level" in err, err
    assert "--set scheduler.max_async_level" in err, err
    assert f"{job}: scheduler.max_async_level" not in err, err
