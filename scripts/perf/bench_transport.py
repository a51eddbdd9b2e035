"""Benchmark: our batch send + receive vs raw pyzmq on the same bytes, over ipc:// and tcp://127.0.0.1.

One batch of ``--samples`` samples (default 256) and ``--tokens`` tokens in all (default ~1M) with routed
experts ``--layers`` x ``--top-k`` (default 128 x 8: ~1 GB). Each transfer is timed from the first send
to the receiver holding numpy arrays of every column; the raw baseline sends the very same frames with
``send_multipart(copy=False)`` and receives them with ``copy=False``, each end with its own zmq context
(I/O thread), as our sender and receiver have. ``--scale`` shrinks the batch.

Each measurement runs ``--passes`` times, raw and ours interleaved, and the medians are compared.
Prints ``ipc_ratio`` and ``tcp_ratio`` (raw time / our time: 1.0 is parity, target >= 0.9), ``header_ms``
(encode + decode of the header for all samples) and ``list_encode_ms`` (the same token columns as msgpack
lists of ints and floats, the naive alternative).

Shared memory (``transport.kind = "shm"``): the same batches through a pool of two batches (``hwm = 2``),
timed the same way, against a numpy copy of the same column bytes into one warm buffer, in the same run:
``shm_gbps``, ``memcpy_gbps`` and ``shm_ratio`` (memcpy time / shm time; target >= 0.4). The pool is warmed
by one untimed pass first (its pages are faulted in once and reused for the rest of a job);
``shm_cold_gbps`` is that first pass. Last line with --json: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio
from _machine import with_machine

from orchestrator.contracts.wire import shm_layout
from orchestrator.transport import Batch, BatchReceiver, BatchSender, decode, encode


def make_batch(samples: int, tokens: int, layers: int, top_k: int) -> Batch:
    rng = np.random.default_rng(0)
    lengths = np.full(samples, tokens // samples)
    total = int(lengths.sum())
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [rng.integers(0, 150_000, total, dtype=np.int32)],
        "loss_mask": [rng.integers(0, 2, total, dtype=np.uint8)],
        "logprobs": [rng.normal(size=total).astype(np.float32)],
        "routed_experts": [rng.integers(0, 256, (total, layers, top_k), dtype=np.uint8)],
    }
    scalars: dict[str, list[Any]] = {"advantage": [0.0] * samples, "reward": [1.0] * samples,
                                     "env": ["e"] * samples}
    return Batch.from_columns("bench", 0, chunks, lengths.tolist(), scalars)


async def ours(address: str, batches: list[Batch]) -> float:
    async with BatchSender.open(address, hwm=2) as sender:
        receiver = BatchReceiver(sender.address)
        try:
            await asyncio.sleep(0.2)  # connected
            start = time.perf_counter()
            send = asyncio.gather(*(sender.send(b) for b in batches))
            for _ in batches:
                got = await receiver.recv()
                assert got.columns["routed_experts"].shape[0] == got.num_tokens
            await send
            return time.perf_counter() - start
        finally:
            receiver.close()


async def shm(address: str, batches: list[Batch]) -> tuple[float, float]:
    """Seconds to send and receive ``batches`` through a fresh pool (cold: first touch of its pages), then
    the same again (warm). The columns received are views of the receiver's mapping."""
    pool_bytes = 2 * shm_layout(batches[0].columns)[1]
    async with BatchSender.open(address, hwm=2, shm_bytes=pool_bytes) as sender:
        receiver = BatchReceiver(sender.address)
        try:
            await asyncio.sleep(0.2)  # connected
            times = []
            for first in (0, len(batches)):
                start = time.perf_counter()
                send = asyncio.gather(*(sender.send(Batch(b.run, first + i, b.columns, b.offsets, b.scalars))
                                        for i, b in enumerate(batches)))
                for _ in batches:
                    got = await receiver.recv()  # releases the previous one
                    assert got.shm_pool is not None
                    assert got.columns["routed_experts"].shape[0] == got.num_tokens
                await send
                times.append(time.perf_counter() - start)
            await receiver.release(got)
            await sender.wait_acked()
            return times[0], times[1]
        finally:
            receiver.close()


