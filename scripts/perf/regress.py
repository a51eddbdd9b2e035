"""Regression check before submitting: the headline figures of this tree and of the last commit recorded in
scripts/perf/README.md's headline table, measured back to back on this machine, and which moved the wrong way.

    .venv/bin/python scripts/perf/regress.py                 # 2 interleaved repeats of each figure
    .venv/bin/python scripts/perf/regress.py --against cd23bfc --repeats 3 --json

A figure from another machine cannot tell a regression from a slower CPU (the same commit reads ~3x apart on two
machines of the same kind), so both commits are measured here, now: the recorded commit is checked out into a
temporary git worktree (removed at the end), and each short benchmark runs once per commit per repeat, the two
commits back to back and in alternating order, with the same Python and venv, each commit's ``src`` on
PYTHONPATH. The benchmark scripts are this tree's, so both commits are measured the same way; where a script of
this tree cannot import an older commit's modules (a module moved since), that commit's own copy runs (said in
the output), or the figure is not measured there. Medians over the repeats.

| figure | benchmark run | better |
|---|---|---|
| ``orch_cpu_ms_per_rollout`` | ``bench_scheduler.py --rollouts 480 --passes cpu`` | lower |
| ``max_worker_rss_ready_mb`` | ``soak_workers.py --ready-only`` | lower |
| ``sim_requests_per_s`` | ``bench_sim_inference.py --seconds 2`` | higher |

A figure whose median moved more than ``--threshold`` (20%) the wrong way is flagged ("worse"; with "the runs of
both overlap" when some run of each commit lies within the other's range: not conclusive, repeat it). Beside the
simulator's requests/s goes its ratio to bare aiohttp in the same run, which a loaded machine moves less.
Exit status 1 if any figure is flagged, 0 if none, 2 if the check could not start (no recorded commit, git
failed). It also prints this tree's figures as a row for the README table. On a shared or loaded machine these
are smoke figures: read them with the load average printed beside them, and repeat a flagged one before
believing it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _machine import machine_info, machine_label

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
README = HERE / "README.md"
TABLE_HEADING = "## Headline figures"
RUN_TIMEOUT_S = 900.0
IMPORT_FAILURE = re.compile(r"ModuleNotFoundError|ImportError|cannot import name")


@dataclass(frozen=True)
class Bench:
    figure: str  # the JSON key of the figure, and the README table's column
    script: str
    args: tuple[str, ...]
    lower_is_better: bool
    own_args: tuple[str, ...] | None  # the arguments for a commit's own copy of the script; None: not measured there
    context: str | None = None  # a figure of the same run shown beside it, not judged (a ratio to its own baseline)


BENCHES = (
    Bench("orch_cpu_ms_per_rollout", "bench_scheduler.py", ("--rollouts", "480", "--passes", "cpu"), True,
          ("--rollouts", "480")),
    Bench("max_worker_rss_ready_mb", "soak_workers.py", ("--ready-only",), True, None),
    Bench("sim_requests_per_s", "bench_sim_inference.py", ("--seconds", "2"), False, ("--seconds", "2"), "ratio"),
)


@dataclass
class Tree:
    root: Path
    commit: str
    values: dict[str, list[float]] = field(default_factory=dict)
    context: dict[str, list[float]] = field(default_factory=dict)  # Bench.context values, by figure
    own: set[str] = field(default_factory=set)  # figures measured with this commit's own script
    missing: dict[str, str] = field(default_factory=dict)  # figure -> why it cannot be measured


def recorded_commit(readme: Path) -> str:
    """The commit of the last row of the README's headline table. ValueError naming what is missing."""
    lines = readme.read_text().splitlines()
    try:
        start = lines.index(TABLE_HEADING)
    except ValueError:
        raise ValueError(f"{readme}: no '{TABLE_HEADING}' section") from None
    commits = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) > 1 and (m := re.fullmatch(r"`?([0-9a-f]{7,40})(?:-dirty)?`?", cells[1])):
            commits.append(m.group(1))
    if not commits:
        raise ValueError(f"{readme}: the '{TABLE_HEADING}' table has no row with a commit")
    return commits[-1]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


