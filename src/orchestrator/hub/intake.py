"""Sorting one ``records`` message of a worker: which records pass on to the scheduler, which are late, which
are invalid. Pure (no socket, no clock): the hub (dispatch.py) acts on the outcome: strikes, releases, events.

A record passes only for a rollout in flight on the worker that sent it (``rids``: rollout id -> group) and of
the group the message names; a record of a rollout the worker had in flight once but no longer (``late``:
cancelled, or the worker was lost meanwhile) is late. A record that fails its own checks
(``RolloutRecord.check``) or whose span is not in the worker's announced pool (``check_span``) passes as a
failed ``corrupt_record`` rollout, so its group still completes. Every record not passed on as it came, and
holding a span, is in ``unused``: nobody will read its columns.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from orchestrator.contracts.protocol import PoolInfo, RolloutHeader, RolloutRecord, check_span
from orchestrator.errors import Failure, WireError


@dataclass
class Intake:
    accepted: list[RolloutRecord] = field(default_factory=list)  # in flight on the worker: to the scheduler
    unused: list[RolloutHeader] = field(default_factory=list)  # not passed on as sent: their spans are free
    late: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)  # (why, detail) per invalid record


def sort_records(rids: dict[str, str], late: Container[str], group: str, records: list[RolloutRecord],
                 pool: PoolInfo | None) -> Intake:
    """The outcome of ``records`` (one message, for ``group``); accepted rollouts leave ``rids``."""
    out = Intake()
    for record in records:
        h = record.header
        assigned = rids.get(h.rid)
        if assigned is None:
            if h.rid in late:
                out.late += 1
                out.unused.append(h)
            else:
                out.problems.append(("unassigned", f"a record for rollout {h.rid!r}, which is not in flight on it"))
            continue
        if h.group != group or assigned != group:
            out.problems.append(("wrong_group", f"rollout {h.rid} of group {assigned} sent as group {group}"))
            continue
        try:
            record.check()
            check_span(h, pool)
        except WireError as e:
            out.problems.append(("corrupt_record", str(e)))
            out.unused.append(h)
            record = RolloutRecord(RolloutHeader.failed(h, Failure.CORRUPT, str(e), wall_s=h.wall_s), [])
        del rids[h.rid]
        out.accepted.append(record)
    return out
