"""Supervision of the env workers: lose the silent, kill the stuck, restart local ones, wait for them ready.

A ready worker silent for ``scheduler.worker_silence_s`` (one still loading its environments: LOAD_TIMEOUT_S)
is lost: its rollouts fail with ``worker_died`` at once, and the log names it. A local one is killed (SIGKILL,
which also ends a stopped process) and restarted under its name (local.py: at once, or backing off while
restarts fail before ready). A remote one is not ours to kill: when it speaks again (e.g. after SIGCONT) it is
sent ``setup`` and re-admitted when it answers ``ready`` (dispatch.py); the records it had in flight when it
was lost count as ``late``, not as invalid messages. A local one not ready yet is watched through its process
(local.py): stopped for ``worker_silence_s``, or not connected within local.STARTUP_S, it is killed and
restarted too. ``wait_ready`` names what it waits for every ``monitor.stall_warn_s``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from orchestrator.contracts.protocol import HEARTBEAT_S
from orchestrator.errors import WorkerError
from orchestrator.hub.roster import Roster, WorkerState

if TYPE_CHECKING:
    from orchestrator.hub.local import LocalWorkers
    from orchestrator.hub.pools import PoolKeeper

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 300.0  # a worker that said hello loads its environments (importing verifiers, ...) within this
# a local worker silent past worker_silence_s whose process is at work (local.py: ``at_work``) is given up to this
# many times the bound: its loop is held (CPU-bound environment code, a disk that stalls reads for seconds, a core
# shared with busier processes at its nice level), it is not frozen. A CI run lost a busy worker and its 32 rollouts
# this way. Stopped, or asleep doing nothing, it is lost at the bound as before.
AT_WORK_FACTOR = 6.0


class Supervisor:
    def __init__(self, roster: Roster, *, silence_s: float, ready: asyncio.Event, address: str, remote: int) -> None:
        """``ready``: set when a worker becomes ready; ``address`` and ``remote``: where the ``remote`` workers
        expected connect (for ``waiting_for``)."""
        self.roster = roster
        self.procs: LocalWorkers = roster.procs
        self.pools: PoolKeeper = roster.pools
        self.metrics = roster.metrics
        self.silence_s = silence_s
        self.ready = ready
        self.address = address
        self.remote = remote
        self._excused: set[str] = set()  # workers silent past the bound but at work, said once

    async def run(self) -> None:
        """Every HEARTBEAT_S: lose silent workers (killing local ones), kill local ones stuck starting (local.py:
        ``starting``), restart local workers that exited. Wakes on its timer only; produces ``WorkerLost``
        (roster.py) and restarts (``metrics["restarts"]``)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + HEARTBEAT_S
            await asyncio.sleep(HEARTBEAT_S)
            now = loop.time()
            self._excuse_stall(now - due)
            self._lose_silent(now)
            self._kill_stuck(now)
            self._reap(now)
            restarted = await self.procs.restart_due(now)
            self.metrics["restarts"] += len(restarted)
            for name in restarted:
                self.roster.banned.discard(name.encode())  # a fresh process under the name of one that was dropped

    def _excuse_stall(self, late: float) -> None:
        """This loop woke ``late`` seconds late: the event loop was held (the lag monitor says by what), so nothing
        the workers sent meanwhile was read (it waits in the socket). That time is not theirs to be silent in."""
        if late > HEARTBEAT_S:
            log.info("env worker supervision ran %.1f s late: the workers' silence does not count that time", late)
            for w in self.roster.workers.values():
                w.last_seen += late

    def _lose_silent(self, now: float) -> None:
        for w in list(self.roster.workers.values()):
            # a worker heartbeats once it is ready; before, it is importing and loading (blocking calls)
            silent, limit = now - w.last_seen, self.silence_s if w.ready else LOAD_TIMEOUT_S
            if not w.ready or silent <= limit / 2:
                self._excused.discard(w.name)
                at_work = None
            else:  # sampled from half the bound on, so two looks bracket the end of the silence
                at_work = self.procs.at_work(w.name)
            if silent <= limit:
                continue
            if at_work is not None and silent <= limit * AT_WORK_FACTOR:
                self._excuse(w.name, silent, at_work)
            else:
                self._lose(w, silent)

    def _excuse(self, name: str, silent: float, at_work: str) -> None:
        if name not in self._excused:
            self._excused.add(name)
            log.warning("env worker %s silent for %.0f s, but its process (pid %s) is %s: its event loop is held, "
                        "not frozen; lost if still silent at %.0f s", name, silent, self.procs.alive(name), at_work,
                        self.silence_s * AT_WORK_FACTOR)

    def _lose(self, w: WorkerState, silent: float) -> None:
        self._excused.discard(w.name)
        pid = self.procs.alive(w.name)
        then = f"killed (pid {pid}) to be restarted" if pid is not None else "re-admitted if it speaks again"
        log.error("env worker %s silent for %.0f s%s: lost, %d rollouts in flight fail; %s", w.name,
                  silent, "" if w.ready else " while loading its environments", len(w.rids), then)
        self.roster.lose(w, f"silent for {silent:.0f} s", pool_gone=pid is not None)
        self.procs.kill(w.name)

    def _kill_stuck(self, now: float) -> None:
        """Local workers not ready yet whose process is stopped, or that never connected: lost and killed (the
        supervision loop restarts them as they exit)."""
        by_name = {w.name: w for w in self.roster.workers.values()}
        for name, why in self.procs.starting(now, by_name.keys(), self.silence_s).items():
            log.error("env worker %s (pid %s) %s: lost; killed to be restarted", name, self.procs.alive(name), why)
            worker = by_name.get(name)
            if worker is not None:
                self.roster.lose(worker, why, pool_gone=True)
            self.procs.kill(name)

    def _reap(self, now: float) -> None:
        """Local workers whose process exited: lost, with their pools."""
        for name, status in self.procs.exited(now):
            worker = self.roster.named(name)
            if worker is not None:
                self.roster.lose(worker, f"exited with status {status}", pool_gone=True)
            else:  # lost before (silent), now dead too
                self.pools.gone(name, f"its process exited with status {status}")

    async def wait_ready(self, n: int, timeout_s: float, warn_s: float) -> None:
        """Wait until ``n`` workers are ready, saying what it waits for (``waiting_for``) every ``warn_s``
        (the liveness rule: monitor.stall_warn_s); WorkerError naming what is missing after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        start = warned = loop.time()
        try:
            async with asyncio.timeout(timeout_s):
                while (ready := self.roster.ready_count()) < n:
                    self.ready.clear()
                    try:  # not wait_for: on 3.11 it can swallow a cancel
                        async with asyncio.timeout(max(warned + warn_s - loop.time(), 0.0)):
                            await self.ready.wait()
                    except TimeoutError:
                        warned = loop.time()
                        log.warning("env workers: %d of %d ready after %.0f s; waiting for %s", ready, n,
                                    warned - start, self.waiting_for())
        except TimeoutError:
            raise WorkerError(f"{self.roster.ready_count()} of {n} env workers ready after {timeout_s:.0f} s at "
                              f"{self.address} ({self.metrics['restarts']} local restarts); waiting for "
                              f"{self.waiting_for()}; see the env workers' logs") from None

    def waiting_for(self) -> str:
        """The workers that are not ready, in a clause: each local one (local.py: ``not_ready``), then the
        remote ones expected and how many of them are connected."""
        workers = self.roster.workers.values()
        parts = self.procs.not_ready({w.name: w.ready for w in workers},
                                     asyncio.get_running_loop().time())
        if self.remote:
            remote = [w for w in workers if w.name not in self.procs.procs]
            parts.append(f"{self.remote} remote at {self.address} ({len(remote)} connected, "
                         f"{sum(w.ready for w in remote)} ready)")
        return "; ".join(parts) or "nothing (all ready)"
