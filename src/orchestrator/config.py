"""The job's configuration: TOML in, a frozen typed tree out.

One TOML file per job. Each section is a frozen dataclass that lives with the stage that uses it (``[scheduler]``
in rollouts/config.py, ``[pipeline]`` in scoring/config.py, ``[transport]`` in delivery/config.py...) and checks
itself (``problems``, see configbase); this module holds the job's tree (``JobConfig``), the loader, the checks
across sections and ``to_toml``. Every field has a documented default or is required. ``[[env]]`` tables (one
per environment) may live in the job file or in per-env files named by a top-level
``include = ["envs/a.toml", ...]`` (paths relative to the including file).

Validation only checks: a config that loads is exactly what the user wrote plus the defaults documented
here. Every problem names the file (or ``--set``) and the full key path, and all problems are reported at
once. The only conversion is TOML's integer to a float field (``1`` for ``1.0``).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orchestrator.configbase import Source, opt
from orchestrator.delivery.config import TransportConfig
from orchestrator.errors import ConfigError
from orchestrator.inference.config import InferenceConfig, ModelConfig, TeacherConfig
from orchestrator.launch.config import LaunchConfig, launch_problems
from orchestrator.rollouts.config import (
    OWNED_SAMPLING_KEYS,
    EnvConfig,
    EvalConfig,
    SamplingConfig,
    SchedulerConfig,
    rollout_problems,
)
from orchestrator.rollouts.curriculum import CurriculumConfig
from orchestrator.scoring.checks import hook_problems
from orchestrator.scoring.config import DEFAULT_FILTERS, FilterConfig, PipelineConfig
from orchestrator.scoring.gates import GateConfig
from orchestrator.security import SecurityConfig, is_loopback
from orchestrator.sim.config import SimConfig
from orchestrator.sinks.config import MonitorConfig, WandbConfig

# the sections live with the stage that uses them; their names stay importable from here
__all__ = [
    "DEFAULT_FILTERS", "OWNED_SAMPLING_KEYS", "CurriculumConfig", "EnvConfig", "EvalConfig", "FilterConfig",
    "GateConfig", "InferenceConfig", "JobConfig", "ModelConfig", "MonitorConfig", "PipelineConfig", "RunConfig",
    "SamplingConfig", "SchedulerConfig", "SecurityConfig", "SimConfig", "TeacherConfig", "TransportConfig",
    "WandbConfig",
    "load_config", "to_toml",
]


@dataclass(frozen=True)
class RunConfig:
    name: str = opt("run", doc="run id, stamped on every batch sent to the trainer")
    output_dir: str = opt("outputs/run", doc="rollouts.jsonl, metrics.jsonl, dumps and state go here")
    seed: int = opt(0, ge=0, doc="seeds task order and the simulated servers")
    max_steps: int = opt(100, ge=1, doc="steps to run before a clean exit")
    gil_switch_ms: float = opt(0.5, gt=0, le=100, doc="sys.setswitchinterval of the orchestrator process: how long "
                               "the event loop can wait for the GIL while a step thread runs Python (Python's "
                               "default, 5 ms, is the worst loop stall it allows; bench_data_plane.py measured "
                               "max lag 3-8 ms with it, 2.6-3.3 ms with 0.5)")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    run: RunConfig = opt(RunConfig(), doc="run identity and output")
    model: ModelConfig = opt(ModelConfig(), doc="model and tokenizer")
    inference: InferenceConfig = opt(doc="inference servers")
    teacher: TeacherConfig | None = opt(None, doc="[teacher]: the frozen model env workers score samples with, for "
                                        "envs whose algorithm is 'opd' or 'reward+opd'; unset: none")
    scheduler: SchedulerConfig = opt(SchedulerConfig(), doc="rollout scheduling")
    transport: TransportConfig = opt(TransportConfig(), doc="batches to the trainer")
    security: SecurityConfig = opt(SecurityConfig(), doc="CURVE authentication of the tcp:// sockets we bind")
    monitor: MonitorConfig = opt(MonitorConfig(), doc="event-loop-lag monitor")
    pipeline: PipelineConfig = opt(PipelineConfig(), doc="advantages, filters and gates")
    eval: EvalConfig | None = opt(None, doc="[eval]: online evaluation; unset: none")
    sim: SimConfig = opt(SimConfig(), doc="simulated inference servers (demo and tests)")
    launch: LaunchConfig | None = opt(None, doc="[launch]: where each role runs on a cluster (orchestrator launch "
                                      "slurm|k8s, docs/launch.md); unset: not launched on a cluster")
    env: tuple[EnvConfig, ...] = opt(doc="one [[env]] table per environment")


# ---------------------------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read ``path`` (and its includes), apply ``--set key=value`` overrides, and validate.

    Raises ConfigError listing every problem found, each naming its file (or ``--set``) and key path.
    """
    path = Path(path)
    raw, env_files = _read_with_includes(path)
    set_keys: set[str] = set()
    for item in overrides:
        key = _apply_override(raw, item)
        set_keys.add(key)

    def source(key: str) -> str:
        for k in set_keys:
            if key == k or key.startswith((k + ".", k + "[")) or k.startswith((key + ".", key + "[")):
                return f"--set {k}"
        if key.startswith("env[") and "]" in key:
            i = int(key[4 : key.index("]")])
            if i < len(env_files):
                f, j = env_files[i]
                return f"{f}: env[{j}]" if f != str(path) else str(path)
        return str(path)

    problems: list[str] = []
    cfg = _build(JobConfig, raw, "", problems, source)
    if not problems:
        problems.extend(_section_problems(cfg, "", source))  # each section alone, then how they fit
        problems.extend(_cross_checks(typing.cast(JobConfig, cfg), source))
    if not problems:
        problems.extend(hook_problems(typing.cast(JobConfig, cfg).pipeline, source))
    if problems:
        raise ConfigError(problems)
    return typing.cast(JobConfig, cfg)


