"""The gloo weight transfer, both halves: rendezvous, the packing plan, and a chunked broadcast from rank 0.

A group is the trainer (rank 0, which serves the rendezvous: a ``TCPStore`` on ``master_address:master_port``)
and every inference worker (ranks from 1: a server's worker is ``rank_offset + data_parallel_index * (TP*PP) +
its rank``, as vLLM's nccl backend counts them). Each process joins a ``ProcessGroupGloo`` of its own (not
torch.distributed's default group, which a vLLM worker already has), on the address its host routes to the
master by. ``timeout_s`` bounds the rendezvous and every later broadcast: a peer that died or never comes makes
the others raise ``TransferFailed`` after it (gloo says "Connection closed by peer" at once when the peer's
process is gone, "Timed out waiting ... for recv operation" when it is alive and silent: observed, torch 2.13).

What a server is told (vLLM's ``/init_weight_transfer_engine {"init_info": ...}`` and ``/update_weights
{"update_info": ...}``) is ``GlooInitInfo`` and ``GlooUpdateInfo``: the nccl backend's field names
(``vllm/distributed/weight_transfer/nccl_common.py``, ``nccl_engine.py``, vLLM 0.31/0.32) plus ``group`` (a name
for the group's keys in the store, new at every formation) and ``timeout_s``. The orchestrator builds these as
plain dicts (``orchestrator.inference.transfer``) and never imports torch.

The wire: the tensors named by the update info, in its order, are packed into chunks of at most
``packed_buffer_size_bytes`` (a larger tensor is a chunk of its own), each tensor at an offset aligned to ALIGN
bytes; each chunk is one broadcast of a flat uint8 buffer from rank 0. Both sides derive the same ``plan`` from
the update info; a first broadcast of the plan's fingerprint makes a receiver whose plan differs (another update
info, another buffer size) fail at once, naming both: gloo itself would fill a larger receive buffer with the
first smaller chunk and report success (observed: a worker planning one chunk where the trainer sent four loaded
the first and answered 200). Two buffers on each side: the next chunk is packed (sender) or posted (receiver) while the
current one travels or is loaded; the sender reuses its two buffers, each receive buffer is new.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore  # type: ignore[attr-defined]

ALIGN = 64  # every tensor starts at a multiple of this in its chunk: a view of any dtype is aligned
DEFAULT_BUFFER_BYTES = 256 << 20
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


class TransferFailed(RuntimeError):
    """A rendezvous or a broadcast did not complete (a peer died, or did not come within ``timeout_s``)."""


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``, as vLLM's ``dtype_names``); ValueError for another name."""
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: expected one of {', '.join(DTYPES)}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class GlooInitInfo:
    """A worker's part in a group (the ``init_info`` of ``/init_weight_transfer_engine``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group: str = "0"
    timeout_s: float = 60.0
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES

    def __post_init__(self) -> None:
        if not (0 < self.master_port < 65536 and 1 <= self.rank_offset < self.world_size and self.timeout_s > 0
                and self.packed_buffer_size_bytes >= ALIGN and self.master_address):
            raise ValueError(f"invalid gloo init_info {self}: need a master_address, 0 < master_port < 65536, "
                             f"1 <= rank_offset < world_size, timeout_s > 0, packed_buffer_size_bytes >= {ALIGN}")


@dataclass(frozen=True)
class GlooUpdateInfo:
    """The tensors of one update, in the order they travel (the ``update_info`` of ``/update_weights``)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")
        for name in self.dtype_names:
            dtype_of(name)
        if any(not isinstance(d, int) or d < 0 for shape in self.shapes for d in shape):
            raise ValueError("shapes must be lists of non-negative ints")


