"""verifiers' configuration of one environment, from its ``[[env]]`` table, resolved and validated by verifiers.

An ``[[env]]`` table says, in verifiers' own terms:

- ``taskset`` and ``args``: verifiers' ``[env.taskset]`` table (``taskset`` is its ``id``, ``args`` the rest);
- ``[env.verifiers]``: verifiers' ``[env]`` table without ``taskset``, passed through as written: each seat
  (``agent``, ``player``...: the environment names them) with its harness, runtime, model turn and token
  limits, timeouts and retries; the environment's own timeout, retries, interception...;
- ``[env.select]``: verifiers' ``SelectConfig`` (``limit``, ``skip``, ``include``, ``exclude``...), which
  tasks the env serves; an endless taskset needs a bound (``limit``).

verifiers validates all of it (``resolve_env_config``, ``SelectConfig``); every problem comes back as
``env[i].<the key path the user wrote>: <what verifiers says>``. One documented default is added: a seat that
sets no ``runtime`` runs its harness in a local subprocess (``{ type = "subprocess" }``; verifiers' own
default is a remote sandbox). verifiers is imported only when a function here is called: by
``orchestrator check`` and in env workers, never when a config is loaded.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import ConfigError

LOCAL_RUNTIME = {"type": "subprocess"}  # a seat's runtime unless it sets one (verifiers' default is a sandbox)
TAGS = ("type", "id")  # pydantic's error paths name a tagged union's member by its tag: not a key the user wrote


@dataclass(frozen=True)
class ResolvedEnv:
    """An environment's verifiers configuration, validated by verifiers."""

    config: Any  # verifiers' EnvConfig, narrowed to the environment's own class
    select: Any  # verifiers' SelectConfig
    seats: tuple[str, ...]  # the environment's agent seats, e.g. ("agent",) or ("player",)

    def describe(self) -> str:
        """One line for people: each seat's harness and runtime, and which tasks."""
        parts = []
        harnesses = self.config.agent_harnesses()  # unset: the taskset's own harness, else verifiers' bash
        for seat in self.seats:
            agent = getattr(self.config, seat)
            harness = harnesses[seat].id
            limit = f", max_turns {agent.max_turns}" if agent.max_turns is not None else ""
            parts.append(f"seat {seat} (harness {harness}, runtime {agent.runtime.type}{limit})")
        tasks = f"at most {self.select.limit} tasks" if self.select.limit is not None else "all tasks"
        return f"{', '.join(parts)}; {tasks}"


def resolve_env(taskset: str, args: Mapping[str, Any], verifiers: Mapping[str, Any], select: Mapping[str, Any],
                key: str = "env") -> ResolvedEnv:
    """Resolve one environment's configuration with verifiers; ConfigError listing every problem, each
    named by its key path under ``key`` (``env[0].verifiers.player.max_turns: ...``)."""
    from pydantic import ValidationError
    from verifiers.v1 import SelectConfig, resolve_env_config
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type, taskset_class

    problems = [f"{key}.{where}: {why}" for where, why in _misplaced(args, verifiers)]
    if problems:
        raise ConfigError(problems)
    plugins = _plugin_problems(taskset, verifiers, key)
    if plugins:
        raise ConfigError(plugins)
    cls = env_config_type(taskset, str(verifiers.get("id") or ""))
    seats = tuple(name for name, f in cls.model_fields.items() if isinstance(f.default, AgentConfig))
    data = with_local_runtime(verifiers, seats)
    data["taskset"] = {"id": taskset, **args}
    config = chosen = None
    try:
        config = resolve_env_config(data)
    except ValidationError as e:
        problems += [_problem(err, data, key, cls, seats) for err in e.errors()]
    except Exception as e:  # a validator of a plugin raised something else: name the table
        problems.append(f"{key}.verifiers: {type(e).__name__}: {e}")
    try:
        chosen = SelectConfig.model_validate(dict(select))
    except ValidationError as e:
        problems += [f"{key}.select{_join(err['loc'], dict(select))}: {err['msg']}" for err in e.errors()]
    if problems or config is None or chosen is None:
        raise ConfigError(problems)
    try:
        bounded = taskset_class(taskset)(config.taskset).select(chosen).bounded
    except ValueError as e:  # e.g. shuffling an endless taskset
        raise ConfigError([f"{key}.select: {e}"]) from None
    if not bounded:
        raise ConfigError([f"{key}.select.limit: taskset {taskset!r} is endless; set how many of its tasks to "
                           f"use, e.g. select = {{ limit = 1000 }}"])
    return ResolvedEnv(config, chosen, seats)


