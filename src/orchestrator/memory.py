"""Process memory: current resident set size and handing freed heap back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import resource
from functools import cache

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Current resident set size of this process (from /proc; peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak * 1024  # Linux and BSD report KiB (macOS bytes: close enough for a fallback)


def rss_mb() -> float:
    return rss_bytes() / 2**20


@cache
def _libc_malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def malloc_trim() -> bool:
    """Return free heap pages to the OS with glibc's ``malloc_trim(0)``; False (a no-op) without glibc."""
    fn = _libc_malloc_trim()
    if fn is None:
        log.debug("malloc_trim is not available here (no glibc); skipped")
        return False
    return bool(fn(0))
