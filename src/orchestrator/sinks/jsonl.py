"""The default sink: ``metrics.jsonl``, one JSON line per call: the step's metrics, and other prefixes' rows
(evaluation rounds) in the same file marked ``{prefix: true}`` (``"eval": true``), so one step-ordered file
holds the run. Samples tables are not written: every rollout's row is in ``rollouts.jsonl`` already."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from orchestrator.errors import OrchestratorError

OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


class OutputError(OrchestratorError):
    """The run's output files cannot be written."""


def append_bytes(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path``; OutputError naming the file and the cause (a full or read-only disk)."""
    try:
        with path.open("ab") as f:
            f.write(data)
    except OSError as e:
        raise OutputError(f"{path}: cannot write the run's outputs ({e.strerror}); free space or fix the "
                          "directory's permissions, then continue with --resume") from None


class JsonlSink:
    def __init__(self, output_dir: Path) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self.output_dir = output_dir

    def path(self) -> Path:
        return self.output_dir / "metrics.jsonl"

    def log(self, metrics: Mapping[str, Any], *, step: int, prefix: str = "") -> None:
        """Append one line, with ``step`` first (a step-ordered file: ``--resume`` truncates it by step; an
        evaluation row carries ``at_step``, the step being made when it was written)."""
        marker = {prefix: True} if prefix else {}
        append_bytes(self.path(), orjson.dumps({"step": step, **marker, **metrics}, option=OPTS))

    def log_samples(self, samples: Sequence[Mapping[str, Any]], *, step: int, prefix: str = "") -> None:
        pass

    def close(self) -> None:
        pass
