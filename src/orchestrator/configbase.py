"""What every config section is made of, importable by any component without importing the job's config.

A section is a frozen dataclass whose fields are ``opt(...)``s: a default (or none: required), numeric
bounds the loader checks (never clamps) and a one-line description ``orchestrator check`` prints. A section
may check itself: ``problems(key, source) -> Iterable[str]`` returns what is wrong with it, each line starting
with ``source(k): k: `` for the key ``k`` to change (``key`` + the field), called by the loader after every field
was typed, with the section's own key path. Checks that span sections stay with the loader (config.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import field
from typing import Any

Source = Callable[[str], str]
"""Where a key's value was written (the job file, an included file or ``--set KEY``): each problem starts with it."""


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


def address_problems(key: str, address: str | None, source: Source) -> Iterable[str]:
    """A ZMQ address we bind must name its transport: zmq's own error for ``HOST:PORT`` says only "Invalid argument"."""
    if address is not None and not address.startswith(("tcp://", "ipc://")):
        yield f"{source(key)}: {key}: expected a tcp://HOST:PORT or ipc://PATH address, got {address!r}"
