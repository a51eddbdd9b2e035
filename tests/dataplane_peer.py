"""An env worker's column pool as its own process, for tests/test_dataplane_reader.py.

``python tests/dataplane_peer.py SOCKET --rollouts N [--pool BYTES]``: a ``ColumnStore`` of BYTES served
read-only at the Unix socket SOCKET; writes rollouts ``r0..r{N-1}`` (``peer_samples(i)``), then prints one JSON
line ``{"manifest": <hex of the step manifest>, "pid": <pid>}`` and serves until stdin closes (or it is
killed). A line ``release r0,r1`` on stdin releases those rollouts and prints ``{"released": n, "live": bytes}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys

import numpy as np

from orchestrator.columns.memfd import serve_pool
from orchestrator.columns.samples import Sample
from orchestrator.columns.store import ColumnStore, rollout_layout
from orchestrator.contracts.manifest import build_manifest, encode_manifest
from orchestrator.contracts.protocol import PoolInfo, RolloutHeader, RolloutRecord

WORKER = "peer-worker"


def peer_samples(i: int) -> list[Sample]:
    """Rollout ``i``'s samples: every value depends on ``i``; routed experts uint16 ``[tokens, 3, 2]``."""
    out = []
    for j, tokens in enumerate((40 + 7 * i, 9)):
        base = np.arange(tokens, dtype=np.int64) + 1000 * i + 100 * j
        out.append(Sample(token_ids=base.astype(np.int32), loss_mask=(base % 2).astype(np.uint8),
                          logprobs=(-base / 7).astype(np.float32),
                          routed_experts=(base[:, None, None] * 3 + np.arange(6).reshape(1, 3, 2)).astype(np.uint16)
                          % 300))
    return out


def record(store: ColumnStore, i: int) -> RolloutRecord:
    samples = peer_samples(i)
    shapes, dtype, _ = rollout_layout(samples)
    span = store.put(f"r{i}", samples)
    assert span is not None, "the pool is too small for the peer's rollouts"
    header = RolloutHeader(rid=f"r{i}", group="g", env="e", task=0, policy_step=0, worker=WORKER, server="s",
                           ok=True, reward=float(i), samples=shapes, routed_dtype=dtype,
                           tokens=sum(s[0] for s in shapes), span=span)
    return RolloutRecord(header, [])


async def serve(path: str, rollouts: int, pool: int) -> None:
    store = ColumnStore(pool)
    try:
        async with serve_pool(store, path):
            trained = [(record(store, i), 0.5 - i) for i in range(rollouts)]
            info = PoolInfo(id=store.id, size=store.capacity, host=socket.gethostname(), path=path)
            manifest = build_manifest("peer", 0, trained, {WORKER: info})
            print(json.dumps({"manifest": encode_manifest(manifest).hex(), "pid": os.getpid()}), flush=True)
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                if line.startswith("release "):
                    freed = store.release(line.split(maxsplit=1)[1].strip().split(","))
                    print(json.dumps({"released": freed, "live": store.live_bytes}), flush=True)
    finally:
        store.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("socket")
    p.add_argument("--rollouts", type=int, required=True)
    p.add_argument("--pool", type=int, default=1 << 20)
    args = p.parse_args()
    asyncio.run(serve(args.socket, args.rollouts, args.pool))


if __name__ == "__main__":
    main()
