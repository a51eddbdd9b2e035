"""The delivery window on its own: order, bound, acknowledgement, skip on resume, what a resend needs."""

from __future__ import annotations

import pytest

from orchestrator.errors import DuplicateStep
from orchestrator.transport import DeliveryWindow


def test_steps_go_out_once_in_order_from_wherever_they_start() -> None:
    w: DeliveryWindow[str] = DeliveryWindow(4)
    w.record(5, "five")
    w.record(6, "six")
    with pytest.raises(DuplicateStep, match="refusing to send step 6: the next step is 7"):
        w.expect(6)
    with pytest.raises(DuplicateStep, match="the next step is 7"):
        w.record(8, "eight")
    assert list(w.unacked.items()) == [(5, "five"), (6, "six")]


def test_full_at_the_bound_until_an_acknowledgement() -> None:
    w: DeliveryWindow[int] = DeliveryWindow(2)
    w.record(0, 0)
    assert not w.full
    w.record(1, 1)
    assert w.full
    assert w.acknowledge(0) == [0]
    assert not w.full
    assert (w.acked, list(w.unacked)) == (0, [1])


def test_acknowledgements_are_cumulative_and_never_go_back() -> None:
    w: DeliveryWindow[int] = DeliveryWindow(8)
    for step in range(4):
        w.record(step, step)
    assert w.acknowledge(2) == [0, 1, 2]
    assert w.acknowledge(1) == []
    assert w.acked == 2
    assert list(w.unacked.items()) == [(3, 3)]  # what a restarted trainer holding <= 2 gets again


def test_resume_skips_what_the_trainer_holds_and_adopts_durable_deliveries() -> None:
    w: DeliveryWindow[bytes] = DeliveryWindow(2)
    assert w.acked == -1
    assert not w.holds(0)
    w.acknowledge(4)  # a trainer that outlived the orchestrator reports step 4
    assert w.holds(3)
    assert w.holds(4)
    assert not w.holds(5)
    w.skip(3)
    w.skip(4)
    w.adopt(5)  # e.g. its file is still on disk: sent, not yet acknowledged
    w.record(6, b"six")
    assert w.skipped == [3, 4, 5]
    assert list(w.unacked) == [5, 6]
    assert w.full
    with pytest.raises(ValueError, match="at least one step"):
        DeliveryWindow(0)


def test_a_trainer_behind_gets_the_kept_steps_it_lacks_again() -> None:
    w: DeliveryWindow[str] = DeliveryWindow(2, keep=3)
    for step in range(6):
        w.record(step, f"s{step}")
        w.acknowledge(step - 1)  # the trainer acknowledges each step as the next goes out
    assert (w.acked, list(w.unacked), list(w.kept)) == (4, [5], [2, 3, 4])  # only the last 3 kept
    assert w.rejoin(2) == []  # restarted holding step 2: it lacks 3 and 4, both kept
    assert list(w.unacked.items()) == [(3, "s3"), (4, "s4"), (5, "s5")]  # in order, ahead of the rest
    assert w.acked == 2
    assert w.acknowledge(4) == [3, 4]


def test_a_trainer_behind_steps_that_are_gone_is_told_which() -> None:
    w: DeliveryWindow[str] = DeliveryWindow(2, keep=1)
    for step in range(5):
        w.record(step, f"s{step}")
    w.acknowledge(3)
    assert list(w.kept) == [3]
    assert w.rejoin(0) == [1, 2]  # 3 is kept, 1 and 2 are not
    assert (w.acked, list(w.unacked)) == (3, [4])  # nothing changed: that trainer cannot be fed
    assert w.rejoin(3) == []  # one restarted from a later checkpoint can
    assert w.rejoin(5) == []  # at or past what was acknowledged: it can go on
    assert w.acked == 3  # its report acknowledges, as any other


def test_an_earlier_runs_acknowledgements_count_and_are_never_kept() -> None:
    w: DeliveryWindow[str] = DeliveryWindow(2, keep=8, acked_before=4)  # the state said: step 4 acknowledged
    assert w.rejoin(2) == [3, 4]  # a trainer restarted from an older checkpoint: those steps died with that run
    assert w.peer_has is None
    assert w.rejoin(4) == []
    with pytest.raises(ValueError, match="keep"):
        DeliveryWindow(1, keep=-1)
