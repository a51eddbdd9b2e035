"""A rollout's row: what ``rollouts.jsonl`` says about each rollout of a step, failed ones included.

The step builder makes one ``RolloutRow`` per rollout (``RolloutRow.failed``, ``RolloutRow.survivor``); the
step's readers (metrics, the samples table, a rebuilt step) use its attributes, and ``as_dict`` makes the JSON
object written out, keys in the order of the fields. A field left UNSET is not written: a failed rollout has
no ``samples``, ``turns`` or ``metrics``; only a rebuilt step's rows carry ``attempt`` (dataplane/unacked.py),
only the rows of a step the trainer had before a resume whose old rows are gone ``regenerated`` (outdir.py). So
each row keeps the shape the file always had.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from orchestrator.contracts.protocol import RolloutRecord
from orchestrator.errors import Failure


class RolloutRow(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    env: str
    task: int
    group: str
    rollout: str
    reward: float  # 0.0 for a failed rollout
    advantage: float | None  # None: failed, or its group was dropped
    ok: bool
    filters: list[str]  # the filters it matched (enforced or not), and "max_token_lag" when that left it nothing
    filtered: bool  # an enforced filter left it out of the batch
    dropped: bool  # its group was dropped: nothing of it trains
    failure: Failure | None
    error: str | None  # what failed, for people
    tokens: int
    samples: int | UnsetType = UNSET
    turns: int | UnsetType = UNSET
    policy: int  # the policy step it was sampled with
    off_policy: int  # steps between that policy and this step
    metrics: dict[str, float] | UnsetType = UNSET
    masked_tokens: int | UnsetType = UNSET  # trained tokens older than its env's max_token_lag (only with the limit)
    stop: str | None  # verifiers' stop condition
    wall_s: float
    worker: str
    attempt: int | UnsetType = UNSET  # a step rebuilt after the trainer lost some of its columns
    regenerated: bool | UnsetType = UNSET  # made again after a resume for a step the trainer had: not what it trained

    @classmethod
    def failed(cls, step: int, g: Any, r: RolloutRecord, dropped: bool = False) -> RolloutRow:
        """The row of a failed rollout of group ``g``: why it failed (``failure``, ``error``), no reward."""
        h = r.header
        return cls(step=step, env=g.env, task=g.task, group=g.gid, rollout=r.rid, reward=0.0, advantage=None,
                   ok=False, filters=[], filtered=False, dropped=dropped, failure=h.failure, error=h.error, tokens=0,
                   policy=g.policy, off_policy=step - g.policy, stop=h.stop, wall_s=h.wall_s, worker=h.worker)

    @classmethod
    def survivor(cls, step: int, g: Any, rec: RolloutRecord, advantage: float | None, filters: list[str],
                 filtered: bool, dropped: bool = False, masked_tokens: int | UnsetType = UNSET) -> RolloutRow:
        """The row of a rollout that came back with a reward (``advantage`` None: its group was dropped)."""
        h = rec.header
        return cls(step=step, env=g.env, task=g.task, group=g.gid, rollout=h.rid, reward=rec.reward,
                   advantage=advantage, ok=True, filters=filters, filtered=filtered, dropped=dropped, failure=None,
                   error=None, tokens=h.tokens, samples=len(h.samples), turns=h.turns, policy=g.policy,
                   off_policy=step - g.policy, metrics=h.metrics, masked_tokens=masked_tokens, stop=h.stop,
                   wall_s=h.wall_s, worker=h.worker)

    def as_dict(self) -> dict[str, Any]:
        """The JSON object of this row, UNSET fields left out. Shallow: values stay as they are (numpy scalars,
        the ``Failure`` enum) for orjson to write, as it wrote the dicts rows were before they had a type."""
        return {name: value for name in self.__struct_fields__ if (value := getattr(self, name)) is not UNSET}


def dropped_rows(step: int, groups: Sequence[Any]) -> list[RolloutRow]:
    """Rows of dropped groups (all failed, or group scoring with a failure), ``"dropped": true``: nothing of
    them trains, their failures say why."""
    return [RolloutRow.failed(step, g, r, dropped=True) if not r.ok
            else RolloutRow.survivor(step, g, r, None, [], filtered=False, dropped=True)
            for g in groups for r in g.records]