def memcpy(batch: Batch, steps: int) -> float:
    """Seconds for ``steps`` numpy copies of ``batch``'s column bytes into one buffer (faulted in first)."""
    cols = [np.ascontiguousarray(c).reshape(-1).view(np.uint8) for c in batch.columns.values()]
    dst = np.empty(sum(c.size for c in cols), np.uint8)

    def once() -> None:
        at = 0
        for c in cols:
            dst[at:at + c.size] = c
            at += c.size

    once()
    start = time.perf_counter()
    for _ in range(steps):
        once()
    return time.perf_counter() - start


async def raw(address: str, frames: list[list[Any]]) -> float:
    # A context (an I/O thread) per end, as ours has and as two processes have: one shared thread moves
    # ipc bytes ~20% faster here (it writes and reads on one core), which no sender and trainer get.
    send_ctx, recv_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
    push, pull = send_ctx.socket(zmq.PUSH), recv_ctx.socket(zmq.PULL)
    push.setsockopt(zmq.SNDHWM, 2)
    push.bind(address)
    pull.connect(push.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        await asyncio.sleep(0.2)
        start = time.perf_counter()
        send = asyncio.gather(*(push.send_multipart(f, copy=False) for f in frames))
        for _ in frames:
            parts = await pull.recv_multipart(copy=False)
            assert np.frombuffer(parts[-1].buffer, np.uint8).size > 0
        await send
        return time.perf_counter() - start
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        send_ctx.term()
        recv_ctx.term()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--layers", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--scale", type=float, default=1.0, help="multiply --tokens by this (quick runs: 0.1)")
    p.add_argument("--steps", type=int, default=3, help="batches per measurement")
    p.add_argument("--passes", type=int, default=3, help="interleaved passes of each measurement (medians)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args()

    tokens = int(args.tokens * args.scale)
    base = make_batch(args.samples, tokens, args.layers, args.top_k)
    batches = [Batch(base.run, i, base.columns, base.offsets, base.scalars) for i in range(args.steps)]
    frames = [encode(b) for b in batches]
    nbytes = sum(len(f) for f in frames[0])
    result: dict[str, Any] = {"samples": args.samples, "tokens": base.num_tokens, "batch_mb": round(nbytes / 2**20, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, address in (("ipc", f"ipc://{tmp}/bench.sock"), ("tcp", "tcp://127.0.0.1:0")):
            pairs = [(asyncio.run(raw(address, frames)), asyncio.run(ours(address, batches)))
                     for _ in range(args.passes)]  # interleaved: a slow spell of the machine hits both
            raw_s, our_s = statistics.median(r for r, _ in pairs), statistics.median(o for _, o in pairs)
            result[f"{kind}_gbps"] = round(nbytes * args.steps / our_s / 1e9, 2)
            result[f"{kind}_raw_gbps"] = round(nbytes * args.steps / raw_s / 1e9, 2)
            result[f"{kind}_ratio"] = round(raw_s / our_s, 3)
            result[f"{kind}_pass_ratios"] = [round(r / o, 3) for r, o in pairs]
        runs = [(*asyncio.run(shm(f"ipc://{tmp}/shm.sock", batches)), memcpy(base, args.steps))
                for _ in range(args.passes)]
    column_bytes = sum(c.nbytes for c in base.columns.values()) * args.steps
    shm_s, copy_s = statistics.median(r[1] for r in runs), statistics.median(r[2] for r in runs)
    result["shm_cold_gbps"] = round(column_bytes / statistics.median(r[0] for r in runs) / 1e9, 2)
    result["shm_gbps"] = round(column_bytes / shm_s / 1e9, 2)
    result["memcpy_gbps"] = round(column_bytes / copy_s / 1e9, 2)
    result["shm_ratio"] = round(copy_s / shm_s, 3)
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        decode(encode(base))
    result["header_ms"] = round((time.perf_counter() - start) / reps * 1e3, 3)
    start = time.perf_counter()
    msgpack.packb({k: base.columns[k].tolist() for k in ("token_ids", "loss_mask", "logprobs")})
    result["list_encode_ms"] = round((time.perf_counter() - start) * 1e3, 1)
    if not args.json:
        print(f"ipc {result['ipc_gbps']} GB/s vs raw {result['ipc_raw_gbps']} (ratio {result['ipc_ratio']}); "
              f"tcp {result['tcp_gbps']} vs raw {result['tcp_raw_gbps']} (ratio {result['tcp_ratio']}); "
              f"shm {result['shm_gbps']} GB/s vs memcpy {result['memcpy_gbps']} (ratio {result['shm_ratio']})")
    print(json.dumps(with_machine(result)))


if __name__ == "__main__":
    main()
