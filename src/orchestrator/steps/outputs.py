"""What each step leaves behind: ``rollouts.jsonl``, ``metrics.jsonl`` and one INFO log line.

A rollout row is a ``RolloutRow`` (contracts/rows.py: env, task, group, reward, advantage, filters, filtered,
error, lengths, timing...; never big arrays), written as its ``as_dict()``. ``step_metrics`` aggregates a step's
rows with pandas into the metrics row; ``StepOutputs`` appends rows (and, for scripts, metrics) with one write per
file; the orchestrator sends metrics through its sinks (orchestrator.sinks: metrics.jsonl, W&B). Both run in a
worker thread, never on the event loop; orjson serialises (numpy scalars included).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import pandas as pd

from orchestrator.contracts.rows import RolloutRow
from orchestrator.lagmon import LagStats
from orchestrator.sinks.jsonl import JsonlSink, append_bytes

log = logging.getLogger(__name__)

_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


def step_metrics(
    step: int,
    rows: Sequence[RolloutRow],
    *,
    phase_s: Mapping[str, float],
    lag: LagStats,
    rss_mb: float,
    wall_s: float,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The metrics row of one step, aggregated over its rollout rows (``dropped``: rows of dropped groups).
    ``rollouts`` and ``failed`` count every row; rewards, ``filtered``, ``off_policy`` and ``tokens`` only the
    groups the step took."""
    df = pd.DataFrame.from_records([(r.env, r.reward, r.ok, r.filtered, r.tokens, r.off_policy, r.dropped)
                                    for r in rows],
                                   columns=["env", "reward", "ok", "filtered", "tokens", "off_policy", "dropped"])
    dropped = df["dropped"].astype(bool)
    kept = df[~dropped]
    ok = kept[kept["ok"].astype(bool)] if len(kept) else kept
    trained = ok[~ok["filtered"].astype(bool)] if len(ok) else ok
    per_env = ok.groupby("env")["reward"].agg(["mean", "count"]) if len(ok) else pd.DataFrame()
    out: dict[str, Any] = {
        "step": step,
        "phase_s": {k: round(float(v), 6) for k, v in phase_s.items()},
        "lag": {k: round(float(v), 3) for k, v in lag.as_dict().items()},
        "rss_mb": round(rss_mb, 1),
        "rollouts": len(df),
        "trained": len(trained),
        "filtered": int(ok["filtered"].astype(bool).sum()) if len(ok) else 0,
        "failed": int((~df["ok"].astype(bool)).sum()) if len(df) else 0,
        "dropped": int(dropped.sum()),
        "reward_mean": {str(env): round(float(r["mean"]), 6) for env, r in per_env.iterrows()},
        "rollouts_per_env": {str(env): int(r["count"]) for env, r in per_env.iterrows()},
        "off_policy": {str(int(k)): int(v) for k, v in ok["off_policy"].value_counts().sort_index().items()}
        if len(ok) else {},
        "tokens": int(trained["tokens"].sum()) if len(trained) else 0,
        "wall_s": round(wall_s, 4),
        "rollouts_per_s": round(len(df) / wall_s, 2) if wall_s > 0 else 0.0,
    }
    if extra:
        out.update(extra)
    return out


def format_step_line(m: Mapping[str, Any]) -> str:
    """One line per step: phases sorted by cost, lag and RSS, the largest env worker's RSS (each worker's is in
    ``scheduler.workers``), and the shared-memory pool (kind = shm)."""
    phases = " ".join(f"{k}={v * 1e3:.0f}ms" for k, v in sorted(m["phase_s"].items(), key=lambda kv: -kv[1]))
    rewards = " ".join(f"{env}={r:.3f}" for env, r in m["reward_mean"].items())
    lag = m["lag"]
    worker_rss = [w["rss_mb"] for w in m.get("scheduler", {}).get("workers", {}).values() if w.get("rss_mb")]
    workers = f" worker max={max(worker_rss):.0f}MB" if worker_rss else ""
    shm = f" | shm={m['shm_live_mb']:.1f}MB in {m['shm_spans']} spans" if "shm_live_mb" in m else ""
    dropped = f", {m['dropped']} in dropped groups" if m.get("dropped") else ""
    masked = m.get("versions", {}).get("masked")
    stale = f" ({masked} older than max_token_lag, masked)" if masked else ""
    return (f"step {m['step']}: {m['rollouts']} rollouts ({m['failed']} failed, {m['filtered']} filtered{dropped}), "
            f"{m['tokens']} tokens{stale}, {m['rollouts_per_s']:.1f} rollouts/s | reward {rewards} | {phases} | "
            f"lag p99={lag['p99']:.1f}ms max={lag['max']:.1f}ms | rss={m['rss_mb']:.0f}MB{workers}{shm}")


