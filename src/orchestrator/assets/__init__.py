"""Package data: the small word-level tokenizer used by the simulated server, the demo and the tests."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path


def tokenizer_dir() -> Path:
    """Directory of the built-in tokenizer (``tokenizer.json`` with a chat template), for AutoTokenizer."""
    return Path(str(files("orchestrator.assets") / "tokenizer"))


def vocab_size(directory: Path) -> int | None:
    """Vocabulary size of a tokenizer directory (from its ``tokenizer.json``); None when it cannot be read."""
    try:
        data = json.loads((directory / "tokenizer.json").read_text())
        ids = list(data["model"]["vocab"].values()) if isinstance(data["model"]["vocab"], dict) else []
        ids += [t["id"] for t in data.get("added_tokens", [])]
        return max(ids) + 1 if ids else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
