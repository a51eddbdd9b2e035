"""Package data: the small word-level tokenizer used by the simulated server, the demo and the tests."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def tokenizer_dir() -> Path:
    """Directory of the built-in tokenizer (``tokenizer.json`` with a chat template), for AutoTokenizer."""
    return Path(str(files("orchestrator.assets") / "tokenizer"))
