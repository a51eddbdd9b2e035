"""The trainer seat on its own: one trainer per link, a second one refused, a restarted one admitted."""

from __future__ import annotations

from orchestrator.delivery.seat import TrainerSeat, Verdict


def connected() -> bool:
    return True


def gone() -> bool:
    return False


def test_the_first_trainer_takes_the_seat_and_a_second_is_refused_after_the_grace() -> None:
    seat = TrainerSeat(grace_s=2.0)
    assert seat.hear(b"a", "host:1", 0.0, connected) is Verdict.ADMITTED
    assert seat.hear(b"a", "host:1", 0.5, connected) is Verdict.HOLDER
    assert seat.hear(b"b", "host:2", 1.0, connected) is Verdict.WAIT  # maybe a's connection is about to go
    assert seat.hear(b"b", "host:2", 2.9, connected) is Verdict.WAIT
    assert seat.hear(b"b", "host:2", 3.0, connected) is Verdict.REFUSED  # a is still there 2 s later
    assert "trainer host:1 already receives this link's batches" in seat.refused[b"b"]
    assert seat.hear(b"b", "host:2", 9.0, gone) is Verdict.IGNORED  # refused for good
    assert seat.holder is not None
    assert seat.holder.id == b"a"


def test_a_trainer_heard_once_the_holder_is_gone_takes_the_seat() -> None:
    seat = TrainerSeat(grace_s=2.0)
    seat.hear(b"a", "host:1", 0.0, connected)
    assert seat.hear(b"b", "host:2", 5.0, connected) is Verdict.WAIT
    assert seat.hear(b"b", "host:2", 6.0, gone) is Verdict.ADMITTED  # a's connection closed meanwhile
    assert seat.holder is not None
    assert (seat.holder.id, seat.holder.name, seat.holder.since) == (b"b", "host:2", 6.0)
    asked: list[int] = []

    def ask() -> bool:
        asked.append(1)
        return True

    assert seat.hear(b"b", "host:2", 7.0, ask) is Verdict.HOLDER
    assert asked == []  # the holder's own messages never probe


def test_a_refused_holder_frees_the_seat() -> None:
    seat = TrainerSeat(grace_s=2.0)
    seat.hear(b"a", "host:1", 0.0, connected)
    seat.refuse(b"a", "it lacks steps 3..4")
    assert seat.holder is None
    assert seat.hear(b"a", "host:1", 1.0, connected) is Verdict.IGNORED
    assert seat.hear(b"c", "host:3", 1.0, connected) is Verdict.ADMITTED
