"""The delivery window every sender keeps: order, bound, acknowledgement, skip on resume, resend. No I/O.

A ``DeliveryWindow`` is the bookkeeping of one orchestrator-to-trainer link, without sockets, files, clocks or
an event loop, so it is tested on its own and every sender (``zmq_link``, ``filesystem``, ``primerl``) drives
the same one (see ``sender.Sender``):

- **Order.** Steps go out once each, in increasing order: ``expect(step)`` raises DuplicateStep for anything
  but the next step (the first step sent fixes where the sequence starts).
- **Bound.** At most ``bound`` steps are sent and not yet acknowledged; ``full`` says that the sender must
  wait before sending another. Nothing is dropped at the bound: the sender waits.
- **Acknowledgement.** ``acknowledge(have)``: the trainer holds every step <= ``have`` (acknowledgements are
  cumulative and never go back); those steps leave ``unacked`` and are returned, oldest first.
- **Skip on resume.** A step the trainer already holds (``holds``: <= the highest step it acknowledged, e.g.
  reported by a trainer that outlived an orchestrator crash) is not sent again: ``skip(step)``. A step an
  earlier run delivered durably and the trainer has not acknowledged yet (a file still on disk) is
  ``adopt``-ed: counted as sent, not sent again.
- **Resend.** Until acknowledged, ``unacked`` keeps each step's payload (what the sender needs to send it
  again: frames, encoded messages; None for durable deliveries), in order: what a restarted trainer gets
  again once its report (``acknowledge``) has removed what it holds.
- **Replace.** ``replace(step, payload)``: an unacknowledged step's payload changes (direct mode: the trainer
  reported the step lost and it was rebuilt); the sender sends it, and the steps after it, again.
- **A trainer behind.** A trainer that comes back holding less than it acknowledged (it acknowledged steps
  before it could keep them: its checkpoint is older) lacks steps the window no longer has. ``keep``
  acknowledged steps stay in ``kept`` for that case; ``rejoin(have)`` puts the ones it lacks back into
  ``unacked`` (sent again, in order), or names the steps that are gone. ``acked_before`` is what an earlier
  run of the orchestrator saw acknowledged (its saved state): a trainer reporting less after a restart of
  both is behind too, and nothing of that earlier run is kept.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from orchestrator.errors import DuplicateStep

P = TypeVar("P")


class DeliveryWindow(Generic[P]):
    """See the module docstring. ``bound`` >= 1: steps sent and not acknowledged before ``full``."""

    def __init__(self, bound: int, *, keep: int = 0, acked_before: int = -1) -> None:
        if bound < 1:
            raise ValueError(f"a delivery window holds at least one step, got bound = {bound}")
        if keep < 0:
            raise ValueError(f"keep counts acknowledged steps kept, got {keep}")
        self.bound, self.keep, self.acked_before = bound, keep, acked_before
        self.next_step: int | None = None  # None: nothing sent yet, any step may come first
        self.peer_has: int | None = None  # the highest step the trainer holds, as far as we know
        self.unacked: dict[int, P | None] = {}  # step -> payload to resend, in send order
        self.kept: dict[int, P | None] = {}  # the last ``keep`` acknowledged steps, for a trainer that falls behind
        self.skipped: list[int] = []  # steps not sent because the trainer had them (or an earlier run sent them)

    @property
    def acked(self) -> int:
        """The highest step acknowledged (-1 for none)."""
        return -1 if self.peer_has is None else self.peer_has

    @property
    def full(self) -> bool:
        """Whether ``bound`` steps are sent and unacknowledged: the next send must wait."""
        return len(self.unacked) >= self.bound

    def expect(self, step: int) -> None:
        """DuplicateStep unless ``step`` is the next step to go out."""
        if self.next_step is not None and step != self.next_step:
            raise DuplicateStep(f"refusing to send step {step}: the next step is {self.next_step}")

    def holds(self, step: int) -> bool:
        """Whether the trainer already holds ``step`` (so it must not get it again)."""
        return self.peer_has is not None and step <= self.peer_has

    def record(self, step: int, payload: P | None) -> None:
        """``step`` went out; ``payload`` is kept until it is acknowledged."""
        self.expect(step)
        self.unacked[step] = payload
        self.next_step = step + 1

    def skip(self, step: int) -> None:
        """``step`` is not sent: the trainer holds it."""
        self.expect(step)
        self.skipped.append(step)
        self.next_step = step + 1

    def adopt(self, step: int) -> None:
        """``step`` is not sent: an earlier run delivered it durably; it counts as sent, unacknowledged."""
        self.expect(step)
        self.skipped.append(step)
        self.unacked[step] = None
        self.next_step = step + 1

    def replace(self, step: int, payload: P | None) -> None:
        """``step``, sent and not acknowledged, is to go out again as ``payload`` (a rebuilt step manifest: the
        trainer could not read the first one); KeyError if it is not unacknowledged."""
        if step not in self.unacked:
            raise KeyError(f"step {step} is not sent and unacknowledged: nothing to replace")
        self.unacked[step] = payload

    def acknowledge(self, have: int) -> list[int]:
        """The trainer holds every step <= ``have``: the steps that leaves acknowledged now, oldest first.
        An acknowledgement below an earlier one changes nothing."""
        self.peer_has = have if self.peer_has is None else max(have, self.peer_has)
        done = [s for s in self.unacked if s <= have]
        for s in done:
            payload = self.unacked.pop(s)
            if self.keep:
                self.kept[s] = payload
        for s in sorted(self.kept)[:max(len(self.kept) - self.keep, 0)]:
            del self.kept[s]
        return done

    def rejoin(self, have: int) -> list[int]:
        """A trainer (re)joins holding every step <= ``have``: the steps it lacks that are gone (not kept), or
        [] when it can go on. A trainer behind what was acknowledged gets the kept steps it lacks back in
        ``unacked``, ahead of the rest, and ``acked`` drops to ``have``; for one at or past it nothing
        changes (its ``have`` is an acknowledgement: call ``acknowledge``). When steps are gone nothing
        changes either: that trainer cannot be fed."""
        floor = max(self.acked, self.acked_before)
        if have >= floor:
            return []
        gone = [s for s in range(have + 1, floor + 1) if s not in self.kept]  # an earlier run's: never kept
        if gone:
            return gone
        back = {s: self.kept.pop(s) for s in sorted(self.kept) if s > have}
        self.unacked = {**back, **self.unacked}
        self.peer_has = have
        return []