def _section_problems(obj: Any, key: str, source: Source) -> Iterable[str]:
    """What each section that checks itself (``problems(key, source)``, see configbase) says, depth first."""
    if not dataclasses.is_dataclass(obj):
        return
    check = getattr(obj, "problems", None)
    if check is not None:
        yield from check(key, source)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        sub = _join(key, f.name)
        if isinstance(value, tuple):
            for i, item in enumerate(value):
                yield from _section_problems(item, f"{sub}[{i}]", source)
        else:
            yield from _section_problems(value, sub, source)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError([f"{path}: file not found"]) from None
    except IsADirectoryError:
        raise ConfigError([f"{path}: a directory, not a TOML file"]) from None
    except OSError as e:
        raise ConfigError([f"{path}: cannot read it ({e.strerror})"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: not a text file (byte {e.start} is not UTF-8); expected TOML"]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{path}: not valid TOML: {e}"]) from None


def _read_with_includes(path: Path) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """The job file's tables with every included file's ``[[env]]`` tables appended.

    Also returns, for each env entry, the file it came from and its index there (for error messages).
    """
    raw = _read_toml(path)
    envs = raw.get("env", [])
    if not isinstance(envs, list):
        raise ConfigError([f"{path}: env: expected [[env]] tables, got {_type_name(envs)}"])
    origins = [(str(path), i) for i in range(len(envs))]
    includes = raw.pop("include", [])
    if not isinstance(includes, list) or not all(isinstance(x, str) for x in includes):
        raise ConfigError([f"{path}: include: expected a list of file paths, got {includes!r}"])
    for n, inc in enumerate(includes):
        inc_path = path.parent / inc
        try:
            inc_raw = _read_toml(inc_path)
        except ConfigError as e:  # say which file names it, and where
            raise ConfigError([f"{path}: include[{n}]: {p}" for p in e.problems]) from None
        extra = sorted(set(inc_raw) - {"env"})
        if extra:
            raise ConfigError([f"{inc_path}: {k}: unknown key (an included file holds only [[env]] tables)"
                               for k in extra])
        inc_envs = inc_raw.get("env", [])
        if not isinstance(inc_envs, list):
            raise ConfigError([f"{inc_path}: env: expected [[env]] tables, got {_type_name(inc_envs)}"])
        origins += [(str(inc_path), i) for i in range(len(inc_envs))]
        envs = envs + inc_envs
    if envs or "env" in raw:
        raw["env"] = envs
    return raw, origins


