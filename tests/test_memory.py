from __future__ import annotations

import numpy as np

from orchestrator.memory import malloc_trim, rss_bytes, rss_mb


def test_rss_tracks_a_large_allocation() -> None:
    before = rss_bytes()
    a = np.ones(64 * 2**20, dtype=np.uint8)  # 64 MiB, touched
    during = rss_bytes()
    assert during - before >= 48 * 2**20
    del a
    assert rss_mb() > 0


def test_malloc_trim_runs() -> None:
    # glibc here: the call is made and returns whether memory was released (either is fine)
    assert malloc_trim() in (True, False)

