"""Step dumps: exact round trips, atomic replacement, corrupt files, and the ``pipeline.dump_steps`` key."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from orchestrator.cli import main
from orchestrator.config import load_config, to_toml
from orchestrator.contracts.protocol import AssignedRollout, RolloutHeader, RolloutRecord
from orchestrator.contracts.wire import encode
from orchestrator.errors import ConfigError, Failure, WireError
from orchestrator.steps.boundary import StepBuilder
from orchestrator.steps.dump import ReplayGroup, dump_due, dump_path, load_dump, write_dump
from orchestrator.testing.steps import synthetic_config, synthetic_groups

VOCAB = 1000


def step_groups() -> list[ReplayGroup]:
    groups = synthetic_groups(12, 3, 64, 2, 2, group_size=4, seed=1)
    base = AssignedRollout("g0-x", "g0", groups[0].env, 0, 0, "w", "http://127.0.0.1:9/v1")
    failed = RolloutRecord(RolloutHeader.failed(base, Failure.GROUP_TIMEOUT, "running for more than 1 s"), [])
    groups[0].records.append(failed)
    groups[0].size += 1
    return groups


def as_bytes(frames: Sequence[memoryview]) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) for f in frames]


def test_dump_then_load_round_trips_exact_bytes(tmp_path: Path) -> None:
    cfg = synthetic_config(12, 4)
    groups = step_groups()
    result = StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, VOCAB).build(5, groups)
    sent = as_bytes(encode(result.batch))
    info = write_dump(dump_path(tmp_path, 5), 5, groups, result.batch, result.rows, run="r", vocab_size=VOCAB,
                      config_toml=to_toml(cfg))

    assert info.path == tmp_path / "dumps" / "step_000005"
    assert info.nbytes == sum(p.stat().st_size for p in info.path.iterdir())
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == ["step_000005"]  # no temp left behind
    dump = load_dump(info.path)
    assert (dump.run, dump.step, dump.vocab_size) == ("r", 5, VOCAB)
    assert as_bytes(dump.batch_frames) == sent  # the batch, byte for byte as sent
    assert as_bytes(encode(dump.batch)) == sent  # decoded and re-encoded: the same bytes
    assert len(dump.groups) == len(groups)
    for mine, theirs in zip(groups, dump.groups, strict=True):
        assert (theirs.gid, theirs.env, theirs.task, theirs.policy, theirs.size) == (
            mine.gid, mine.env, mine.task, mine.policy, mine.size)
        assert [r.header for r in theirs.records] == [r.header for r in mine.records]
        assert [as_bytes(r.frames) for r in theirs.records] == [as_bytes(r.frames) for r in mine.records]
    assert dump.rows == [r.as_dict() for r in result.rows]
    assert sum(not r["ok"] for r in dump.rows) == 1

    # replay: the loaded records, built with the dumped config, give the very same batch and rows
    (tmp_path / "job.toml").write_text(dump.config_toml or "")
    dumped = load_config(tmp_path / "job.toml")
    rebuilt = StepBuilder(dumped.pipeline, dumped.env, dumped.run.name, VOCAB).build(dump.step, dump.groups)
    assert as_bytes(encode(rebuilt.batch)) == sent
    assert [r.as_dict() for r in rebuilt.rows] == dump.rows


def test_a_new_dump_of_a_step_replaces_the_old_one(tmp_path: Path) -> None:
    cfg = synthetic_config(8, 4)
    target = dump_path(tmp_path, 2)
    for seed in (1, 2):
        groups = synthetic_groups(8, 2, 32, 0, 0, group_size=4, seed=seed)
        result = StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, VOCAB).build(2, groups)
        write_dump(target, 2, groups, result.batch, result.rows, run="r")
    assert [p.name for p in (tmp_path / "dumps").iterdir()] == ["step_000002"]
    dump = load_dump(target)
    assert as_bytes(dump.batch_frames) == as_bytes(encode(result.batch))
    assert "routed_experts" not in dump.batch.columns  # no routed experts: none in the batch either
    assert dump.config_toml is None


def test_corrupt_or_missing_dump_is_a_wire_error(tmp_path: Path) -> None:
    groups = synthetic_groups(4, 1, 16, 1, 1, group_size=4)
    cfg = synthetic_config(4, 4)
    result = StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, VOCAB).build(0, groups)
    path = write_dump(tmp_path / "d", 0, groups, result.batch, result.rows, run="r").path
    data = (path / "batch.frames").read_bytes()
    (path / "batch.frames").write_bytes(data[:-3])
    with pytest.raises(WireError, match="truncated"):
        load_dump(path)
    (path / "batch.frames").write_bytes(b"garbage!" + data[8:])
    with pytest.raises(WireError, match="bad magic"):
        load_dump(path)
    with pytest.raises(WireError, match="not a step dump"):
        load_dump(tmp_path / "missing")


def test_loaded_columns_are_aligned_views(tmp_path: Path) -> None:
    groups = synthetic_groups(4, 2, 33, 3, 2, group_size=4)
    cfg = synthetic_config(4, 4)
    result = StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, VOCAB).build(0, groups)
    dump = load_dump(write_dump(tmp_path / "d", 0, groups, result.batch, result.rows, run="r").path)
    logprobs = dump.groups[0].records[1].column("logprobs")
    assert logprobs.ctypes.data % 64 == 0
    np.testing.assert_array_equal(logprobs, groups[0].records[1].column("logprobs"))


@pytest.mark.parametrize(("spec", "due"), [(0, []), (3, [0, 3, 6]), (1, list(range(8))), ((), []), ((2, 5), [2, 5])])
def test_dump_due(spec: int | tuple[int, ...], due: list[int]) -> None:
    assert [s for s in range(8) if dump_due(spec, s)] == due


JOB = """
[inference]
servers = ["http://127.0.0.1:8000/v1"]
[scheduler]
batch_size = 8
[pipeline]
dump_steps = {value}
gates = []
[[env]]
taskset = "orchestrator.envs.arithmetic"
group_size = 4
"""


@pytest.mark.parametrize(("value", "expect"), [("10", 10), ("[0, 5, 7]", (0, 5, 7)), ("[]", ()), ("0", 0)])
def test_dump_steps_accepts_every_n_or_a_list(tmp_path: Path, value: str, expect: object) -> None:
    (tmp_path / "job.toml").write_text(JOB.format(value=value))
    cfg = load_config(tmp_path / "job.toml")
    assert cfg.pipeline.dump_steps == expect
    (tmp_path / "again.toml").write_text(to_toml(cfg))  # what `check` prints loads back the same
    assert load_config(tmp_path / "again.toml").pipeline.dump_steps == expect


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "pipeline.dump_steps: expected a value >= 0, got -1"),
    ('"every"', "pipeline.dump_steps: expected an integer or an array of an integer, got a string 'every'"),
    ("[1, -2]", "pipeline.dump_steps[1]: expected a step number >= 0, got -2"),
    ("[1, 2.5]", "pipeline.dump_steps[1]: expected an integer, got a float 2.5"),
    ("true", "pipeline.dump_steps: expected an integer or an array of an integer, got a boolean True"),
])
def test_bad_dump_steps_name_the_key(tmp_path: Path, value: str, message: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(value=value))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.problems == [f"{path}: {message}"]
    assert main(["check", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_a_dump_of_format_2_loads_and_its_step_builds_without_versions(tmp_path: Path) -> None:
    """Before optional columns, records had four frames (token ids, loss mask, logprobs, routed experts) and no
    ``optional``: such a dump still loads, and its step builds a batch without a versions column."""
    import msgspec
    import orjson

    cfg = synthetic_config(12, 4)
    groups = step_groups()
    for g in groups:  # as an older worker sent them: no versions frame, no optional columns named
        for r in g.records:
            if r.frames:
                r.frames = [r.frames[0], r.frames[1], r.frames[2], r.frames[4]]
                r.header = msgspec.structs.replace(r.header, optional=[], frames=4)
    result = StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, VOCAB).build(5, groups)
    assert "versions" not in result.batch.columns
    info = write_dump(dump_path(tmp_path, 5), 5, groups, result.batch, result.rows, run="r", vocab_size=VOCAB)
    meta = orjson.loads((info.path / "meta.json").read_bytes())
    (info.path / "meta.json").write_bytes(orjson.dumps({**meta, "format": 2}))
    dump = load_dump(info.path)
    rebuilt = StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, VOCAB).build(5, dump.groups)
    assert sorted(rebuilt.batch.columns) == ["logprobs", "loss_mask", "routed_experts", "token_ids"]
    np.testing.assert_array_equal(rebuilt.batch.columns["token_ids"], result.batch.columns["token_ids"])

    fresh = StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, VOCAB).build(5, step_groups())
    versions = fresh.batch.columns["versions"]  # this version's records carry it, and so does their batch
    assert versions.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(versions >= 0, fresh.batch.columns["loss_mask"] != 0)
