"""``[transport]``: how batches reach the trainer (``kind``) and what each kind needs.

The TOML table is one for every kind, as users write it and ``orchestrator check`` prints it; ``problems``
refuses a field set for a kind that does not use it where that could mislead, and names the field a kind needs.
What a sender is built from is ``TransportConfig.chosen``: one type per kind (``ZmqTransport``,
``ShmTransport``, ``FilesystemTransport``, ``PrimeRLTransport``), each with only its own fields, those the
checks require already set (no ``None`` left to assert away).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from orchestrator.configbase import Source, address_problems, opt


@dataclass(frozen=True)
class ZmqTransport:
    """kind = "zmq": batches as ZMQ frames to trainers that connect to ``address`` and acknowledge each step."""

    address: str | None
    send_hwm: int
    keep_acked: int
    data_plane: Literal["through", "direct"]
    worker_pool_mb: int
    span_address: str | None


@dataclass(frozen=True)
class ShmTransport:
    """kind = "shm": as zmq on ipc://, the columns through a same-node shared-memory pool of ``shm_pool_mb``."""

    address: str | None
    send_hwm: int
    shm_pool_mb: int


@dataclass(frozen=True)
class FilesystemTransport:
    """kind = "filesystem": one file per batch in ``directory``; checkpoints announced by marker files."""

    directory: str
    send_hwm: int


@dataclass(frozen=True)
class PrimeRLTransport:
    """kind = "prime-rl": per-rank micro-batches to prime-rl's trainer, weights read from its ``trainer_dir``."""

    trainer_dir: str
    layout: Literal["zmq", "filesystem"]
    address: str | None
    send_hwm: int
    data_ranks: int
    seq_len: int
    pad_to_multiple_of: int


Transport = ZmqTransport | ShmTransport | FilesystemTransport | PrimeRLTransport


