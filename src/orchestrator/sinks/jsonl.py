"""The default sink: one JSON line per call, ``metrics.jsonl`` for the step's metrics (prefix ``""``) and
``metrics-<prefix>.jsonl`` for others (``metrics-eval.jsonl``). Samples tables are not written: every rollout's
row is in ``rollouts.jsonl`` already."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
PREFIX = re.compile(r"[A-Za-z0-9_.-]+")


class JsonlSink:
    def __init__(self, output_dir: Path) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self.output_dir = output_dir

    def path(self, prefix: str = "") -> Path:
        if prefix and not PREFIX.fullmatch(prefix):
            raise ValueError(f"metrics prefix {prefix!r}: use letters, digits, '.', '_' and '-'")
        return self.output_dir / (f"metrics-{prefix}.jsonl" if prefix else "metrics.jsonl")

    def log(self, metrics: Mapping[str, Any], *, step: int, prefix: str = "") -> None:
        """Append one line, with ``step`` first (a step-ordered file: ``--resume`` truncates it by step)."""
        with self.path(prefix).open("ab") as f:
            f.write(orjson.dumps({"step": step, **metrics}, option=OPTS))

    def log_samples(self, samples: Sequence[Mapping[str, Any]], *, step: int, prefix: str = "") -> None:
        pass

    def close(self) -> None:
        pass
