from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.errors import Failure
from orchestrator.lagmon import LagStats
from orchestrator.steps.outputs import StepOutputs, drop_steps_from, format_step_line, step_metrics
from orchestrator.testing.steps import rollout_row

ROWS = [
    rollout_row(env="a", reward=1.0, ok=True, filtered=False, tokens=10, off_policy=0, advantage=0.5),
    rollout_row(env="a", reward=0.0, ok=True, filtered=False, tokens=20, off_policy=1, advantage=-0.5),
    rollout_row(env="b", reward=0.5, ok=True, filtered=True, tokens=5, off_policy=0, advantage=0.0),
    rollout_row(env="b", reward=0.0, ok=False, filtered=False, tokens=0, off_policy=0, error="timeout"),
]
LAG = LagStats(10, 0.1, 0.5, 1.0, 2.0, 3.0)


def test_metrics_aggregate_per_env() -> None:
    m = step_metrics(3, ROWS, phase_s={"advantage": 0.01, "encode": 0.2}, lag=LAG, rss_mb=123.4, wall_s=2.0)
    assert m["step"] == 3
    assert (m["rollouts"], m["failed"], m["filtered"], m["trained"]) == (4, 1, 1, 2)
    assert m["reward_mean"] == {"a": 0.5, "b": 0.5}
    assert m["rollouts_per_env"] == {"a": 2, "b": 1}
    assert m["off_policy"] == {"0": 2, "1": 1}
    assert m["tokens"] == 30
    assert m["rollouts_per_s"] == 2.0
    assert m["lag"]["p99"] == 2.0


def test_rows_of_dropped_groups_count_as_rollouts_and_failures_but_not_in_rewards() -> None:
    dropped = [rollout_row(env="a", reward=0.0, ok=False, filtered=False, tokens=0, off_policy=0,
                           dropped=True, failure=Failure.ENV),
               rollout_row(env="b", reward=1.0, ok=True, filtered=False, tokens=7, off_policy=3,
                           dropped=True)]  # a group-scoring group's survivor: dropped with its group
    m = step_metrics(3, ROWS + dropped, phase_s={}, lag=LAG, rss_mb=1.0, wall_s=2.0)
    assert (m["rollouts"], m["failed"], m["dropped"], m["trained"], m["filtered"]) == (6, 2, 2, 2, 1)
    assert m["failed_by"] == {"env_error": 1}  # per kind (the row of ROWS that failed names none)
    assert m["reward_mean"] == {"a": 0.5, "b": 0.5}  # as without the dropped rows
    assert m["off_policy"] == {"0": 2, "1": 1}
    assert m["tokens"] == 30
    assert "2 in dropped groups" in format_step_line(m)
    assert "dropped groups" not in format_step_line(step_metrics(3, ROWS, phase_s={}, lag=LAG, rss_mb=1.0,
                                                                 wall_s=2.0))


def test_metrics_of_an_empty_step() -> None:
    m = step_metrics(0, [], phase_s={}, lag=LAG, rss_mb=1.0, wall_s=0.0)
    assert (m["rollouts"], m["failed"], m["tokens"], m["reward_mean"]) == (0, 0, 0, {})


def test_step_line_sorts_phases_by_cost() -> None:
    m = step_metrics(1, ROWS, phase_s={"a": 0.001, "b": 0.5, "c": 0.01}, lag=LAG, rss_mb=10.0, wall_s=1.0)
    line = format_step_line(m)
    assert line.index("b=500ms") < line.index("c=10ms") < line.index("a=1ms")
    assert "lag p99=2.0ms max=3.0ms" in line
    assert "1 failed" in line
    assert "worker max" not in line  # no env worker reported yet


def test_step_line_names_the_largest_env_worker_rss() -> None:
    workers = {"local-0": {"rollouts": 8, "rollouts_per_s": 4.0, "rss_mb": 301.2},
               "local-1": {"rollouts": 8, "rollouts_per_s": 4.0, "rss_mb": 1534.6},
               "remote-a": {"rollouts": 0, "rollouts_per_s": 0.0, "rss_mb": None}}  # no heartbeat yet
    m = step_metrics(1, ROWS, phase_s={}, lag=LAG, rss_mb=250.0, wall_s=1.0, extra={"scheduler": {"workers": workers}})
    assert format_step_line(m).endswith("rss=250MB worker max=1535MB")


def test_outputs_append_jsonl(tmp_path: Path) -> None:
    out = StepOutputs(tmp_path / "run")
    rows = [msgspec.structs.replace(r, reward=np.float32(r.reward)) for r in ROWS]  # numpy scalars serialise
    for step in range(2):
        out.write(rows, step_metrics(step, ROWS, phase_s={}, lag=LAG, rss_mb=1.0, wall_s=1.0))
    lines = out.rollouts_path.read_bytes().splitlines()
    assert len(lines) == 8
    assert orjson.loads(lines[3])["error"] == "timeout"
    metrics = [orjson.loads(x) for x in out.metrics_path.read_bytes().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=12), st.integers(0, 13), st.booleans(), st.integers(1, 64))
def test_drop_steps_from_keeps_exactly_the_earlier_steps(per_step: list[int], first: int, torn: bool,
                                                         chunk: int) -> None:
    rows: list[dict[str, Any]] = [{"step": step, "i": i, "pad": "x" * (7 * i)} for step, n in enumerate(per_step)
                                  for i in range(n)]
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_bytes(data + (b'{"step": 3, "tor' if torn else b""))  # a line cut by a crash
        drop_steps_from(path, first, chunk=chunk)
        assert path.read_bytes() == b"".join(orjson.dumps(r) + b"\n" for r in rows if r["step"] < first)
