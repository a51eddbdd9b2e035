"""Run the test suite N times while other processes keep every core busy: a flaky test shows up here.

    .venv/bin/python scripts/flake.py                 # 5 runs, one busy process per core
    .venv/bin/python scripts/flake.py --runs 10 --load 3 -- -k faults

Each run is a fresh ``pytest`` process, its output kept in ``outputs/flake/run_N.log``. The busy processes
(plain Python spin loops, not niced) run for the whole session and are stopped by their pid at the end,
however it ends. Prints one line per run (exit status, wall time, failed tests) and a summary; the last line
is a JSON object. Exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPIN = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="suite runs (default 5)")
    p.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per core)")
    p.add_argument("--stop-on-failure", action="store_true", help="stop after the first failed run")
    p.add_argument("--logs", type=Path, default=REPO / "outputs" / "flake",
                   help="each run's full pytest output goes to LOGS/run_N.log (default: outputs/flake)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args()
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *args.pytest_args]
    limit = 4 * 3600  # a spinner outlives no session by more than this, even if this script is SIGKILLed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below stops what we started
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(limit=limit)]) for _ in range(args.load)]
    runs: list[dict[str, object]] = []
    args.logs.mkdir(parents=True, exist_ok=True)
    try:
        print(f"flake: {args.runs} runs of the suite with {args.load} busy processes", flush=True)
        for i in range(args.runs):
            t0 = time.monotonic()
            with subprocess.Popen(pytest, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
                try:
                    out, err = child.communicate()
                finally:
                    if child.poll() is None:  # interrupted: stop the suite run, by its pid
                        child.kill()
                        child.wait()
            proc = subprocess.CompletedProcess(pytest, child.returncode, out, err)
            wall = time.monotonic() - t0
            (args.logs / f"run_{i}.log").write_text(proc.stdout + proc.stderr)
            failed = sorted(set(FAILED.findall(proc.stdout)))
            tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
            runs.append({"run": i, "rc": proc.returncode, "wall_s": round(wall, 1), "failed": failed})
            print(f"run {i}: exit {proc.returncode} in {wall:.0f} s: {tail[0]} (log: {args.logs}/run_{i}.log)",
                  flush=True)
            for name in failed:
                print(f"    {name}", flush=True)
            if proc.returncode and not failed:  # a crash or a collection error: show the end of the output
                print("\n".join(proc.stdout.splitlines()[-30:] + proc.stderr.splitlines()[-30:]), flush=True)
            if proc.returncode and args.stop_on_failure:
                break
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    passed = sum(r["rc"] == 0 for r in runs)
    walls = sorted(float(r["wall_s"]) for r in runs)  # type: ignore[arg-type]
    print(f"flake: {passed} of {len(runs)} runs passed; median wall {walls[len(walls) // 2]:.0f} s")
    print(json.dumps({"runs": len(runs), "passed": passed, "load": args.load,
                      "median_wall_s": walls[len(walls) // 2], "results": runs}))
    return 0 if passed == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
