"""Write a synthetic step dump, so replay_step.py works without a real run.

``--rollouts`` rollout records in groups of ``--group-size`` (two environments, binary rewards), each one
sample of ``--tokens`` tokens over ``--turns`` turns with routed experts ``--layers`` x ``--top-k``, built
into a batch by the real StepBuilder (default pipeline config) and written with ``write_dump`` at ``--out``
(the dump directory itself; an existing dump there is replaced). Seeded: the same flags give the same bytes.

    .venv/bin/python scripts/perf/synth_step.py --out /tmp/step_synth --json
    .venv/bin/python scripts/perf/replay_step.py /tmp/step_synth --synthetic-traffic 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _steplib as lib
from _machine import with_machine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=256, help="rollout records (default: 256)")
    p.add_argument("--turns", type=int, default=8, help="turns per rollout (default: 8)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rollout (default: 4096)")
    p.add_argument("--layers", type=int, default=48, help="routed-expert layers; 0: none (default: 48)")
    p.add_argument("--top-k", type=int, default=8, help="routed experts per token; 0: none (default: 8)")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per group (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    p.add_argument("--out", required=True, metavar="PATH", help="the dump directory to write")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    if min(args.rollouts, args.turns, args.tokens, args.group_size) < 1 or min(args.layers, args.top_k) < 0:
        p.error("--rollouts, --turns, --tokens and --group-size must be >= 1; --layers and --top-k >= 0")
    start = time.perf_counter()
    inp = lib.synthetic_input(args.rollouts, args.turns, args.tokens, args.layers, args.top_k,
                              group_size=args.group_size, seed=args.seed)
    path, nbytes, batch = lib.build_and_dump(inp, Path(args.out))
    result = {"path": str(path), "rollouts": inp.rollouts, "tokens": inp.tokens, "samples": batch.num_samples,
              "mb": round(nbytes / 2**20, 1), "seconds": round(time.perf_counter() - start, 2)}
    if not args.json:
        print(f"wrote {path}: {inp.rollouts} rollouts, {inp.tokens} tokens, {batch.num_samples} samples "
              f"in the batch, {result['mb']} MB")
    print(json.dumps(with_machine(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
