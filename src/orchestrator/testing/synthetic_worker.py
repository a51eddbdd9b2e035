"""A synthetic env worker: the real ``Worker`` (protocol, heartbeats, groups, flushes, column pool or frames)
with environments and inference replaced by rollouts of a fixed shape, made at once or at a set rate.

Each assigned rollout is one sample of ``tokens`` tokens with routed experts ``[tokens, layers, top_k]``
(uint8; none when ``layers`` is 0), a reward drawn from a seeded generator (so groups have advantages), and
goes out through ``Worker._columns``: as four column frames (``data_plane = "through"``) or written once into
this worker's pool (``"direct"``). The arrays are made once and written for every rollout, so a rollout costs
the worker what the record path costs, not what making data costs. ``write=False`` reserves the pool's spans
without writing them: the pool's pages are never touched, which lets a benchmark hold far more rollouts than
this machine has memory for (the orchestrator never reads the pool, so its cost is the same). ``prefault=True``
faults every page of the pool in when it is made, as a long-running worker's pool is: otherwise a short run's
rollouts each pay for first touching their span's pages (~350 page faults and a third of the worker's CPU for a
64k-token rollout with routed experts 48 x 8), which slows the worker and is no cost of the record path.

``rate`` (rollouts/s, per worker) paces rollout completions evenly; None: as fast as the worker runs.

    python -m orchestrator.testing.synthetic_worker --connect ipc:///tmp/run/workers.sock --id syn-0 \\
        --tokens 8192 --layers 48 --top-k 8 --rate 500

The orchestrator admits it as a remote worker (``scheduler.remote_workers``); its setup's environments get
``--tasks`` tasks each, whatever their taskset. Used by scripts/perf/bench_data_plane.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import mmap
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.columns.layout import SpanLayout
from orchestrator.columns.samples import Sample
from orchestrator.columns.store import ColumnStore
from orchestrator.contracts.protocol import AssignedRollout, RolloutHeader, Setup
from orchestrator.testing.jobs import Section, toml_text
from orchestrator.workers.process import LoadedEnv, Worker


class _Slots:
    """What ``Worker._run_group`` asks of an environment: slots (none needed here)."""

    def slots(self, task: Any, n: int) -> list[None]:
        return [None] * n


class UnwrittenStore(ColumnStore):
    """A column pool that allocates spans and writes nothing into them (see the module docstring)."""

    def _write(self, start: int, layout: SpanLayout, samples: Sequence[Sample]) -> None:
        pass


class ResidentStore(ColumnStore):
    """A column pool whose pages are all faulted in when it is made (see the module docstring)."""

    def _open_pool(self) -> None:
        super()._open_pool()
        self._bytes[::mmap.PAGESIZE] = 0  # one write per page: the kernel allocates each one now


class SyntheticWorker(Worker):
    """The real ``Worker`` with its three environment-facing steps replaced: ``_load`` (no verifiers: each setup
    environment gets ``tasks`` tasks), ``_model_context`` (no inference client) and ``_run_one`` (a fixed-shape
    rollout, paced at ``rate``); everything from ``_columns`` on is the worker's own."""

    def __init__(self, address: str, worker_id: str, *, tokens: int, layers: int = 0, top_k: int = 0,
                 rate: float | None = None, tasks: int = 64, write: bool = True, prefault: bool = False,
                 seed: int = 0) -> None:
        super().__init__(address, worker_id)
        if not write:
            self.store_class = UnwrittenStore
        elif prefault:
            self.store_class = ResidentStore
        rng = np.random.default_rng(seed)
        routed = rng.integers(0, 256, (tokens, layers, top_k), dtype=np.uint8) if layers else None
        self.sample = Sample(rng.integers(0, 32_000, tokens, dtype=np.int32), np.ones(tokens, np.uint8),
                             rng.uniform(-3, 0, tokens).astype(np.float32), routed)
        self.rng = rng
        self.rate = rate
        self.n_tasks = tasks
        self._due = 0.0  # when the next paced rollout completes (monotonic)

    async def _load(self, stack: contextlib.AsyncExitStack, setup: Setup) -> None:
        for spec in setup.envs:
            self.envs[spec.name] = LoadedEnv(spec.name, _Slots(), tasks=range(self.n_tasks))

    def _model_context(self, server: str, sampling: dict[str, Any]) -> Any:
        return None

    async def _run_one(self, done: asyncio.Queue[tuple[RolloutHeader, list[Any]]], loaded: LoadedEnv, slot: Any,
                       ctx: Any, base: AssignedRollout, train: bool) -> None:
        """One rollout: wait for its paced completion time, then put its record (the one sample, through the
        worker's record path) on ``done``."""
        start = time.monotonic()
        if self.rate is not None:  # completions evenly spaced at the rate, however many run at once
            self._due = max(self._due, start) + 1.0 / self.rate
            await asyncio.sleep(self._due - start)
        n = self.sample.num_tokens
        shape = (n, *self.sample.routed_experts.shape[1:]) if self.sample.routed_experts is not None else (n, 0, 0)
        header = RolloutHeader(rid=base.rid, group=base.group, env=base.env, task=base.task,
                               policy_step=base.policy_step, worker=self.worker_id, server=base.server, ok=True,
                               reward=float(self.rng.random()), samples=[shape], tokens=n, turns=1,
                               wall_s=round(time.monotonic() - start, 4), stop="length")
        done.put_nowait(await self._columns(header, [self.sample]))


