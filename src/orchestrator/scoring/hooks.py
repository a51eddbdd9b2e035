"""Resolve user hooks named ``module:function`` in the config (advantage functions, filters)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from orchestrator.errors import ConfigError


def import_hook(spec: str, key: str) -> Callable[..., Any]:
    """Import ``module:function``; a ConfigError names ``key`` (e.g. ``pipeline.advantage``) on failure."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError([f"{key}: expected 'module:function', got {spec!r}"])
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError([f"{key}: cannot import module {module_name!r}: {e}"]) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError([f"{key}: {module_name!r} has no function {attr!r}"])
    return fn  # type: ignore[no-any-return]
