"""``orchestrator report OUTPUT_DIR``: PNG plots of a run's ``metrics.jsonl``.

Writes ``reward.png`` (mean reward per environment), ``lag.png`` (loop lag p99 and max), ``rss.png``,
``phases.png`` (each step's phase times, stacked) and ``throughput.png`` (rollouts/s and tokens/s), all over
steps, and with online evaluation ``eval.png`` (per eval env: mean reward, pass@1 and pass@k over the steps
evaluated), with ``[scheduler.concurrency]`` on ``concurrency.png`` (each server's cap and KV-cache usage), and
when weights were synced ``weight_sync.png`` (each sync's phases stacked: pause, load or start/transfer/finish,
resume, and a broadcast's trainer answer and group formation), into ``OUTPUT_DIR/plots`` (or ``--out``). Needs
matplotlib, the ``plots`` extra; renders with the Agg backend through matplotlib's object API (no pyplot state), so
it runs in any thread.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from orchestrator.errors import OrchestratorError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

HELP = "plot a run's metrics.jsonl (reward, lag, RSS, phases, throughput) as PNG files"
INSTALL_HINT = "pip install 'rollout-orchestrator[plots]'"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output_dir", help="a run's output directory (holds metrics.jsonl), e.g. outputs/demo")
    p.add_argument("--out", default=None, help="where the PNG files go (default: OUTPUT_DIR/plots)")


def main(args: argparse.Namespace) -> int:
    for path in render_report(Path(args.output_dir), Path(args.out) if args.out else None):
        print(path)
    return 0


def new_figure(**kwargs: Any) -> Figure:
    """A matplotlib Figure (Agg when saved); OrchestratorError with the install command without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise OrchestratorError(f"plots need matplotlib, which is not installed: {INSTALL_HINT}") from None
    return Figure(**kwargs)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``; OrchestratorError naming the file (and line) when unreadable."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise OrchestratorError(f"{path}: cannot read the run's metrics ({e.strerror})") from None
    rows = []
    lines = data.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            if i == len(lines) and not data.endswith(b"\n"):  # a run writing it now, or one that crashed mid-line
                log.warning("%s:%d: skipping the last line, cut short (%d bytes)", path, i, len(line))
                break
            raise OrchestratorError(f"{path}:{i}: not JSON: {e}") from None
        if not isinstance(row, dict) or "step" not in row:
            raise OrchestratorError(f"{path}:{i}: not a metrics row (no 'step')")
        rows.append(row)
    if not rows:
        raise OrchestratorError(f"{path}: no steps yet")
    return rows


def render_report(output_dir: Path, plots_dir: Path | None = None) -> list[Path]:
    """Blocking (file I/O, rendering): write the PNG files; returns their paths."""
    every = read_metrics(output_dir / "metrics.jsonl")
    new_figure()  # fails early, before any directory is made, when matplotlib is missing
    plots_dir = plots_dir or output_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    rows = [r for r in every if not r.get("eval")]
    evals = [r for r in every if r.get("eval")]
    paths = [_save(plots_dir / f"{name}.png", title, [int(r["step"]) for r in rows], rows, draw)
             for name, title, draw in PLOTS]
    if evals:
        paths.append(_save(plots_dir / "eval.png", "online evaluation", [int(r["step"]) for r in evals], evals,
                           _eval))
    if any(r.get("weight_syncs") for r in rows):
        paths.append(_save(plots_dir / "weight_sync.png", "weight syncs finished during each step (phases, stacked)",
                           [int(r["step"]) for r in rows], rows, _weight_syncs))
    if any(r.get("scheduler", {}).get("concurrency") for r in rows):
        paths.append(_save(plots_dir / "concurrency.png", "each server's cap and KV cache ([scheduler.concurrency])",
                           [int(r["step"]) for r in rows], rows, _concurrency))
    return paths


def _save(path: Path, title: str, steps: list[int], rows: Sequence[dict[str, Any]],
          draw: Callable[[Axes, list[int], Sequence[dict[str, Any]]], None]) -> Path:
    fig = new_figure(figsize=(9, 4.5), layout="constrained")
    from matplotlib.ticker import MaxNLocator

    ax = fig.subplots()
    draw(ax, steps, rows)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left")
    fig.savefig(path, dpi=100)
    return path


def _reward(ax: Axes, steps: list[int], rows: Sequence[dict[str, Any]]) -> None:
    envs = sorted({e for r in rows for e in r.get("reward_mean", {})})
    for env in envs:
        pts = [(s, r["reward_mean"][env]) for s, r in zip(steps, rows, strict=True) if env in r.get("reward_mean", {})]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=env)
    ax.set_ylabel("mean reward")


def _lag(ax: Axes, steps: list[int], rows: Sequence[dict[str, Any]]) -> None:
    for key in ("p99", "max"):
        ax.plot(steps, [r.get("lag", {}).get(key, 0.0) for r in rows], marker="o", ms=3, label=f"lag {key}")
    ax.set_ylabel("event-loop lag (ms)")


