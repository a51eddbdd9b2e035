"""The trainer's side of weights over the wire: it answers the orchestrator's transfer requests by sending its own
weights to the inference servers (``contracts/transfer.py`` says the messages, docs/inference-servers.md the
whole).

A trainer that can do this gives its receiver a ``WeightBroadcaster`` (``GlooBroadcaster`` in
``trainer/gloo_broadcast.py``: torch.distributed's gloo, for CPUs); the receiver then says so in every status
message and serves each request when it reads it (inside ``recv``, or ``serve_transfers`` right after announcing
new weights: ``BatchReceiver``): a join, by serving the rendezvous and waiting for the servers' workers; a send,
by broadcasting the weights it holds if they are those of the step asked for (the checkpoint it announced last),
else by answering ``stale``. The blocking parts (the rendezvous, the broadcast) run in a worker thread of the
asyncio receiver. Importable without torch.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from orchestrator.contracts.transfer import (
    JoinGroup,
    Params,
    SendWeights,
    TransferEvent,
    TransferRequest,
    decode_request,
    event_message,
)
from orchestrator.errors import WireError

log = logging.getLogger(__name__)


class WeightBroadcaster(Protocol):
    """What sends a trainer's weights (the blocking calls run off the asyncio receiver's loop)."""

    backends: tuple[str, ...]  # what it can send with: "gloo"

    def listen(self, request: JoinGroup) -> int:
        """Serve the rendezvous of ``request.group`` (leaving any group joined before); its port. Quick."""
        ...

    def join(self, request: JoinGroup) -> Params:
        """Wait until every other rank has joined (at most ``request.timeout_s``); the tensors it can send."""
        ...

    def send(self, request: SendWeights) -> None:
        """Broadcast ``request.params`` from the weights it holds now (each chunk within the group's timeout)."""
        ...

    def close(self) -> None:
        """Leave the group (if any)."""
        ...


Work = Callable[[], dict[str, Any]]  # a blocking part of a request, returning the event that ends it


class TransferServer:
    """The requests a receiver has read and not served yet, and what serving each one does (both receivers)."""

    def __init__(self, broadcaster: WeightBroadcaster) -> None:
        self.broadcaster = broadcaster
        self.pending: deque[TransferRequest] = deque()
        self.group: str | None = None  # the group joined last
        self.answered: int | None = None  # the last step a send request was answered for (sent, failed or stale)

    def take(self, msg: dict[str, Any]) -> None:
        """A control message ``{"ctl": "transfer", ...}``: queue its request (one the receiver cannot read is
        logged and dropped: the orchestrator's wait for the answer times out and says so)."""
        try:
            self.pending.append(decode_request(msg))
        except WireError as e:
            log.warning("%s", e)

    def begin(self, request: TransferRequest, holds: int | None) -> tuple[dict[str, Any], Work | None]:
        """The event to report now, and the blocking part whose event follows it (None: nothing follows).
        ``holds``: the checkpoint the trainer announced last (whose weights it holds)."""
        if isinstance(request, JoinGroup):
            try:
                port = self.broadcaster.listen(request)
            except Exception as e:  # torch's own: a port in use, an address not of this host
                log.error("could not serve the rendezvous of weight transfer group %s on %s:%d: %s", request.group,
                          request.master_address, request.master_port, e)
                return self._event("failed", request.group, why=f"rendezvous: {e}"), None
            log.info("weight transfer: serving the rendezvous of group %s (%d ranks) on %s:%d", request.group,
                     request.world_size, request.master_address, port)
            return self._event("listening", request.group, port=port), lambda: self._join(request)
        if holds != request.step:
            self.answered = request.step
            log.info("weight transfer: asked for the weights of step %d, this trainer holds those of %s", request.step,
                     holds)
            return self._event("stale", request.group, step=request.step, holds=holds), None
        return self._event("ready", request.group, step=request.step), lambda: self._send(request)

    def _join(self, request: JoinGroup) -> dict[str, Any]:
        try:
            params = self.broadcaster.join(request)
        except Exception as e:  # TransferFailed, or torch's own
            log.error("weight transfer group %s did not form: %s", request.group, e)
            return self._event("failed", request.group, why=str(e))
        self.group = request.group
        log.info("weight transfer: group %s formed (%d ranks): %d tensors, %.1f MB", request.group,
                 request.world_size, len(params.names), params.nbytes / 2**20)
        return self._event("joined", request.group, params=params)

    def _send(self, request: SendWeights) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            self.broadcaster.send(request)
        except Exception as e:
            log.error("weight transfer of step %d failed: %s", request.step, e)
            return self._event("failed", request.group, step=request.step, why=str(e))
        finally:
            self.answered = request.step
        seconds = time.monotonic() - t0
        log.info("weight transfer: sent the weights of step %d (%.1f MB) in %.2f s", request.step,
                 request.params.nbytes / 2**20, seconds)
        return self._event("sent", request.group, step=request.step, seconds=round(seconds, 4))

    @staticmethod
    def _event(event: str, group: str, **fields: Any) -> dict[str, Any]:
        return event_message(TransferEvent(event=event, group=group, **fields))  # type: ignore[arg-type]

    def waiting_for(self, step: int) -> bool:
        """Whether ``serve_transfers(step)`` should wait: in a group, and the send of ``step`` not answered yet."""
        return self.group is not None and (self.answered is None or self.answered < step)