@dataclass(frozen=True)
class TransportConfig:
    kind: Literal["zmq", "shm", "filesystem", "prime-rl"] = opt(
        "zmq", doc="how batches reach the trainer; prime-rl: per-rank micro-batches to prime-rl's own trainer")
    address: str | None = opt(None, doc="ZMQ address to bind; unset means ipc:// in output_dir (kind = prime-rl: "
                              "tcp://HOST:PORT, READY on PORT + 1)")
    send_hwm: int = opt(2, ge=1, doc="steps sent and not yet acknowledged before sends wait (back-pressure); "
                        "kind = prime-rl: steps ahead of the trainer's newest weights + 1 (2 is prime-rl's rule)")
    checkpoint_source: Literal["zmq", "marker"] = opt("zmq", doc="how the trainer announces checkpoints")
    marker_dir: str | None = opt(None, doc="checkpoint marker files' directory (checkpoint_source = marker)")
    directory: str | None = opt(None, doc="batch directory (kind = filesystem)")
    shm_pool_mb: int = opt(4096, ge=1, doc="shared-memory pool size (kind = shm); a bigger step goes as frames")
    trainer_dir: str | None = opt(None, doc="kind = prime-rl: the trainer's output_dir; weights are read from its "
                                  "broadcasts/step_N/STABLE (prime_rl_layout = filesystem: batches go to rollouts/)")
    prime_rl_layout: Literal["zmq", "filesystem"] = opt(
        "zmq", doc="kind = prime-rl: its rollout_transport.type: zmq (PUB on address) or filesystem (files)")
    data_ranks: int = opt(1, ge=1, doc="kind = prime-rl: the trainer's data-parallel ranks (its num_train_workers)")
    seq_len: int = opt(2048, ge=1, doc="kind = prime-rl: micro-batch length; longer samples are truncated to it")
    pad_to_multiple_of: int = opt(1, ge=1, doc="kind = prime-rl: micro-batches are padded to a multiple of this "
                                  "(the trainer's context parallelism)")
    keep_acked: int = opt(0, ge=0, doc="kind = zmq: acknowledged steps kept in memory to resend to a trainer that "
                          "restarts behind them (it acknowledges before it checkpoints); 0: such a trainer is "
                          "refused, naming the steps it lacks")
    data_plane: Literal["through", "direct"] = opt(
        "through", doc="how rollout columns reach the trainer: through this process (as frames), or direct: "
        "written once into each env worker's column pool, the trainer reading them from there (docs/data-plane.md; "
        "needs kind = zmq and keep_acked = 0)")
    worker_pool_mb: int = opt(1024, ge=1, le=1 << 20, doc="data_plane = direct: each env worker's column pool; "
                              "holds its rollouts until they are dropped or their step is acknowledged")
    span_address: str | None = opt(None, doc="data_plane = direct: tcp://HOST:0, where the local env workers serve "
                                   "their column pools to trainers on other hosts (a port each; CURVE with "
                                   "[security] keys, which a non-loopback HOST needs); unset: trainers on this "
                                   "host map the pools, and no other host can read them")

    @property
    def chosen(self) -> Transport:
        """The kind's own settings, for its sender (call only on a config that loaded: the checks ran)."""
        if self.kind == "prime-rl":
            assert self.trainer_dir is not None  # problems(): required with this kind
            return PrimeRLTransport(self.trainer_dir, self.prime_rl_layout, self.address, self.send_hwm,
                                    self.data_ranks, self.seq_len, self.pad_to_multiple_of)
        if self.kind == "filesystem":
            assert self.directory is not None  # problems(): required with this kind
            return FilesystemTransport(self.directory, self.send_hwm)
        if self.kind == "shm":
            return ShmTransport(self.address, self.send_hwm, self.shm_pool_mb)
        return ZmqTransport(self.address, self.send_hwm, self.keep_acked, self.data_plane, self.worker_pool_mb,
                            self.span_address)

    @property
    def binds_batches(self) -> bool:
        """Whether batches go out on a ZMQ socket we bind at ``address`` that a trainer connects to (authenticated
        with CURVE keys); filesystem writes files, prime-rl binds a publisher with no authentication."""
        return self.kind in ("zmq", "shm")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        yield from address_problems(f"{key}.address", self.address, source)
        yield from self._checkpoint_problems(key, source)
        yield from self._prime_rl_problems(key, source)
        yield from self._zmq_problems(key, source)
        if self.kind == "shm" and self.address is not None and not self.address.startswith("ipc://"):
            yield (f"{source(f'{key}.address')}: {key}.address: kind = 'shm' is same-node only and needs an "
                   f"ipc://PATH address (or none: ipc:// in output_dir), got {self.address!r}; use kind = 'zmq' "
                   "for tcp")

    def _checkpoint_problems(self, key: str, source: Source) -> Iterable[str]:
        if self.checkpoint_source == "marker" and self.marker_dir is None:
            yield (f"{source(f'{key}.marker_dir')}: {key}.marker_dir: required when "
                   "checkpoint_source = 'marker'")
        if self.kind == "filesystem" and self.directory is None:
            yield f"{source(f'{key}.directory')}: {key}.directory: required when kind = 'filesystem'"
        if self.kind == "filesystem" and self.checkpoint_source != "marker":
            yield (f"{source(f'{key}.checkpoint_source')}: {key}.checkpoint_source: must be 'marker' when "
                   "kind = 'filesystem' (there is no message channel back from the trainer)")

    def _prime_rl_problems(self, key: str, source: Source) -> Iterable[str]:
        """kind = 'prime-rl': where the trainer is, and nothing set that it would not use."""
        if self.kind != "prime-rl":
            if self.trainer_dir is not None:
                yield (f"{source(f'{key}.trainer_dir')}: {key}.trainer_dir: applies only to kind = 'prime-rl' "
                       f"(kind = {self.kind!r}); remove it")
            return
        if self.trainer_dir is None:
            yield (f"{source(f'{key}.trainer_dir')}: {key}.trainer_dir: required when kind = 'prime-rl' (the "
                   "trainer's output_dir, where it writes broadcasts/step_N)")
        address = self.address or ""
        if self.prime_rl_layout == "zmq":
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            if not address.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65535:
                yield (f"{source(f'{key}.address')}: {key}.address: kind = 'prime-rl' binds prime-rl's publisher "
                       f"at tcp://HOST:PORT (READY at PORT + 1), e.g. 'tcp://0.0.0.0:5555', got {self.address!r}")
        elif self.address is not None:
            yield (f"{source(f'{key}.address')}: {key}.address: unused with prime_rl_layout = 'filesystem' (the "
                   f"batches go to {key}.trainer_dir/rollouts); remove it")
        for name, value in (("marker_dir", self.marker_dir), ("directory", self.directory)):
            if value is not None:
                yield (f"{source(f'{key}.{name}')}: {key}.{name}: unused with kind = 'prime-rl' (its weights come "
                       f"from {key}.trainer_dir/broadcasts); remove it")
        if self.checkpoint_source == "marker":
            yield (f"{source(f'{key}.checkpoint_source')}: {key}.checkpoint_source: kind = 'prime-rl' reads "
                   f"checkpoints from {key}.trainer_dir/broadcasts/step_N/STABLE; remove it")

    def _zmq_problems(self, key: str, source: Source) -> Iterable[str]:
        """What only kind = 'zmq' supports: resending acknowledged steps, and the direct data plane."""
        if self.keep_acked and self.kind != "zmq":
            yield (f"{source(f'{key}.keep_acked')}: {key}.keep_acked: applies only to kind = 'zmq' (kind = "
                   f"{self.kind!r}: shm reuses an acknowledged step's memory; files and prime-rl's trainer report "
                   "no steps to resend); remove it")
        if self.data_plane == "direct" and (self.kind != "zmq" or self.keep_acked):
            yield (f"{source(f'{key}.data_plane')}: {key}.data_plane: 'direct' needs kind = 'zmq' and keep_acked "
                   f"= 0 (got kind {self.kind!r}, keep_acked {self.keep_acked}): the trainer maps the workers' "
                   "pools and acknowledges each step over zmq, and an acknowledged step's columns are reused at once")
        host = re.fullmatch(r"tcp://([^\s:]+):0", self.span_address or "")
        if self.span_address is not None and (self.data_plane != "direct" or host is None
                                              or host[1] in ("*", "0.0.0.0")):
            yield (f"{source(f'{key}.span_address')}: {key}.span_address: expected tcp://HOST:0 with the host's "
                   f"address or name, which workers announce to trainers (not a wildcard; each local env worker "
                   f"binds a port of its own) and data_plane = 'direct', got {self.span_address!r} with "
                   f"data_plane = {self.data_plane!r}")