def job_toml(out: Path, sim_url: str, *, data_plane: str, batch: int, steps: int, workers: int, pool_mb: int,
             buffered: int | None = None, **more: Section | Sequence[Section]) -> str:
    """A job for synthetic workers: ``workers`` remote workers on ``ipc://OUT/workers.sock``, the trainer link on
    ``ipc://OUT/trainer.sock``, one environment ("syn", groups of 8), every finished group trained (no gates),
    no off-policy bound in the way (no weight syncs: the trainer announces nothing). ``more``: more sections
    (``monitor={...}``, as ``testing.jobs`` writes them)."""
    return toml_text(
        run={"name": "synthetic", "output_dir": out, "max_steps": steps}, inference={"servers": [sim_url]},
        scheduler={"batch_size": batch, "max_inflight": min(batch, 256), "max_async_level": steps,
                   "max_off_policy_steps": steps, "max_buffered_rollouts": buffered or 2 * batch,
                   "remote_workers": workers, "worker_address": f"ipc://{out}/workers.sock"},
        transport={"address": f"ipc://{out}/trainer.sock", "data_plane": data_plane, "worker_pool_mb": pool_mb},
        pipeline={"gates": []},
        env=[{"name": "syn", "taskset": "orchestrator-arithmetic", "group_size": 8, "workers": 0}], **more)


def worker_command(address: str, worker_id: str, *, tokens: int, layers: int = 0, top_k: int = 0,
                   rate: float | None = None, write: bool = True, prefault: bool = False, seed: int = 0) -> list[str]:
    """The command line of one synthetic worker process (``main`` below)."""
    return [sys.executable, "-m", "orchestrator.testing.synthetic_worker", "--connect", address, "--id", worker_id,
            "--tokens", str(tokens), "--layers", str(layers), "--top-k", str(top_k), "--seed", str(seed),
            *([] if rate is None else ["--rate", str(rate)]), *([] if write else ["--no-write"]),
            *(["--prefault"] if prefault else [])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connect", required=True, metavar="ADDRESS")
    p.add_argument("--id", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--rate", type=float, default=None, help="rollouts/s (default: as fast as it runs)")
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--no-write", dest="write", action="store_false", help="reserve pool spans, write nothing")
    p.add_argument("--prefault", action="store_true", help="fault the whole pool's pages in when it is made")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    worker = SyntheticWorker(args.connect, args.id, tokens=args.tokens, layers=args.layers, top_k=args.top_k,
                             rate=args.rate, tasks=args.tasks, write=args.write, prefault=args.prefault,
                             seed=args.seed)
    return int(uvloop.run(worker.run()))


if __name__ == "__main__":
    raise SystemExit(main())