@dataclass(frozen=True)
class Slot:
    """One tensor's place in its chunk."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    slots: tuple[Slot, ...]
    nbytes: int


def fingerprint(chunks: Sequence[Chunk]) -> torch.Tensor:
    """What every rank must agree on before the chunks travel: their count, total size and a hash of the plan."""
    digest = hashlib.blake2b(repr([(s.name, s.dtype, s.shape, s.offset) for c in chunks for s in c.slots]).encode(),
                             digest_size=8).digest()
    return torch.tensor([len(chunks), sum(c.nbytes for c in chunks), int.from_bytes(digest, "little", signed=True)],
                        dtype=torch.int64)


def plan(info: GlooUpdateInfo, buffer_bytes: int) -> list[Chunk]:
    """The chunks ``info``'s tensors travel in (the same on every rank)."""
    chunks: list[Chunk] = []
    slots: list[Slot] = []
    end = 0
    for name, dname, shape in zip(info.names, info.dtype_names, info.shapes, strict=True):
        dtype = dtype_of(dname)
        nbytes = math.prod(shape) * dtype.itemsize
        offset = -(-end // ALIGN) * ALIGN
        if slots and offset + nbytes > buffer_bytes:
            chunks.append(Chunk(tuple(slots), end))
            slots, offset = [], 0
        slots.append(Slot(name, dtype, tuple(shape), offset, nbytes))
        end = offset + nbytes
    if slots:
        chunks.append(Chunk(tuple(slots), end))
    return chunks


def local_address(master_address: str) -> str:
    """The address of this host's interface that routes to ``master_address`` (what gloo's peers connect to)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(master_address, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # UDP: no packet is sent, the kernel only picks the route
            host: str = s.getsockname()[0]
            return host
    except OSError:
        return "127.0.0.1"


@dataclass
class GlooGroup:
    """This process's membership of one group: its store (the master's, on rank 0) and its process group."""

    rank: int
    world_size: int
    timeout_s: float
    store: TCPStore = field(repr=False)
    pg: Any = field(default=None, repr=False)  # a ProcessGroupGloo (its broadcast is typed on ProcessGroup's stub)

    @classmethod
    def listen(cls, master_address: str, master_port: int, world_size: int, timeout_s: float) -> GlooGroup:
        """Rank 0: serve the rendezvous on ``master_address:master_port`` (0: any free port; ``port`` says which);
        ``join`` then waits for the other ranks."""
        store = TCPStore(master_address, master_port, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        return cls(0, world_size, timeout_s, store)

    @classmethod
    def connect(cls, info: GlooInitInfo, rank: int) -> GlooGroup:
        """A worker (``rank`` >= 1): reach the master's store, then join the group (blocking until every rank has,
        at most ``timeout_s``)."""
        try:
            store = TCPStore(info.master_address, info.master_port, info.world_size, is_master=False,
                             timeout=datetime.timedelta(seconds=info.timeout_s))
        except Exception as e:  # DistStoreError, RuntimeError: torch's own
            raise TransferFailed(f"rank {rank} could not reach the rendezvous at {info.master_address}:"
                                 f"{info.master_port} within {info.timeout_s:g} s: {e}") from None
        group = cls(rank, info.world_size, info.timeout_s, store)
        group.join(info.group, info.master_address)
        return group

    @property
    def port(self) -> int:
        port: int = self.store.port
        return port

    def join(self, name: str, master_address: str) -> None:
        """Form group ``name`` (its keys in the store) with every other rank; TransferFailed after ``timeout_s``."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=local_address(master_address))]
        try:
            self.pg = ProcessGroupGloo(PrefixStore(f"orchestrator/{name}", self.store), self.rank, self.world_size,
                                       opts)
        except Exception as e:
            raise TransferFailed(f"rank {self.rank} of {self.world_size}: the group did not form within "
                                 f"{self.timeout_s:g} s ({e})") from None

    def _group(self) -> Any:
        if self.pg is None:
            raise TransferFailed("the group is not formed")
        return self.pg

    def send(self, tensors: Iterable[torch.Tensor], chunks: Sequence[Chunk], buffer_bytes: int) -> None:
        """Rank 0: broadcast ``tensors`` (in the plan's order, dtypes and shapes) chunk by chunk."""
        pg = self._group()
        self._wait(-1, pg.broadcast(fingerprint(chunks), 0), len(chunks))
        it = iter(tensors)
        buffers = _Buffers(buffer_bytes, chunks)
        pending: tuple[int, Any] | None = None
        for k, chunk in enumerate(chunks):
            buf = buffers.get(k, chunk.nbytes)
            for slot in chunk.slots:
                t = next(it).detach()
                if t.dtype != slot.dtype or tuple(t.shape) != slot.shape:
                    raise ValueError(f"{slot.name}: {t.dtype} {tuple(t.shape)} is not the {slot.dtype} {slot.shape} "
                                     "the receivers expect")
                flat = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
                buf[slot.offset:slot.offset + slot.nbytes].copy_(flat)
            if pending is not None:
                self._wait(*pending, len(chunks))
            pending = (k, pg.broadcast(buf[:chunk.nbytes], 0))
        if pending is not None:
            self._wait(*pending, len(chunks))

    def receive(self, chunks: Sequence[Chunk]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """A worker: each chunk's tensors, as views of a buffer of its own (never reused: vLLM's layerwise reload
        keeps the tensors of a layer until all of them have arrived, so a layer split across chunks would read a
        reused buffer's next contents). The next chunk is received while the caller loads this one."""
        pg = self._group()
        works: dict[int, tuple[Any, torch.Tensor]] = {}

        def post(k: int) -> None:
            buf = torch.empty(chunks[k].nbytes, dtype=torch.uint8)
            works[k] = pg.broadcast(buf, 0), buf

        mine, theirs = fingerprint(chunks), torch.zeros(3, dtype=torch.int64)
        self._wait(-1, pg.broadcast(theirs, 0), len(chunks))
        if not torch.equal(mine, theirs):
            n, total, _ = theirs.tolist()
            raise TransferFailed(f"rank {self.rank}: the trainer sends {n} chunk(s) of {total} bytes in all, this "
                                 f"worker expects {len(chunks)} of {sum(c.nbytes for c in chunks)} (or the same "
                                 "sizes and other tensors): the update info or the buffer size differs between them")
        if chunks:
            post(0)
        for k, chunk in enumerate(chunks):
            if k + 1 < len(chunks):
                post(k + 1)
            work, buf = works.pop(k)
            self._wait(k, work, len(chunks))
            yield [(s.name, buf[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)) for s in chunk.slots]

    def _wait(self, k: int, work: Any, n: int) -> None:
        try:
            work.wait()
        except Exception as e:  # gloo's RuntimeError
            what = "the plan" if k < 0 else f"chunk {k + 1}/{n}"
            raise TransferFailed(f"rank {self.rank}: the broadcast of {what} failed: {e}") from None

    def close(self) -> None:
        self.pg = None


class _Buffers:
    """The sender's two reusable pack buffers, taken alternately, as large as the largest chunk up to ``size`` bytes; a
    chunk larger than that (one tensor bigger than the buffer) gets one of its own."""

    def __init__(self, size: int, chunks: Sequence[Chunk]) -> None:
        self.size = min(size, max((c.nbytes for c in chunks), default=0))
        self.pair: list[torch.Tensor | None] = [None, None]

    def get(self, k: int, nbytes: int) -> torch.Tensor:
        if nbytes > self.size:
            return torch.empty(nbytes, dtype=torch.uint8)
        buf = self.pair[k % 2]
        if buf is None:
            buf = self.pair[k % 2] = torch.empty(self.size, dtype=torch.uint8)
        return buf