def eval_rollout_rows(row: Mapping[str, Any], groups: Sequence[Any]) -> list[dict[str, Any]]:
    """The ``eval_rollouts.jsonl`` rows of a finished evaluation round (``row``) and its groups."""
    return [{"step": row["step"], "at_step": row.get("at_step", row["step"]), "env": g.env, "task": g.task,
             "group": g.gid, "rollout": r.rid, "reward": r.reward, "ok": r.ok, "failure": r.header.failure,
             "error": r.header.error, "tokens": r.tokens, "policy": g.policy, "wall_s": r.header.wall_s,
             "worker": r.header.worker} for g in groups for r in g.records]


def format_eval_line(row: Mapping[str, Any]) -> str:
    """One line per evaluation round: per env, mean reward and the largest k's pass@k."""
    parts = []
    for env, m in row["envs"].items():
        k = max((int(key[5:]) for key in m if key.startswith("pass@")), default=1)
        parts.append(f"{env}: reward {m['mean_reward']:.3f} pass@{k} {m.get(f'pass@{k}', 0.0):.3f} "
                     f"({m['examples']} tasks, {m['errors']} errors)")
    return f"eval of step {row['step']} (policy {row['policy']}, {row['wall_s']:.1f} s): " + "; ".join(parts)


class StepOutputs:
    """Appends rows to ``rollouts.jsonl`` and ``eval_rollouts.jsonl`` in ``output_dir`` (created if missing);
    ``write`` also appends the step's metrics to ``metrics.jsonl`` (the orchestrator sends metrics through its
    sinks instead, sinks/)."""

    def __init__(self, output_dir: Path) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self.rollouts_path = output_dir / "rollouts.jsonl"
        self.eval_rollouts_path = output_dir / "eval_rollouts.jsonl"
        self.metrics = JsonlSink(output_dir)
        self.metrics_path = self.metrics.path()

    def write_rows(self, rows: Sequence[RolloutRow]) -> None:
        """Blocking: call from a worker thread. One write per step."""
        append_bytes(self.rollouts_path, b"".join(orjson.dumps(r.as_dict(), option=_OPTS) for r in rows))

    def write_lines(self, rollouts: Sequence[bytes]) -> None:
        """Blocking: append ``rollouts.jsonl`` lines as they are (a step's rows written before a resume)."""
        append_bytes(self.rollouts_path, b"".join(rollouts))

    def write_eval_rollouts(self, rollouts: Sequence[Mapping[str, Any]]) -> None:
        """Blocking: an evaluation round's rollouts."""
        append_bytes(self.eval_rollouts_path, b"".join(orjson.dumps(r, option=_OPTS) for r in rollouts))

    def write(self, rows: Sequence[RolloutRow], metrics: Mapping[str, Any]) -> None:
        """Blocking: call from a worker thread. One write per file per step."""
        self.write_rows(rows)
        self.metrics.log(metrics, step=int(metrics["step"]))



def drop_steps_from(path: Path, first: int, chunk: int = 1 << 16) -> bytes:
    """Truncate a step-ordered JSONL file before its first line whose ``step`` is >= ``first`` (a resumed run
    regenerates those steps); a torn last line goes too. Reads backwards from the end, so a long file costs
    only its tail. Returns the removed bytes. Blocking."""
    if not path.exists():
        return b""
    with path.open("r+b") as f:
        size = pos = cut = f.seek(0, 2)  # bytes [0, cut) are kept so far; buf holds [pos, cut)
        buf = b""
        while True:
            while buf:
                nl = buf.rfind(b"\n", 0, len(buf) - 1)
                if nl < 0 and pos > 0:
                    break  # the first line in buf may be partial: read more first
                line = buf[nl + 1:]
                if _step_of(line) < first:
                    return _cut(f, cut, size)
                cut -= len(line)
                buf = buf[:nl + 1]
            if pos == 0:
                return _cut(f, cut, size)
            start = max(pos - chunk, 0)
            f.seek(start)
            buf = f.read(pos - start) + buf
            pos = start


def _cut(f: BinaryIO, cut: int, size: int) -> bytes:
    f.seek(cut)
    tail = f.read(size - cut)
    f.truncate(cut)
    return tail


def lines_by_step(data: bytes) -> dict[int, list[bytes]]:
    """Whole JSONL lines of training steps by their step (evaluation rows and torn lines left out)."""
    out: dict[int, list[bytes]] = {}
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(row, dict) and not row.get("eval") and isinstance(row.get("step"), int):
            out.setdefault(row["step"], []).append(line)
    return out


def _step_of(line: bytes) -> float:
    """The line's step (an evaluation row's ``at_step``); +inf for a blank or torn line (dropped with the
    regenerated steps)."""
    try:
        row = orjson.loads(line)
        return float(row.get("at_step", row["step"]))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return float("inf")