def with_local_runtime(verifiers: Mapping[str, Any], seats: Sequence[str]) -> dict[str, Any]:
    """``verifiers`` (a copy) where each seat's runtime type is ``subprocess`` unless the seat sets one."""
    data = copy.deepcopy(dict(verifiers))
    for seat in seats:
        table = data.setdefault(seat, {})
        if isinstance(table, dict):
            runtime = table.setdefault("runtime", {})
            if isinstance(runtime, dict):
                for k, v in LOCAL_RUNTIME.items():
                    runtime.setdefault(k, v)
    return data


def _misplaced(args: Mapping[str, Any], verifiers: Mapping[str, Any]) -> list[tuple[str, str]]:
    out = []
    if "taskset" in verifiers:
        out.append(("verifiers.taskset", "the taskset is set by `taskset` (its id) and `args` (its other keys) "
                                         "of the [[env]] table; move it there"))
    if "id" in args:
        out.append(("args.id", "the taskset's id is the [[env]] table's `taskset`; remove it from args"))
    return out


def _plugin_problems(taskset: str, verifiers: Mapping[str, Any], key: str) -> list[str]:
    """The taskset, env and harness ids that cannot be imported, each at its key (verifiers raises these
    from inside its validators, without a path)."""
    from verifiers.v1.utils.loaders import environment_class, harness_class, taskset_class

    checks: list[tuple[str, Any]] = [(f"{key}.taskset", lambda: taskset_class(taskset))]
    if verifiers.get("id"):
        checks.append((f"{key}.verifiers.id", lambda: environment_class(taskset, str(verifiers["id"]))))
    for seat, table in verifiers.items():
        harness = table.get("harness") if isinstance(table, dict) else None
        if isinstance(harness, dict) and isinstance(harness.get("id"), str):
            checks.append((f"{key}.verifiers.{seat}.harness.id",
                           lambda hid=harness["id"]: harness_class(hid)))
    problems = []
    for where, load in checks:
        try:
            load()
        except (ImportError, TypeError, ValueError, AttributeError) as e:
            problems.append(f"{where}: {e}")
    return problems


def _problem(err: Mapping[str, Any], data: Mapping[str, Any], key: str, cls: Any, seats: Sequence[str]) -> str:
    """One pydantic error as ``key.path: message``, the path as the user wrote it."""
    loc = tuple(err["loc"])
    if loc[:1] == ("taskset",):
        where = f"{key}.taskset" if loc[1:] == ("id",) else f"{key}.args{_join(loc[1:], data['taskset'])}"
        return f"{where}: {err['msg']}"
    message = err["msg"]
    if err.get("type") == "extra_forbidden" and len(loc) == 1:
        valid = [n for n in cls.model_fields if n not in ("taskset",)]
        message += (f" (this environment's seats: {', '.join(seats) or 'none'}; "
                    f"valid keys: {', '.join(valid)})")
    return f"{key}.verifiers{_join(loc, data)}: {message}"


def _join(loc: Sequence[Any], data: Any) -> str:
    """``loc`` as ``.a.b[0].c``, leaving out the union tags pydantic puts in (``runtime.subprocess.foo``
    is ``runtime.foo`` in the user's table)."""
    out = ""
    node = data
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            continue
        tag = any(node.get(t) == part for t in TAGS) or i < len(loc) - 1  # a key the table lacks, mid-path
        if isinstance(node, dict) and part not in node and tag:
            continue
        out += f".{part}"
        node = node.get(part) if isinstance(node, dict) else None
    return out
