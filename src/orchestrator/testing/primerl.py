"""A stand-in for prime-rl's trainer (559b447) on the wire: its data ranks, its weight broadcasts, its checks.

For tests of ``[transport] kind = "prime-rl"`` (and users' own): it does what prime-rl's trainer does with our
messages, nothing more, and decodes them with prime-rl's structs as typed, strict msgspec structs (``MicroBatch``
below, written from the field list of ``src/prime_rl/transports/rollouts/types.py``; needs msgspec, a dev
dependency). No step is on the wire: like prime-rl's receivers, a rank counts messages from its start step.

- ``ZmqRank``: one data rank as ``ZMQMicroBatchReceiver``: SUB to ``tcp://HOST:PORT`` subscribed to
  ``data_rank|<r>|``, PUSH to PORT + 1 sending READY (``b"<r>"``) once; ``await recv()`` -> ``list[MicroBatch]``.
- ``FileRank``: one data rank as ``FileSystemMicroBatchReceiver``: polls ``rollouts/step_<N>/rank_<r>.bin``.
- ``FakePrimeRLTrainer``: every rank of one trainer; ``await step()`` receives the next step on every rank
  (the ranks step together, as FSDP's collectives make them), ``publish(step)`` writes
  ``broadcasts/step_<N>/`` (a tiny ``model.safetensors``, then ``STABLE``), as the trainer does after training
  its step N (and for its start step - 1 when it starts: ``step_0`` fresh).
- ``check_step(grid, seq_len=..., pad_to_multiple_of=...)``: the invariants prime-rl's trainer relies on
  (aligned per-token arrays, segments, positions, padding values, routed experts, equal ranks) -> the samples.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from orchestrator.contracts.checkpoints import STABLE, broadcast_dir
from orchestrator.delivery.primerl import rank_file, topic
from orchestrator.trainer.reference import link_initial_policy


class EncodedTensor(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes


class RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]  # [tokens, layers, top_k]
    dtype: str


class MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


DECODER = msgspec.msgpack.Decoder(type=list[MicroBatch])
PER_TOKEN = ("loss_mask", "advantages", "inference_logprobs", "position_ids", "temperatures", "env_names")


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P with P + 1 also free now (for a trainer that must connect before the orchestrator binds)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind((host, 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind((host, port + 1))
                except OSError:
                    continue
        return int(port)
    raise RuntimeError("no two consecutive free ports")


class ZmqRank:
    """Data rank ``rank`` of a prime-rl trainer over ZMQ (see the module docstring)."""

    def __init__(self, address: str, rank: int, ctx: zmq.asyncio.Context, hwm: int = 10) -> None:
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        self.rank, self.topic = rank, topic(rank)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, hwm)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(address)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.ready = ctx.socket(zmq.PUSH)
        self.ready.setsockopt(zmq.SNDHWM, hwm)
        self.ready.setsockopt(zmq.LINGER, 1000)
        self.ready.connect(f"tcp://{host}:{int(port) + 1}")
        # once, after connect + subscribe; queued until the orchestrator is there (a sync view: no loop needed)
        zmq.Socket.shadow(self.ready.underlying).send(str(rank).encode(), flags=zmq.NOBLOCK)

    async def recv(self) -> list[MicroBatch]:
        frames = await self.sub.recv_multipart()
        assert len(frames) == 2, f"rank {self.rank}: a message of {len(frames)} frames, prime-rl unpacks 2"
        assert frames[0] == self.topic, f"rank {self.rank}: topic {frames[0]!r}"
        return DECODER.decode(frames[1])

    async def pending(self, timeout_s: float) -> bool:
        """Whether a message arrives within ``timeout_s`` (for checks that nothing more was sent)."""
        return bool(await self.sub.poll(int(timeout_s * 1000)))

    def close(self) -> None:
        self.sub.close()
        self.ready.close()


class FileRank:
    """Data rank ``rank`` of a prime-rl trainer reading ``rollouts/`` (see the module docstring)."""

    def __init__(self, trainer_dir: Path, rank: int, start_step: int, poll_s: float = 0.02) -> None:
        self.trainer_dir, self.rank, self.step, self.poll_s = trainer_dir, rank, start_step, poll_s

    async def recv(self) -> list[MicroBatch]:
        path = rank_file(self.trainer_dir, self.step - 1, self.rank)  # our step k is the trainer's step k + 1
        while True:  # polled, as prime-rl's receiver does: a file has no event to wait on
            if await asyncio.to_thread(path.exists):
                self.step += 1
                return DECODER.decode(await asyncio.to_thread(path.read_bytes))
            await asyncio.sleep(self.poll_s)

    async def pending(self, timeout_s: float) -> bool:
        path = rank_file(self.trainer_dir, self.step - 1, self.rank)
        await asyncio.sleep(timeout_s)
        return await asyncio.to_thread(path.exists)

    def close(self) -> None:
        pass


def publish(trainer_dir: Path, step: int) -> Path:
    """``broadcasts/step_<step>/`` as prime-rl's filesystem broadcast leaves it: weights, then ``STABLE``. The
    weights are a safetensors file with no tensors and, for the simulated servers, which read only their own
    format and fail a load without it (as real ones fail one without weights), the unchanged tiny policy."""
    path = broadcast_dir(trainer_dir, step)
    path.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()  # a valid safetensors file with no tensors
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    link_initial_policy(trainer_dir, path)
    (path / STABLE).touch()  # last: STABLE means the directory is complete
    return path


@dataclass
class FakePrimeRLTrainer:
    """Every data rank of one prime-rl trainer; ``address`` for the zmq layout, None for the filesystem one.
    ``start_step`` is prime-rl's ``progress.step``: 1 fresh, R + 1 resumed from checkpoint R."""

    trainer_dir: Path
    ranks: int
    address: str | None = None
    start_step: int = 1
    received: list[list[list[MicroBatch]]] = field(default_factory=list)  # [step][rank] -> micro-batches
    _ranks: list[ZmqRank] | list[FileRank] = field(default_factory=list)
    _ctx: zmq.asyncio.Context | None = None

    def start(self) -> None:
        """Connect every rank (and send READY), then broadcast the incoming policy, as the trainer starts."""
        if self.address is not None:
            self._ctx = zmq.asyncio.Context()
            self._ranks = [ZmqRank(self.address, r, self._ctx) for r in range(self.ranks)]
        else:
            self._ranks = [FileRank(self.trainer_dir, r, self.start_step) for r in range(self.ranks)]
        publish(self.trainer_dir, self.start_step - 1)

    @property
    def step_now(self) -> int:
        """The trainer step the last ``step()`` received."""
        return self.start_step + len(self.received) - 1

    async def step(self) -> list[list[MicroBatch]]:
        """The next step's micro-batches on every rank."""
        grid = list(await asyncio.gather(*(r.recv() for r in self._ranks)))
        self.received.append(grid)
        return grid

    async def pending(self, timeout_s: float) -> bool:
        """Whether any rank gets another message within ``timeout_s``."""
        return any(await asyncio.gather(*(r.pending(timeout_s) for r in self._ranks)))

    def publish(self, step: int | None = None) -> Path:
        """Broadcast the weights after trainer step ``step`` (default: the one just received)."""
        return publish(self.trainer_dir, self.step_now if step is None else step)

    def close(self) -> None:
        for r in self._ranks:
            r.close()
        if self._ctx is not None:
            self._ctx.term()


