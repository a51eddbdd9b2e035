"""How a server's failed rollouts show in the log: one line per server event, not one per rollout.

A server that dies (or hangs, or errs) fails every rollout it holds at about the same moment: dozens of lines
saying the same thing. So a rollout that failed by its server's fault (``Failure.server_fault``) gets a
WARNING only if no other rollout of that server got one within ``window_s`` (``monitor.stall_warn_s``); the
others go to DEBUG, and the next WARNING says how many there were. The server's own events (it leaves
rotation, it rejoins) are the pool's lines; every failed rollout is still a row in rollouts.jsonl and a count
in the step's metrics. Not "the first in a row": records come a group at a time, so successes from before the
failure arrive between failures and would reset any such count.
"""

from __future__ import annotations

import logging


class ServerFaultLines:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: dict[str, float] = {}  # server URL -> when a failure of it was last logged as a WARNING
        self._hidden: dict[str, int] = {}  # server URL -> failures at DEBUG since then

    def level(self, server: str, now: float) -> tuple[int, str]:
        """The level of the line for one more failure on ``server``, and what to add to it (the failures at
        DEBUG before it, if any)."""
        if now - self._last.get(server, -float("inf")) < self.window_s:
            self._hidden[server] = self._hidden.get(server, 0) + 1
            return logging.DEBUG, ""
        self._last[server] = now
        hidden = self._hidden.pop(server, 0)
        return logging.WARNING, f" ({hidden} more on {server} since the last line like this)" if hidden else ""
