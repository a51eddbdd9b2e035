"""Read an offline Weights & Biases run back: what a test (or a user without network) can check was logged.

An offline run is a directory ``<dir>/wandb/offline-run-<time>-<id>/`` holding ``run-<id>.wandb``, W&B's
transaction log, and ``files/`` (tables are written there as ``media/table/*.table.json``). The log is a
LevelDB-style record log: a 7-byte file header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of
records, each a 7-byte header (CRC-32C, length, type: full, first, middle, last) and a slice of one serialized
``wandb_internal_pb2.Record`` (protobuf, shipped with the ``wandb`` package). wandb >= 0.19 has no Python reader
for it (its Go core writes it), hence this one.

``read_offline_run(path)`` returns the run's history rows (one dict per ``log`` call: ``_step`` and the logged
keys, a table as its file's ``{"_type": "table-file", "path": ...}``), its config, tags and name;
``OfflineRun.table(value)`` reads a table's rows.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE_HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    directory: Path
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    name: str = ""

    def table(self, value: dict[str, Any]) -> list[dict[str, Any]]:
        """The rows of a logged table (a history value of ``_type`` ``table-file``), as dicts by column."""
        data = json.loads((self.directory / "files" / value["path"]).read_text())
        return [dict(zip(data["columns"], row, strict=True)) for row in data["data"]]


def offline_runs(directory: Path) -> list[Path]:
    """The offline runs W&B wrote under ``directory`` (its ``dir``), oldest first."""
    return sorted((directory / "wandb").glob("offline-run-*"))


def read_offline_run(run_dir: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = run_dir.glob("run-*.wandb")
    run = OfflineRun(run_dir)
    for data in records(log.read_bytes()):
        record = pb.Record.FromString(data)  # type: ignore[attr-defined]  # generated protobuf, no stubs
        kind = record.WhichOneof("record_type")
        if kind == "history":
            run.history.append(_items(record.history.item))
        elif kind == "config":
            run.config.update(_items(record.config.update))
        elif kind == "run":
            run.config.update(_items(record.run.config.update))
            run.tags = list(record.run.tags)
            run.name = record.run.display_name
    return run


def records(data: bytes) -> list[bytes]:
    """The records of a W&B transaction log, reassembled across blocks."""
    ident, magic, version = FILE_HEADER.unpack_from(data, 0)
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"not a W&B transaction log (header {ident!r} {magic:#x} {version})")
    out: list[bytes] = []
    pos, pending = FILE_HEADER.size, b""
    while pos + RECORD_HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD_HEADER.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if kind == 0:  # zeros: the end of what was written
            break
        pos += RECORD_HEADER.size
        chunk, pos = data[pos:pos + length], pos + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
            pending = b""
    return out


def _items(items: Any) -> dict[str, Any]:
    """Logged items as a dict: a value W&B split into leaves (``nested_key``, e.g. a table's fields) nested
    again; a key with slashes (``phase_s/wait``, as the sink flattens them) kept as it is."""
    out: dict[str, Any] = {}
    for item in items:
        value = json.loads(item.value_json)
        if item.key:
            out[item.key] = value
            continue
        node = out
        for part in item.nested_key[:-1]:
            node = node.setdefault(part, {})
        node[item.nested_key[-1]] = value
    return out
