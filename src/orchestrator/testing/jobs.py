"""Jobs for tests, written from keyword sections: one TOML writer instead of an f-string per test.

    cfg = job_config(tmp_path, run={"max_steps": 3}, inference={"servers": [url]},
                     scheduler={"batch_size": 8}, env=[ARITHMETIC])

Each keyword is a section: a mapping is a ``[table]``, a list of mappings an ``[[array of tables]]`` (``env``,
``eval``); a mapping inside a section is written as an inline table (``sampling = { max_tokens = 4 }``), which
TOML reads as the same subtable (``[monitor.wandb]``). ``run.output_dir`` defaults to ``DIRECTORY/out``. The
file goes through the real loader (``load_config``), so a test sees exactly what a user's TOML would give.

A test whose point is the TOML text itself (a bad config, a comment, a key spelled wrong) writes its text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.config import JobConfig, load_config

__all__ = ["ARITHMETIC", "Section", "job_config", "toml_text", "write_job_toml"]

Section = Mapping[str, Any]

# the environment most tests run: small, deterministic, no network
ARITHMETIC: Section = {"taskset": "orchestrator-arithmetic", "group_size": 4, "workers": 1,
                       "sampling": {"max_tokens": 4}}

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_text(**sections: Section | Sequence[Section]) -> str:
    """The TOML of ``sections`` (see the module docstring), in the order given."""
    out: list[str] = []
    for name, section in sections.items():
        if not section:
            continue  # no keys: the section's defaults, as if it were not there
        tables = [section] if isinstance(section, Mapping) else list(section)
        header = f"[{_key(name)}]" if isinstance(section, Mapping) else f"[[{_key(name)}]]"
        for table in tables:
            out.append(header)
            out.extend(f"{_key(k)} = {_value(v)}" for k, v in table.items())
            out.append("")
    return "\n".join(out)


def write_job_toml(directory: Path, *, run: Section | None = None, **sections: Section | Sequence[Section]) -> Path:
    """Write ``directory/job.toml`` from ``run`` and ``sections`` (``run.output_dir`` defaults to
    ``directory/out``); returns its path."""
    return _write(directory, run, sections)


def job_config(directory: Path, *, overrides: Sequence[str] = (), run: Section | None = None,
               **sections: Section | Sequence[Section]) -> JobConfig:
    """``write_job_toml``, then the job loaded as ``orchestrator run`` loads it (``overrides``: ``key=value``)."""
    return load_config(_write(directory, run, sections), overrides)


def _write(directory: Path, run: Section | None, sections: Mapping[str, Section | Sequence[Section]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "job.toml"
    path.write_text(toml_text(run={"output_dir": directory / "out", **(run or {})}, **sections))
    return path


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return ("-inf" if v < 0 else "inf") if math.isinf(v) else "nan"
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v), ensure_ascii=False)  # a JSON string is a TOML basic string (not ASCII-escaped:
        # JSON would write a character past U+FFFF as a surrogate pair, which TOML refuses)
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, Sequence):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r} ({type(v).__name__})")