def _rss(ax: Axes, steps: list[int], rows: Sequence[dict[str, Any]]) -> None:
    ax.plot(steps, [r.get("rss_mb", 0.0) for r in rows], marker="o", ms=3, label="RSS")
    ax.set_ylabel("RSS (MB)")
    ax.set_ylim(bottom=0)


def _phases(ax: Axes, steps: list[int], rows: Sequence[dict[str, Any]]) -> None:
    """The step-boundary phases stacked (ms); waiting for rollouts, much longer, as a line on its own axis."""
    names = [k for k in dict.fromkeys(k for r in rows for k in r.get("phase_s", {})) if k != "wait"]
    bottom = [0.0] * len(rows)
    for name in names:
        values = [float(r.get("phase_s", {}).get(name, 0.0)) * 1e3 for r in rows]
        ax.bar(steps, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("step boundary (ms, stacked)")
    if any("wait" in r.get("phase_s", {}) for r in rows):
        wait = ax.twinx()
        wait.plot(steps, [float(r.get("phase_s", {}).get("wait", 0.0)) for r in rows], color="black", ls=":",
                  marker=".", label="wait for rollouts (s)")
        wait.set_ylabel("wait for rollouts (s)")
        wait.set_ylim(bottom=0)
        wait.legend(fontsize=8, loc="upper right")


SYNC_PHASES = ("form", "ask", "pause", "start", "load", "transfer", "finish", "resume")


def _weight_syncs(ax: Axes, steps: list[int], rows: Sequence[dict[str, Any]]) -> None:
    """Per step, the phases of the syncs that finished during it (summed, s), stacked; broadcast and filesystem
    alike (a phase a mode does not have is 0)."""
    bottom = [0.0] * len(rows)
    for name in SYNC_PHASES:
        values = [sum(float(s.get(f"{name}_s", 0.0)) for s in r.get("weight_syncs", [])) for r in rows]
        if any(values):
            ax.bar(steps, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("weight sync (s, stacked)")


def _throughput(ax: Axes, steps: list[int], rows: Sequence[dict[str, Any]]) -> None:
    ax.plot(steps, [r.get("rollouts_per_s", 0.0) for r in rows], marker="o", ms=3, color="C0", label="rollouts/s")
    ax.set_ylabel("rollouts/s")
    ax.set_ylim(bottom=0)
    tok = ax.twinx()
    tok.plot(steps, [r.get("tokens", 0) / r["wall_s"] if r.get("wall_s") else 0.0 for r in rows], marker="s", ms=3,
             color="C1", label="tokens/s (trained)")
    tok.set_ylabel("tokens/s")
    tok.set_ylim(bottom=0)
    tok.legend(fontsize=8, loc="lower right")


def _eval(ax: Axes, steps: list[int], rows: Sequence[dict[str, Any]]) -> None:
    """Per eval env: mean reward (solid), pass@1 (dashed) and pass@k for the largest k (dotted)."""
    envs = sorted({e for r in rows for e in r.get("envs", {})})
    for i, env in enumerate(envs):
        got = [(s, r["envs"][env]) for s, r in zip(steps, rows, strict=True) if env in r.get("envs", {})]
        xs = [s for s, _ in got]
        k = max((int(key[5:]) for _, m in got for key in m if key.startswith("pass@")), default=1)
        for key, style in {"mean_reward": "-", "pass@1": "--", f"pass@{k}": ":"}.items():  # k = 1: two lines
            ax.plot(xs, [m.get(key, 0.0) for _, m in got], ls=style, marker="o", ms=3, color=f"C{i}",
                    label=f"{env} {key}")
    ax.set_ylabel("reward / pass rate")
    ax.set_ylim(-0.02, 1.02)


def _concurrency(ax: Axes, steps: list[int], rows: Sequence[dict[str, Any]]) -> None:
    """Per server: its cap (solid, left axis) and KV-cache usage (dotted, right axis) at each step's end."""
    servers = sorted({url for r in rows for url in r.get("scheduler", {}).get("concurrency", {})})
    usage = ax.twinx()
    for i, url in enumerate(servers):
        got = [(s, r["scheduler"]["concurrency"][url]) for s, r in zip(steps, rows, strict=True)
               if url in r.get("scheduler", {}).get("concurrency", {})]
        ax.plot([s for s, _ in got], [c["cap"] for _, c in got], marker="o", ms=3, color=f"C{i}", label=url)
        usage.plot([s for s, _ in got], [c["kv_usage"] if c["kv_usage"] is not None else float("nan") for _, c in got],
                   ls=":", color=f"C{i}")
    ax.set_ylabel("cap (rollouts in flight)")
    ax.set_ylim(bottom=0)
    usage.set_ylabel("KV-cache usage (dotted)")
    usage.set_ylim(0, 1.02)


PLOTS: list[tuple[str, str, Callable[[Axes, list[int], Sequence[dict[str, Any]]], None]]] = [
    ("reward", "mean reward per environment", _reward),
    ("lag", "event-loop lag per step", _lag),
    ("rss", "resident memory per step", _rss),
    ("phases", "step phases (wall time, stacked)", _phases),
    ("throughput", "throughput per step", _throughput),
]