@contextlib.contextmanager
def checkout(commit: str, parent: Path) -> Iterator[Path]:
    """``commit`` in a temporary, detached git worktree under ``parent``; removed on exit however the body ends."""
    path = parent / f"regress-{commit}"
    git("worktree", "add", "--detach", str(path), commit)
    try:
        yield path
    finally:
        for cleanup in (("worktree", "remove", "--force", str(path)), ("worktree", "prune")):
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                git(*cleanup)


def run_script(script: Path, args: tuple[str, ...], src: Path, home: Path) -> tuple[dict[str, Any] | None, str]:
    """Run one benchmark in its own process group (ended by its id on a timeout or ^C, with what it started);
    its last JSON line (None if there is none) and its stderr."""
    env = {**os.environ, "PYTHONPATH": str(src), "HOME": str(home)}
    proc = subprocess.Popen([sys.executable, str(script), *args, "--json"], cwd=script.parents[2], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise
    lines = [line for line in out.splitlines() if line.strip()]
    with contextlib.suppress(IndexError, ValueError):
        result = json.loads(lines[-1])
        if isinstance(result, dict):
            return result, err
    return None, err


def measure(bench: Bench, tree: Tree, home: Path) -> float | None:
    """One run of ``bench`` on ``tree``: with this tree's script, or the commit's own copy once this tree's could
    not import that commit's modules. None when it gives no figure (said on stderr); its context figure, if any,
    goes to ``tree.context``."""
    if bench.figure in tree.missing:
        return None
    own = bench.figure in tree.own
    script = (tree.root if own else ROOT) / "scripts" / "perf" / bench.script
    result, err = run_script(script, (bench.own_args or ()) if own else bench.args, tree.root / "src", home)
    if result is None and not own and IMPORT_FAILURE.search(err):
        if bench.own_args is None or not (tree.root / "scripts" / "perf" / bench.script).exists():
            tree.missing[bench.figure] = f"this tree's {bench.script} cannot import its modules"
            return None
        tree.own.add(bench.figure)
        return measure(bench, tree, home)
    value = None if result is None else result.get(bench.figure)
    if result is None or not isinstance(value, int | float):
        tail = err.strip().splitlines()[-1:] or ["no output"]
        print(f"regress: {bench.script} at {tree.commit} gave no {bench.figure}: {tail[0]}", file=sys.stderr)
        return None
    if bench.context is not None and isinstance(extra := result.get(bench.context), int | float):
        tree.context.setdefault(bench.figure, []).append(float(extra))
    return float(value)


def compare(bench: Bench, now: list[float], then: list[float], threshold: float) -> dict[str, Any]:
    """Medians, the change from the recorded commit, and the verdict: ``worse`` past the threshold the wrong way,
    ``better`` past it the right way, else ``same``."""
    if not now or not then:
        return {"current": None, "recorded": None, "change": None, "verdict": "not measured",
                "current_runs": now, "recorded_runs": then}
    a, b = statistics.median(now), statistics.median(then)
    change = (a - b) / b if b else float("inf")
    wrong = change if bench.lower_is_better else -change
    verdict = "worse" if wrong > threshold else "better" if wrong < -threshold else "same"
    overlap = min(now) <= max(then) and min(then) <= max(now)  # some run of each within the other's range
    return {"current": round(a, 3), "recorded": round(b, 3), "change": round(change, 3), "verdict": verdict,
            "runs_overlap": overlap, "current_runs": now, "recorded_runs": then}


def report(figures: dict[str, dict[str, Any]], now: Tree, then: Tree, machine: dict[str, Any],
           args: argparse.Namespace) -> None:
    """The table (stdout), the verdict, and this tree's figures as a row for the README's headline table."""
    print(f"\n{'figure':<26} {now.commit:>20} {then.commit:>20} {'change':>8}  verdict")
    for name, f in figures.items():
        if f["change"] is None:
            print(f"{name:<26} {'-':>20} {'-':>20} {'-':>8}  not measured {f.get('why_not_measured', '')}")
            continue
        notes = [*(["the runs of both overlap: repeat it"] if f["verdict"] != "same" and f["runs_overlap"] else []),
                 *(["recorded: its own script"] if name in then.own else []),
                 *(f"{k} {v['current']} vs {v['recorded']}" for k, v in f.items() if isinstance(v, dict))]
        print(f"{name:<26} {f['current']:>20} {f['recorded']:>20} {f['change']:>+8.1%}  {f['verdict']}"
              + (f" ({'; '.join(notes)})" if notes else ""))
    worse = [n for n, f in figures.items() if f["verdict"] == "worse"]
    limit = f"{args.threshold:.0%}"
    print(f"\nmoved more than {limit} the wrong way: {', '.join(worse)}" if worse
          else f"\nno figure moved more than {limit} the wrong way")
    cells = " | ".join("-" if figures[b.figure]["current"] is None else str(figures[b.figure]["current"])
                       for b in BENCHES)
    print(f"README row: | {machine['date'][:10]} | `{now.commit}` | {machine_label(machine)} | {cells} | "
          f"regress.py, {args.repeats} repeats, load {machine['load_1m']} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", metavar="COMMIT", help="compare with this commit (default: the README table's last)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each figure per commit (default: 2)")
    p.add_argument("--threshold", type=float, default=0.2, help="a move the wrong way past this flags (default 0.2)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    try:
        against = args.against or recorded_commit(README)
        recorded = git("rev-parse", "--verify", "--short=12", f"{against}^{{commit}}")
        current = git("rev-parse", "--short=12", "HEAD") + ("-dirty" if git("status", "--porcelain") else "")
    except (OSError, ValueError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        print(f"regress: cannot start: {detail}", file=sys.stderr)
        return 2
    machine = machine_info(commit=False)  # the commits are the two measured, below
    print(f"regress: this tree ({current}) against {recorded}, on {machine_label(machine)}, load "
          f"{machine['load_1m']}; {args.repeats} repeat(s) of {len(BENCHES)} figures", file=sys.stderr)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="regress-") as tmp, checkout(recorded, Path(tmp)) as old_root:
        now, then = Tree(ROOT, current), Tree(old_root, recorded)
        for r in range(args.repeats):
            for bench in BENCHES:
                for tree in (now, then) if r % 2 == 0 else (then, now):  # alternate which commit goes first
                    value = measure(bench, tree, Path(tmp))
                    if value is not None:
                        tree.values.setdefault(bench.figure, []).append(value)
                    own = " (its own script)" if bench.figure in tree.own else ""
                    print(f"regress: repeat {r + 1}/{args.repeats}: {bench.figure} at {tree.commit}{own}: {value} "
                          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    figures = {b.figure: compare(b, now.values.get(b.figure, []), then.values.get(b.figure, []), args.threshold)
               for b in BENCHES}
    for b in BENCHES:
        if b.context is not None and b.figure in now.context and b.figure in then.context:
            figures[b.figure][b.context] = {"current": round(statistics.median(now.context[b.figure]), 3),
                                            "recorded": round(statistics.median(then.context[b.figure]), 3)}
    for tree in (now, then):
        for figure, why in tree.missing.items():
            figures[figure]["why_not_measured"] = f"at {tree.commit}: {why}"
    worse = [name for name, f in figures.items() if f["verdict"] == "worse"]
    report(figures, now, then, machine, args)
    if args.json:
        print(json.dumps({"current": current, "recorded": recorded, "machine": machine,
                          "load_1m_end": round(os.getloadavg()[0], 2), "repeats": args.repeats,
                          "threshold": args.threshold, "figures": figures, "recorded_own_script": sorted(then.own),
                          "worse": worse, "wall_s": round(time.monotonic() - t0, 1)}))
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
