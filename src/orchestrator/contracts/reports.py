"""What a trainer sends back to the orchestrator, as one typed message decoded once at the edge.

A receiver (``receiver.py``) reports on the trainer channel (zmq_link.py) as a msgpack map: ``{"have": N, "id":
ID, "name": NAME}`` (it holds every step <= N; -1 for none), with ``"hello": true`` when it starts,
``"checkpoint": K, "path": P`` for the newest weights it announced or resumed from, and ``"lost": N, "attempt":
A, "pools": [...]`` for a step whose column pools it could not map (the direct data plane). A sender of
checkpoints alone may leave out ``id`` and ``have``. ``decode_report`` checks every field's type and bound
(msgspec) and raises ``WireError`` naming what is wrong; unknown keys are ignored, so a newer trainer's extra
fields do not break an older orchestrator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.contracts.transfer import TransferEvent
from orchestrator.errors import WireError

MAX_LOST_POOLS = 4096  # a lost step names at most one pool per env worker: far more is not a receiver's report
MAX_NAME = 200  # a trainer's name goes into log lines: longer ones are cut, not refused


@dataclass(frozen=True)
class LostStep:
    """A trainer could not map some pools of ``step`` as sent in ``attempt`` (direct mode): their ids."""

    step: int
    attempt: int
    pools: tuple[str, ...]


class TrainerReport(msgspec.Struct, frozen=True, kw_only=True):
    """One message from a trainer (see the module docstring for each field)."""

    have: int | None = None
    checkpoint: int | None = None
    path: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    name: str | None = None
    hello: bool = False
    lost: int | None = None
    attempt: int = 0
    pools: Annotated[list[str], msgspec.Meta(max_length=MAX_LOST_POOLS)] | None = None
    broadcast: Annotated[list[str], msgspec.Meta(max_length=16)] | None = None
    transfer: TransferEvent | None = None

    def __post_init__(self) -> None:
        # msgspec turns a ValueError here into its ValidationError, so decode_report names these too
        if self.have is None and self.checkpoint is None:
            raise ValueError("neither 'have' nor 'checkpoint'")
        if self.id is not None and not self.id.isascii():
            raise ValueError(f"id must be a short ASCII string, got {self.id!r}")
        if self.lost is not None and self.pools is None:
            raise ValueError("a lost step must name its pools")

    @property
    def peer(self) -> bytes | None:
        """Its routing id (None: a sender that does not name itself, e.g. an announcer of checkpoints)."""
        return None if self.id is None else self.id.encode()

    @property
    def who(self) -> str:
        """How log lines name it: its name, else its id."""
        return str(self.id if self.name is None else self.name)[:MAX_NAME]

    @property
    def announced(self) -> Checkpoint | None:
        return None if self.checkpoint is None else Checkpoint(self.checkpoint, self.path)

    @property
    def lost_step(self) -> LostStep | None:
        if self.lost is None or self.pools is None:
            return None
        return LostStep(self.lost, self.attempt, tuple(self.pools))


_decoder = msgspec.msgpack.Decoder(TrainerReport)


def decode_report(raw: bytes) -> TrainerReport:
    """A trainer's message, validated; WireError naming what is wrong otherwise."""
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # ValidationError included; msgspec 0.22 raises
        raise WireError(f"invalid trainer report: {e}") from None  # UnicodeDecodeError for a string not in UTF-8
