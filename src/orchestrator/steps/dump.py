"""Step dumps: one step's input rollout records, its batch and its rollout rows on disk, for offline replay.

``pipeline.dump_steps`` picks the steps; the orchestrator calls ``write_dump`` in a worker thread after the
step is sent, and ``scripts/perf/replay_step.py`` calls ``load_dump`` to run the step again, phase by
phase. A dump is ``<output_dir>/dumps/step_000012/``, written as a hidden temp directory and then renamed,
so a dump directory is complete or absent, never half written:

``meta.json``        format version, run, step, counts, byte sizes, the builder's vocab size
``records.frames``   frame 0: msgpack ``{groups: [{gid, env, task, policy, size, records: [{header,
                     frames}]}]}``; then every record's column frames in order, as the env worker sent them
``batch.frames``     the batch's wire-format frames (contracts/wire.py), byte for byte as sent
``rollouts.jsonl``   the step's rollout rows, as appended to the run's ``rollouts.jsonl``
``config.toml``      the resolved job config (when given), so replay uses the same advantage and filters

A ``.frames`` file is the filesystem transport's frame file (delivery/filesystem.py) with its own magic:
8 magic bytes, a little-endian uint64 frame count, one uint64 length per frame, then the frames, each
starting at a 64-byte boundary; it is mapped on load, so columns are aligned numpy views of the file. Files are not
fsynced: a dump is a debugging aid, not state; a crash can lose it but never leaves a partial one.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgpack
import orjson

from orchestrator.contracts.protocol import RolloutRecord, header_from_dict, header_to_dict
from orchestrator.contracts.rows import RolloutRow
from orchestrator.contracts.wire import Batch, decode, encode
from orchestrator.delivery.filesystem import read_frame_file, write_frame_file
from orchestrator.errors import WireError

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 2: rollout headers carry a failure kind; 3: and their optional columns (2 is read as none)
READ_FORMATS = (2, 3)
MAGIC = b"ORCFRM01"
ALIGN = 64
_ROW_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


class GroupLike(Protocol):
    """What a dump keeps of a finished group (``scheduler.Group`` and ``ReplayGroup`` both fit)."""

    @property
    def gid(self) -> str: ...
    @property
    def env(self) -> str: ...
    @property
    def task(self) -> int: ...
    @property
    def policy(self) -> int: ...
    @property
    def records(self) -> list[RolloutRecord]: ...


@dataclass
class ReplayGroup:
    """A finished group without its server lease: the form ``StepBuilder.build`` reads, rebuilt from a dump."""

    gid: str
    env: str
    task: int
    policy: int
    size: int
    records: list[RolloutRecord] = field(default_factory=list)

    @property
    def survivors(self) -> list[RolloutRecord]:
        return [r for r in self.records if r.ok]


@dataclass
class StepDump:
    """A loaded dump. Frames are memoryviews of one in-memory buffer per file (loaded once, never copied)."""

    path: Path
    run: str
    step: int
    groups: list[ReplayGroup]
    batch_frames: list[memoryview]
    rows: list[dict[str, Any]]  # the JSON objects of its rollouts.jsonl, as read (written from RolloutRow.as_dict)
    meta: dict[str, Any]
    config_toml: str | None

    @property
    def batch(self) -> Batch:
        """The dumped batch, decoded (numpy views of ``batch_frames``)."""
        return decode(self.batch_frames)

    @property
    def vocab_size(self) -> int | None:
        v = self.meta.get("vocab_size")
        return int(v) if v is not None else None


@dataclass(frozen=True)
class DumpInfo:
    path: Path
    nbytes: int
    seconds: float


def dump_due(spec: int | Sequence[int], step: int) -> bool:
    """Whether ``pipeline.dump_steps`` asks for ``step``: N means steps 0, N, 2N...; a list names steps."""
    if isinstance(spec, int):
        return spec > 0 and step % spec == 0
    return step in spec


def dump_path(output_dir: Path, step: int) -> Path:
    """Where the run in ``output_dir`` dumps ``step``: ``output_dir/dumps/step_000012``."""
    return output_dir / "dumps" / f"step_{step:06d}"


def write_dump(final: Path, step: int, groups: Sequence[GroupLike], batch: Batch, rows: Sequence[RolloutRow],
               *, run: str, vocab_size: int | None = None, config_toml: str | None = None) -> DumpInfo:
    """Blocking (call from a worker thread): write the dump directory ``final`` atomically (an existing one
    is replaced); log and return its size."""
    start = time.perf_counter()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    index = {"v": FORMAT_VERSION, "groups": [
        {"gid": g.gid, "env": g.env, "task": g.task, "policy": g.policy, "size": getattr(g, "size", len(g.records)),
         "records": [{"header": header_to_dict(r.header), "frames": len(r.frames)} for r in g.records]}
        for g in groups]}
    record_frames = [msgpack.packb(index, use_bin_type=True), *(f for g in groups for r in g.records for f in r.frames)]
    sizes = {"records": write_frames(tmp / "records.frames", record_frames),
             "batch": write_frames(tmp / "batch.frames", encode(batch))}
    (tmp / "rollouts.jsonl").write_bytes(b"".join(orjson.dumps(r.as_dict(), option=_ROW_OPTS) for r in rows))
    if config_toml is not None:
        (tmp / "config.toml").write_text(config_toml)
    sizes["rows"] = (tmp / "rollouts.jsonl").stat().st_size
    meta = {"format": FORMAT_VERSION, "run": run, "step": step, "groups": len(groups),
            "records": sum(len(g.records) for g in groups), "samples": batch.num_samples,
            "tokens": batch.num_tokens, "bytes": sizes, "vocab_size": vocab_size, "created": time.time()}
    (tmp / "meta.json").write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
    _replace_dir(tmp, final)
    nbytes = sum(p.stat().st_size for p in final.iterdir())
    seconds = time.perf_counter() - start
    log.info("step %d: dump %s, %.1f MB (records %.1f MB, batch %.1f MB) in %.2f s", step, final,
             nbytes / 2**20, sizes["records"] / 2**20, sizes["batch"] / 2**20, seconds)
    return DumpInfo(final, nbytes, seconds)


def load_dump(path: str | Path) -> StepDump:
    """Read a dump directory; WireError when a file is not a dump or its parts do not add up."""
    path = Path(path)
    try:
        meta = orjson.loads((path / "meta.json").read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise WireError(f"{path}: not a step dump (meta.json: {e})") from None
    if meta.get("format") not in READ_FORMATS:
        raise WireError(f"{path}: dump format {meta.get('format')!r}, this version reads "
                        f"{' and '.join(map(str, READ_FORMATS))}")
    frames = read_frames(path / "records.frames")
    try:
        index = msgpack.unpackb(frames[0], raw=False)
        groups = [ReplayGroup(str(g["gid"]), str(g["env"]), int(g["task"]), int(g["policy"]), int(g["size"]))
                  for g in index["groups"]]
        counts = [[int(r["frames"]) for r in g["records"]] for g in index["groups"]]
        headers = [[header_from_dict(r["header"]) for r in g["records"]] for g in index["groups"]]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
        raise WireError(f"{path / 'records.frames'}: bad record index: {e!r}") from None
    if sum(map(sum, counts)) != len(frames) - 1:
        raise WireError(f"{path / 'records.frames'}: index lists {sum(map(sum, counts))} frames, "
                        f"file has {len(frames) - 1}")
    i = 1
    for g, hs, ns in zip(groups, headers, counts, strict=True):
        for h, n in zip(hs, ns, strict=True):
            rec = RolloutRecord(h, frames[i:i + n])
            rec.check()
            g.records.append(rec)
            i += n
    rows = [orjson.loads(line) for line in (path / "rollouts.jsonl").read_bytes().splitlines() if line]
    config = path / "config.toml"
    return StepDump(path, str(meta["run"]), int(meta["step"]), groups, read_frames(path / "batch.frames"), rows,
                    meta, config.read_text() if config.exists() else None)


def write_frames(path: Path, frames: Iterable[Any]) -> int:
    """Write buffers (bytes, memoryviews, contiguous arrays) as a ``.frames`` file; returns its size in bytes."""
    return write_frame_file(path, frames, magic=MAGIC, durable=False)


def read_frames(path: Path) -> list[memoryview]:
    """The frames of a ``.frames`` file: views of the mapped file."""
    return read_frame_file(path, magic=MAGIC, error=WireError)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an older dump of the same step (a resumed run) is replaced."""
    old = final.with_name(f".{final.name}.old{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)