def _apply_override(raw: dict[str, Any], item: str) -> str:
    """Apply one ``a.b.c=value`` override (value parsed as TOML, else taken as a string); return the key."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError([f"--set {item}: expected KEY=VALUE, e.g. --set scheduler.max_inflight=32"])
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    parts = key.replace("[", ".").replace("]", "").split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError([f"--set {key}: index {part} out of range ({len(node)} entries)"])
            node = node[int(part)]
        else:
            node = node.setdefault(part, [] if nxt.isdigit() else {})
        if not isinstance(node, dict | list):
            raise ConfigError([f"--set {key}: {'.'.join(parts[: i + 1])} is not a table"])
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError([f"--set {key}: index {last} out of range ({len(node)} entries)"])
        node[int(last)] = value
    else:
        node[last] = value
    return ".".join(f"[{p}]" if p.isdigit() else p for p in parts).replace(".[", "[")


def _type_name(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a float"}.get(type(value), type(value).__name__)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is bool:
        return "true or false"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"an array of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a table"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp):
        return "a table"
    return str(tp)


def _build(tp: Any, value: Any, key: str, problems: list[str], source: Any) -> Any:
    """Check ``value`` against type ``tp``; return the typed value (or None after recording a problem)."""

    def bad(msg: str) -> None:
        problems.append(f"{source(key)}: {key or '(top level)'}: {msg}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _build(args[0], value, key, problems, source)
        for arg in args:  # e.g. int | tuple[int, ...]: the first member that fits
            scratch: list[str] = []
            built = _build(arg, value, key, scratch, source)
            if not scratch:
                return built
        arrays = [a for a in args if typing.get_origin(a) is tuple]
        if isinstance(value, list) and arrays:  # an array with a bad item: name the item
            return _build(arrays[0], value, key, problems, source)
        bad(f"expected {_describe(tp)}, got {_type_name(value)} {value!r}")
        return None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            bad(f"expected a table, got {_type_name(value)}")
            return None
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        for k in value:
            if k not in fields:
                close = [n for n in fields if n.startswith(k[:3])]
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"{source(_join(key, k))}: {_join(key, k)}: unknown key{hint}; "
                                f"valid keys: {', '.join(fields)}")
        kwargs: dict[str, Any] = {}
        for name, f in fields.items():
            sub = _join(key, name)
            if name not in value:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    problems.append(f"{source(sub)}: {sub}: missing required key; "
                                    f"expected {_describe(hints[name])} ({f.metadata.get('doc', '')})")
                continue
            v = value[name]
            if dataclasses.is_dataclass(hints[name]) and v is None:
                bad(f"{name}: expected a table")
                continue
            built = _build(hints[name], v, sub, problems, source)
            if built is not None:
                _check_bounds(built, f.metadata, sub, problems, source)
                kwargs[name] = built
        try:
            return typing.cast(Any, tp)(**kwargs)
        except TypeError:
            return None  # a required field was missing: already reported
    if origin is tuple:
        if not isinstance(value, list):
            bad(f"expected {_describe(tp)}, got {_type_name(value)}")
            return None
        (item_tp, _) = typing.get_args(tp)
        items = [_build(item_tp, v, f"{key}[{i}]", problems, source) for i, v in enumerate(value)]
        return tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            bad(f"expected a table, got {_type_name(value)}")
            return None
        return dict(value)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            bad(f"expected {_describe(tp)}, got {value!r}")
            return None
        return value
    if tp is bool:
        if not isinstance(value, bool):
            bad(f"expected true or false, got {_type_name(value)} {value!r}")
            return None
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            bad(f"expected an integer, got {_type_name(value)} {value!r}")
            return None
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            bad(f"expected a number, got {_type_name(value)} {value!r}")
            return None
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            bad(f"expected a string, got {_type_name(value)} {value!r}")
            return None
        return value
    if tp is Any:
        return value
    raise TypeError(f"config schema uses an unsupported type {tp!r} at {key}")  # a bug in this module


def _check_bounds(value: Any, meta: Mapping[str, Any], key: str, problems: list[str], source: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return
    if not math.isfinite(value):
        problems.append(f"{source(key)}: {key}: expected a finite number, got {value!r}")
        return
    for name, word in (("ge", ">="), ("gt", ">"), ("le", "<=")):
        bound = meta.get(name)
        if bound is None:
            continue
        ok = value >= bound if name == "ge" else value > bound if name == "gt" else value <= bound
        if not ok:
            problems.append(f"{source(key)}: {key}: expected a value {word} {bound}, got {value!r}")


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _cross_checks(cfg: JobConfig, source: Source) -> Iterable[str]:
    """Combinations of sections that cannot work, each named by the key to change (a section's own checks
    are its ``problems``)."""
    yield from rollout_problems(cfg.scheduler, cfg.env, cfg.eval, source)
    launched = cfg.launch is not None and cfg.launch.servers.own_nodes() + (cfg.launch.servers.share is not None)
    if not cfg.inference.servers and cfg.inference.discover is None and not launched:
        yield (f"{source('inference.servers')}: inference.servers: at least one server URL is required (or "
               "inference.discover, a DNS name with one address per server, or [launch.servers] nodes that start them)")
    for i, env in enumerate(cfg.env):
        if env.group_size == 1 and cfg.pipeline.advantage == "default":
            yield (f"{source(f'env[{i}].group_size')}: env[{i}].group_size: 1 with the default advantage (reward "
                   "minus the group's mean) gives every sample advantage 0: nothing would train. Use group_size "
                   ">= 2, or a pipeline.advantage with its own baseline")
        if env.distills and cfg.teacher is None:
            yield (f"{source(f'env[{i}].algorithm')}: env[{i}].algorithm: {env.algorithm!r} scores every sample "
                   "under a teacher: add a [teacher] table (servers, model), or use algorithm = 'reward'")
        if cfg.transport.kind == "prime-rl" and env.label == "all":
            yield (f"{source(f'env[{i}].name')}: env[{i}].name: 'all' is reserved by prime-rl's trainer (its metrics "
                   "aggregate); name the environment otherwise")
    if cfg.inference.weight_transfer == "broadcast" and cfg.transport.kind not in ("zmq", "shm"):
        yield (f"{source('inference.weight_transfer')}: inference.weight_transfer: 'broadcast' tells the trainer "
               f"when to send over the ZMQ trainer link (transport.kind = 'zmq' or 'shm'); kind = "
               f"{cfg.transport.kind!r} has none: use weight_transfer = 'filesystem'")
    yield from _exposure_checks(cfg, source)
    if cfg.launch is not None:
        yield from launch_problems(cfg.launch, cfg.transport.kind, source)


def _exposure_checks(cfg: JobConfig, source: Source) -> Iterable[str]:
    """No address reachable from other hosts without authentication."""
    sec, t = cfg.security, cfg.transport
    binds = [("scheduler.worker_address", cfg.scheduler.worker_address, "connect as an env worker"),
             ("transport.span_address", t.span_address, "read every rollout's columns")]
    if t.binds_batches:
        binds.append(("transport.address", t.address, "read the batches and forge the trainer's acknowledgements"))
    for key, address, risk in binds:
        if address and address.startswith("tcp://") and not is_loopback(address) and sec.server_key is None:
            yield (f"{source(key)}: {key}: {address} can be reached from other hosts, and without CURVE keys "
                   f"anyone who reaches it can {risk}. Make keys (`orchestrator keys keys --name orchestrator`, "
                   "and a pair per client), then set security.server_key = \"keys/orchestrator.key_secret\" and "
                   "security.authorized_keys = the directory of the clients' public .key files (docs/security.md); "
                   "or bind 127.0.0.1")
    trainer, opted_in = t.address or "", sec.allow_unauthenticated_trainer
    binds_trainer = t.kind == "prime-rl" and t.prime_rl_layout == "zmq" and trainer.startswith("tcp://")
    if binds_trainer and not is_loopback(trainer) and not opted_in:
        yield (f"{source('transport.address')}: transport.address: kind = 'prime-rl' publishes batches at "
               f"{trainer} unauthenticated and unencrypted (prime-rl's trainer has no CURVE support), so anyone on "
               "that network can subscribe to them or send READY in a trainer's place. Use a loopback address "
               "(e.g. through an SSH tunnel), or set security.allow_unauthenticated_trainer = true if the network "
               "between the two hosts is trusted")
    if sec.allow_unauthenticated_trainer and t.kind != "prime-rl":
        yield (f"{source('security.allow_unauthenticated_trainer')}: security.allow_unauthenticated_trainer: "
               f"applies only to transport.kind = 'prime-rl' (kind = {t.kind!r}: ZMQ links authenticate with "
               "security.server_key and security.authorized_keys); remove it")

# ---------------------------------------------------------------------------------------------- printing


def to_toml(cfg: Any) -> str:
    """The resolved config as TOML (defaults filled in); loading the output gives the same config."""
    lines: list[str] = []
    _emit_table(cfg, "", lines)
    return "\n".join(lines).strip() + "\n"


def _emit_table(obj: Any, prefix: str, lines: list[str]) -> None:
    tables: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v is None:
            lines.append(f"# {f.name} = (unset)")
        elif dataclasses.is_dataclass(v) or (isinstance(v, tuple) and v and dataclasses.is_dataclass(v[0])):
            tables.append((f.name, v))
        else:
            lines.append(f"{f.name} = {_toml_value(v)}")
    for name, v in tables:
        full = _join(prefix, name)
        if isinstance(v, tuple):
            for item in v:
                lines += ["", f"[[{full}]]"]
                _emit_table(item, full, lines)
        else:
            lines += ["", f"[{full}]"]
            _emit_table(v, full, lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _toml_key(k: str) -> str:
    """A table key as TOML reads it back: bare when it can be (letters, digits, '_', '-'), else quoted
    (``"nvidia.com/gpu"``: a bare dotted key would be a nested table)."""
    return k if k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k) else _toml_value(k)
