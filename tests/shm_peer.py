"""One side of the shared-memory transport as its own process, for tests/test_shm.py.

``python tests/shm_peer.py recv ADDRESS --steps N [--last-step K] [--hold]``: a SyncBatchReceiver
(auto_ack: each batch is released by the next recv); checks every batch against ``peer_batch(step)``; prints
one JSON line per step received, ``{"step", "fds", "maps", "fetches"}`` (open fds, mappings of the pool in
/proc/self/maps, pools fetched); releases the last batch and exits after N steps. With ``--hold`` it keeps
the last batch instead (having released every earlier one) and waits to be killed.

``python tests/shm_peer.py send ADDRESS --steps N --pool BYTES [--start S] [--hwm H]``: a BatchSender with a
pool of BYTES; sends steps S..S+N-1, printing ``{"sent": step}`` after each, waits (at most WAIT_S) for the
trainer's acknowledgements and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.transport import Batch, BatchSender, SyncBatchReceiver

MEMFD = "/memfd:orchestrator-batches"
WAIT_S = 120.0  # a hang guard only: the other side may be a process still starting on a busy machine


def peer_batch(step: int, samples: int = 4, tokens_each: int = 16) -> Batch:
    """A small batch whose every byte depends on ``step``, so a stale or overwritten view shows."""
    total = samples * tokens_each
    base = np.arange(total, dtype=np.int64) + step * 7919
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [base.astype(np.int32)], "loss_mask": [(base % 2).astype(np.uint8)],
        "logprobs": [(base / 1000).astype(np.float32)],
        "routed_experts": [(base[:, None, None] + np.arange(8).reshape(1, 4, 2)).astype(np.uint8) % 251]}
    scalars: dict[str, list[Any]] = {"advantage": [float(step)] * samples, "env": ["e"] * samples}
    return Batch.from_columns("peer", step, chunks, [tokens_each] * samples, scalars)


def matches(batch: Batch) -> bool:
    want = peer_batch(batch.step)
    return all(np.array_equal(batch.columns[k], v) for k, v in want.columns.items()) and len(batch.columns) == 4


def memfd_maps() -> int:
    return sum(MEMFD in line for line in Path("/proc/self/maps").read_text().splitlines())


def open_fds() -> int:
    return sum(1 for _ in Path("/proc/self/fd").iterdir())


def dev_shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()}


async def left_in_dev_shm(before: set[str], settle_s: float = 2.0) -> set[str]:
    """The entries of /dev/shm made since ``before`` that stay, and are not another program's: one held open or
    mapped by a live process that is neither this one nor one of its descendants (a test in another pytest-xdist
    worker, torch's shared memory on a shared machine) is not this test's, nor one gone within ``settle_s``
    (multiprocessing links each semaphore's name, sem.mp-*, and unlinks it at once). A leak stays."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle_s
    while True:
        left = not_held_elsewhere(dev_shm() - before)
        if not left or loop.time() >= deadline:
            return left
        await asyncio.sleep(0.1)


def not_held_elsewhere(names: set[str]) -> set[str]:
    inodes: dict[int, str] = {}
    for n in names:
        with contextlib.suppress(OSError):
            inodes[Path("/dev/shm", n).stat().st_ino] = n
    me, others = os.getpid(), set()
    for d in Path("/proc").iterdir() if inodes else ():
        if d.name.isdigit() and not descends_from(int(d.name), me):
            others |= held(d, inodes)
    return set(inodes.values()) - others  # one gone meanwhile is not left


def descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def held(proc: Path, inodes: dict[int, str]) -> set[str]:
    """Which of these /dev/shm entries (by inode: glibc maps a semaphore under a temporary name it then links to the
    entry's, so paths do not match) the process ``proc`` (/proc/PID) maps or has open."""
    found: set[str] = set()
    try:
        for line in (proc / "maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and int(fields[4]) in inodes:
                found.add(inodes[int(fields[4])])
        fds = list((proc / "fd").iterdir())
    except (OSError, ValueError):
        return found
    for fd in fds:
        with contextlib.suppress(OSError):
            ino = fd.stat().st_ino
            if ino in inodes and str(fd.readlink()).startswith("/dev/shm/"):
                found.add(inodes[ino])
    return found


def receive(address: str, steps: int, last_step: int | None, hold: bool) -> None:
    receiver = SyncBatchReceiver(address, last_step=last_step)
    batch = None
    try:
        for _ in range(steps):
            batch = receiver.recv(timeout_s=WAIT_S)
            if not matches(batch) or batch.shm_pool is None:
                raise SystemExit(f"step {batch.step}: wrong contents or not shared memory")
            print(json.dumps({"step": batch.step, "fds": open_fds(), "maps": memfd_maps(),
                              "fetches": receiver.shm.fetches}), flush=True)
        if hold:
            sys.stdin.read()  # until killed (or stdin closes): the last batch stays unreleased
            return
        if batch is not None:
            receiver.release(batch)
    finally:
        receiver.close()


async def send(address: str, steps: int, start: int, pool: int, hwm: int) -> None:
    async with BatchSender.open(address, hwm, warn_s=5.0, shm_bytes=pool) as sender:
        for step in range(start, start + steps):
            await sender.send(peer_batch(step))
            print(json.dumps({"sent": step}), flush=True)
        async with asyncio.timeout(WAIT_S):
            await sender.wait_acked()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["recv", "send"])
    p.add_argument("address")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--last-step", type=int, default=None)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--pool", type=int, default=1 << 20)
    p.add_argument("--hwm", type=int, default=2)
    p.add_argument("--hold", action="store_true", help="recv: keep the last batch and wait to be killed")
    args = p.parse_args()
    if args.mode == "recv":
        receive(args.address, args.steps, args.last_step, args.hold)
    else:
        asyncio.run(send(args.address, args.steps, args.start, args.pool, args.hwm))


if __name__ == "__main__":
    main()
