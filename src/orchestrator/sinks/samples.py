"""A samples table: a few of a step's rollouts with their text, for a tracker's table (W&B).

Rollout records carry token ids, not text: the text is decoded here with the model's tokenizer (its
``tokenizer.json``, through the ``tokenizers`` library), only for the rollouts of a due table, in the step
thread. A tokenizer without ``tokenizer.json`` shows token ids instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.contracts.rows import RolloutRow

log = logging.getLogger(__name__)

MAX_CHARS = 8000  # of each text cell: a table is for reading a few rollouts, not for storing them


class SampleTable:
    def __init__(self, tokenizer_dir: Path) -> None:
        self.tokenizer_dir = tokenizer_dir
        self._tokenizer: Any = None
        self._loaded = False

    def decode(self, ids: Sequence[int]) -> str:
        if not self._loaded:
            self._loaded = True
            path = self.tokenizer_dir / "tokenizer.json"
            if path.is_file():
                from tokenizers import Tokenizer

                self._tokenizer = Tokenizer.from_file(str(path))
            else:
                log.warning("no %s: samples tables show token ids", path)
        if self._tokenizer is None:
            return " ".join(str(i) for i in ids)[:MAX_CHARS]
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=False)
        return text[:MAX_CHARS]

    def rows(self, rows: Sequence[RolloutRow], groups: Sequence[Any], limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` rollouts, the first successful one of each of the step's groups in order: scalars
        from its row, and its first sample's ``prompt`` (the tokens before the first sampled one) and
        ``completion`` (the rest: every turn, the environment's replies included)."""
        records = {r.rid: r for g in groups for r in g.survivors}
        out: list[dict[str, Any]] = []
        seen: set[str] = set()
        for row in rows:
            rec = records.get(row.rollout)
            if rec is None or row.group in seen or not rec.header.samples or rec.header.span is not None:
                continue  # (a span: direct mode, and its columns could not be read back)
            seen.add(row.group)
            n = rec.header.samples[0][0]
            ids, mask = rec.column("token_ids")[:n], rec.column("loss_mask")[:n]
            first = int(mask.argmax()) if mask.any() else n
            turns = row.turns if isinstance(row.turns, int) else 0  # (UNSET only in a failed rollout's row)
            out.append({"step": row.step, "env": row.env, "task": row.task, "rollout": row.rollout,
                        "reward": row.reward, "advantage": row.advantage, "turns": turns,
                        "stop": row.stop, "prompt": self.decode(ids[:first].tolist()),
                        "completion": self.decode(ids[first:].tolist())})
            if len(out) >= limit:
                break
        return out
