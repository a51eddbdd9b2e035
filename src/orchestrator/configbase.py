"""What every config section is made of, importable by any component without importing the job's config.

A section is a frozen dataclass whose fields are ``opt(...)``s: a default (or none: required), numeric
bounds the loader checks (never clamps) and a one-line description ``orchestrator check`` prints. A section
may check itself: ``problems(key) -> Iterable[str]`` returns what is wrong with it (each message naming
``key`` + the field), called by the loader after every field was typed, with the section's own key path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def opt(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    doc: str = "",
) -> Any:
    """A config field with optional numeric bounds (checked, never clamped) and a one-line description."""
    meta = {"ge": ge, "gt": gt, "le": le, "doc": doc}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)
