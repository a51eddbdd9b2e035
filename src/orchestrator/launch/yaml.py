"""YAML for manifests, without a YAML library: block mappings and sequences; every string value double-quoted (a
JSON string is a valid YAML double-quoted scalar, so nothing is ever read as a number, a boolean or null by
mistake), but a text of several lines ending in a newline as a literal block (a ConfigMap's file reads as the file);
keys plain where YAML cannot misread them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any


def dump(obj: Any) -> str:
    """One YAML document."""
    return "\n".join(_lines(obj, 0)) + "\n"


def dump_all(docs: Iterable[Any]) -> str:
    """A YAML stream: each document after ``---``."""
    return "".join(f"---\n{dump(d)}" for d in docs)


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
_MISREAD = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def _key(k: Any) -> str:
    k = str(k)
    return k if _PLAIN_KEY.fullmatch(k) and k.lower() not in _MISREAD else json.dumps(k)


def _block(v: str, indent: int) -> list[str] | None:
    """A literal block (``|``) for a text of lines ending in a newline, or None where one would not read back the
    same (control characters, a first line that starts with a space, trailing spaces)."""
    if "\n" not in v.rstrip("\n") or not v.endswith("\n") or v.endswith("\n\n") or v.startswith((" ", "\n")):
        return None
    lines = v[:-1].split("\n")
    if any(line != line.rstrip() or any(ord(c) < 32 and c != "\t" for c in line) or "\t" in line for line in lines):
        return None
    pad = " " * indent
    return ["|", *(pad + line if line else "" for line in lines)]


def _scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return json.dumps(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise TypeError(f"cannot write {type(v).__name__} as YAML")


def _lines(obj: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(obj, dict):
        if not obj:
            return [pad + "{}"]
        out = []
        for k, v in obj.items():
            key = _key(k)
            block = _block(v, indent + 2) if isinstance(v, str) else None
            if block is not None:
                out.append(f"{pad}{key}: {block[0]}")
                out += block[1:]
            elif isinstance(v, dict | list) and v:
                out.append(f"{pad}{key}:")
                out += _lines(v, indent + 2)
            else:
                out.append(f"{pad}{key}: {_inline(v)}")
        return out
    if isinstance(obj, list):
        if not obj:
            return [pad + "[]"]
        out = []
        for item in obj:
            if isinstance(item, dict | list) and item:
                inner = _lines(item, indent + 2)
                out.append(f"{pad}- {inner[0].lstrip()}")
                out += inner[1:]
            else:
                out.append(f"{pad}- {_inline(item)}")
        return out
    return [pad + _scalar(obj)]


def _inline(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return _scalar(v)