@dataclass
class Sample:
    """One sample as it reached the trainer (pads excluded)."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantage: float | None  # on its loss-mask tokens (None: it has none)
    temperature: float
    env: str
    logprobs: list[float]
    routed: np.ndarray | None  # [tokens, layers, top_k] in the dtype sent
    ref_logprobs: list[float] | None = None  # the micro-batch's, over this sample's tokens (None: it had none)
    ref_kl_weights: list[float] | None = None
    rl_weights: list[float] | None = None


def check_step(grid: list[list[MicroBatch]], *, seq_len: int, pad_to_multiple_of: int = 1,
               routed_dtype: str | None = None) -> list[Sample]:
    """Assert what prime-rl's trainer relies on for one step's ``grid`` ([rank] -> micro-batches); return the
    samples of the micro-batches with loss (dummies, which only fill up ranks, are checked and skipped)."""
    assert grid, "no ranks"
    assert all(grid), "every rank needs at least one micro-batch (the trainer reads micro_batches[0])"
    assert len({len(mbs) for mbs in grid}) == 1, f"ranks got {[len(m) for m in grid]} micro-batches"
    samples: list[Sample] = []
    flat = [mb for mbs in grid for mb in mbs]
    for mb in flat:
        _check_micro_batch(mb, seq_len, pad_to_multiple_of, routed_dtype)
        if any(mb.loss_mask):
            samples += _samples(mb)
        elif set(mb.env_names) != {""}:  # a dummy: a copy of a real micro-batch without loss (not pads alone:
            # what a step without samples sends)
            assert all(a == 0.0 for a in mb.advantages)
            assert any(other.input_ids == mb.input_ids and any(other.loss_mask) for other in flat), "dummy of what?"
    return samples


def _check_micro_batch(mb: MicroBatch, seq_len: int, multiple: int, routed_dtype: str | None) -> None:
    n = len(mb.input_ids)
    assert n > 0
    for name in PER_TOKEN:
        assert len(getattr(mb, name)) == n, f"{name}: {len(getattr(mb, name))} values for {n} tokens"
    assert all(type(m) is bool for m in mb.loss_mask)
    assert sum(mb.sequence_lengths) == sum(mb.seq_lens) == n
    assert n % multiple == 0, f"{n} tokens, not a multiple of {multiple}"
    pads = mb.env_names.count("")
    assert n - pads <= seq_len, f"{n} tokens with {pads} pads for seq_len {seq_len}"
    only_pads = pads == n  # a step without samples: one micro-batch of pads per rank
    assert pads < multiple or only_pads, f"{pads} pads to reach a multiple of {multiple}"
    assert "all" not in mb.env_names
    at = 0
    for length in mb.sequence_lengths:
        real = length - (pads if at + length == n else 0)
        assert mb.position_ids[at:at + real] == list(range(real))
        at += length
    tail = slice(n - pads, n)
    assert mb.position_ids[tail] == list(range(pads))
    assert (mb.input_ids[tail], mb.loss_mask[tail], mb.temperatures[tail], mb.advantages[tail]) == \
        ([1] * pads, [False] * pads, [1.0] * pads, [0.0] * pads)
    assert all(mb.advantages[i] == 0.0 for i in range(n) if not mb.loss_mask[i])
    assert (mb.mm_kwargs, mb.mm_token_type_ids, mb.ce_weights) == (None, None, None)
    for name in ("ref_logprobs", "rl_weights", "ref_kl_weights"):  # distillation (primerl_wire.py): aligned
        values = getattr(mb, name)
        assert values is None or (len(values) == n and values[n - pads:] == [0.0] * pads), f"{name} misaligned"
    if mb.ref_kl_weights is not None:  # a component weight only where the loss mask is
        assert all(w == 0.0 for w, m in zip(mb.ref_kl_weights, mb.loss_mask, strict=True) if not m)
        assert mb.ref_logprobs is not None, "ref_kl_weights without ref_logprobs: prime-rl's ref_kl loss raises"
    if not any(mb.loss_mask):  # a dummy (or pads alone) trains nothing: no component weight streams
        assert (mb.rl_weights, mb.ref_kl_weights) == (None, None)
    if routed_dtype is None or only_pads:
        assert mb.routed_experts is None
        return
    routed = _routed(mb)
    assert routed.dtype == np.dtype(routed_dtype)
    assert routed.shape[0] == n
    assert not routed[n - pads:].any(), "pad rows of routed experts must be zero"


def _routed(mb: MicroBatch) -> np.ndarray:
    assert mb.routed_experts is not None
    r = mb.routed_experts
    arr = np.frombuffer(r.data, dtype=np.dtype(r.dtype))
    assert arr.size == int(np.prod(r.shape)), f"{len(r.data)} bytes for shape {r.shape} {r.dtype}"
    return arr.reshape(r.shape)


def _samples(mb: MicroBatch) -> list[Sample]:
    out = []
    at = 0
    pads = mb.env_names.count("")
    routed = _routed(mb) if mb.routed_experts is not None else None
    for length in mb.sequence_lengths:
        end = at + length - (pads if at + length == len(mb.input_ids) else 0)
        mask = mb.loss_mask[at:end]
        advantages = {a for a, m in zip(mb.advantages[at:end], mask, strict=True) if m}
        assert len(advantages) <= 1, f"a sample with several advantages {advantages}"
        temps, envs = set(mb.temperatures[at:end]), set(mb.env_names[at:end])
        assert len(temps) == 1, f"a sample with temperatures {temps}"
        assert len(envs) == 1, f"a sample with envs {envs}"
        streams = [None if v is None else v[at:end] for v in (mb.ref_logprobs, mb.ref_kl_weights, mb.rl_weights)]
        out.append(Sample(mb.input_ids[at:end], mask, advantages.pop() if advantages else None, temps.pop(),
                          envs.pop(), mb.inference_logprobs[at:end], None if routed is None else routed[at:end],
                          *streams))
        at += length
    return out


def read_admin_weight_dirs(log: Any) -> list[str]:
    """The ``weight_dir`` of every ``POST /update_weights`` a sim server's log (``SimServer.log``) recorded."""
    return [c.body["weight_dir"] for c in log.admin if c.path == "/update_weights" and isinstance(c.body, dict)]


__all__ = ["DECODER", "FakePrimeRLTrainer", "FileRank", "MicroBatch", "RoutedExperts", "Sample", "ZmqRank",
           "check_step", "free_port_pair", "publish", "read_admin_weight_dirs"]
