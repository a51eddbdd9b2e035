"""Which trainer a ZMQ link feeds: one at a time, told apart by the id each receiver sends. No I/O.

Every receiver names itself in each message it sends (``id``: random, new for every receiver object, also its
routing id on the batch socket; ``name``: host and pid, for log lines). A link feeds one trainer, the holder
of its seat; batches go to the holder only, and only the holder's acknowledgements count:

- The first trainer heard from takes the free seat (after an orchestrator restart: the first to report).
- A trainer heard from while another holds the seat is a contender. If the holder is no longer connected
  (``holder_connected()``, the sender's probe), the contender takes the seat: a restarted trainer. If the
  holder is still connected ``grace_s`` after the contender was first heard from, the contender is refused:
  two trainers on one address would split the stream between them. The grace covers a trainer restarted
  within moments, whose predecessor's connection the sender has not seen close yet.
- ``refuse(id, why)`` refuses a trainer for another reason (it lacks steps that are gone); a refused holder
  frees the seat. A refused trainer stays refused: its messages are ignored.

The sender tells each refused trainer why (it raises ``TrainerRefused``) and logs it once.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Verdict(enum.Enum):
    HOLDER = "holder"  # from the trainer that holds the seat: use it
    ADMITTED = "admitted"  # it takes the seat now: resend what it lacks
    WAIT = "wait"  # a contender within its grace: ignore the message for now
    REFUSED = "refused"  # a contender refused now: tell it why (``seat.refused[id]``)
    IGNORED = "ignored"  # refused before: ignore


@dataclass(frozen=True)
class Peer:
    id: bytes
    name: str
    since: float  # when it took the seat (the caller's clock)


class TrainerSeat:
    """See the module docstring. ``grace_s``: how long a contender waits for the holder's connection to go."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.holder: Peer | None = None
        self.refused: dict[bytes, str] = {}  # id -> why, for every trainer refused
        self._contenders: dict[bytes, float] = {}  # id -> when first heard from

    def hear(self, peer: bytes, name: str, now: float, holder_connected: Callable[[], bool]) -> Verdict:
        """A message from trainer ``peer``: what to do with it (see ``Verdict``). ``holder_connected`` is
        asked only when another trainer holds the seat."""
        if peer in self.refused:
            return Verdict.IGNORED
        if self.holder is not None and self.holder.id == peer:
            return Verdict.HOLDER
        if self.holder is None or not holder_connected():
            self.holder = Peer(peer, name, now)
            self._contenders.pop(peer, None)
            return Verdict.ADMITTED
        first = self._contenders.setdefault(peer, now)
        if now - first < self.grace_s:
            return Verdict.WAIT
        del self._contenders[peer]
        self.refused[peer] = (f"trainer {self.holder.name} already receives this link's batches; two trainers on "
                              "one address would split the steps between them")
        return Verdict.REFUSED

    def refuse(self, peer: bytes, why: str) -> None:
        """Refuse ``peer`` for ``why`` from now on; if it holds the seat, the seat is free."""
        self.refused[peer] = why
        self._contenders.pop(peer, None)
        if self.holder is not None and self.holder.id == peer:
            self.holder = None
