"""Opening the batch sender ``[transport] kind`` names: ZMQ (and shm), files in a shared directory, prime-rl."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from orchestrator.delivery.config import FilesystemTransport, PrimeRLTransport, ShmTransport, ZmqTransport
from orchestrator.delivery.filesystem import FileBatchSender
from orchestrator.delivery.primerl import PrimeRLSender
from orchestrator.delivery.sender import Sender
from orchestrator.delivery.zmq_link import BatchSender

if TYPE_CHECKING:
    from orchestrator.config import JobConfig

log = logging.getLogger(__name__)


def open_sender(cfg: JobConfig, address: str, resume: bool, acked_before: int = -1
                ) -> contextlib.AbstractAsyncContextManager[Sender[Any]]:
    """The batch sender ``[transport] kind`` names: ZMQ (default; shm: columns through shared memory), files in
    a shared directory, or prime-rl's own trainer. A ZMQ sender on tcp:// with ``[security]`` keys accepts only
    the authorized trainers; prime-rl's link cannot authenticate (config.py refuses a non-loopback address
    unless ``security.allow_unauthenticated_trainer``). ``acked_before``: the step the state says the trainer
    acknowledged (a resumed run; a ZMQ trainer reporting less is behind). Every wait warns every
    ``monitor.stall_warn_s``."""
    t = cfg.transport.chosen
    warn_s = cfg.monitor.stall_warn_s
    if isinstance(t, PrimeRLTransport):
        if cfg.security.allow_unauthenticated_trainer and t.layout == "zmq":
            log.warning("batches go to the prime-rl trainer at %s unauthenticated and unencrypted "
                        "(security.allow_unauthenticated_trainer)", t.address)
        return PrimeRLSender.open(
            t.trainer_dir, data_ranks=t.data_ranks, seq_len=t.seq_len, pad_to_multiple_of=t.pad_to_multiple_of,
            layout=t.layout, address=t.address, window=t.send_hwm, resume=resume,
            temperature={e.label: e.sampling.temperature for e in cfg.env}, warn_s=warn_s)
    if isinstance(t, FilesystemTransport):
        return FileBatchSender.open(t.directory, t.send_hwm, resume=resume, warn_s=warn_s)
    shm_bytes = t.shm_pool_mb << 20 if isinstance(t, ShmTransport) else None  # columns through a same-node pool
    return BatchSender.open(address, t.send_hwm, warn_s, require_report=resume, shm_bytes=shm_bytes,
                            server_keys=cfg.security.server_keys(address),  # tcp:// with keys: CURVE
                            keep=t.keep_acked if isinstance(t, ZmqTransport) else 0,
                            acked_before=acked_before if resume else -1)
