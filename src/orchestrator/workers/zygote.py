"""The warm env worker: one process per hub imports what every env worker imports, then forks the workers.

An env worker's interpreter spends ~5 s of CPU importing verifiers 0.4.0 (anthropic's and openai's SDKs, sympy
through math_verify) and ~1.5 s more on its first environment load (verifiers' tasksets, openai's resources)
before it serves a rollout (``python -X importtime``; py-spy on a test's workers: 73% of their CPU). A host's
local workers all import the same, so the hub starts one warm process (``orchestrator env-worker --connect
ADDRESS --forks FD``) that imports it once and forks each worker from it: a worker, or a restart, is ready in
the time its environments take to load, and the imported pages are shared until written.

The protocol is contracts/forks.py, on the socket ``FD`` (the hub's end: hub/forks.py): a ``Fork`` (an
``env-worker`` command line for one worker) is answered by ``Born`` once forked, and ``Ended`` when that worker
ends. It stops when the hub closes the socket.

The warm process dies with the hub's process and each worker with the warm process (``die_with_parent``: a
SIGKILLed run leaves nothing behind). It ignores SIGINT (a Ctrl-C in a terminal reaches the whole process group:
the hub stops the workers); each worker gets Python's handlers back, as if started on its own.
"""

from __future__ import annotations

import gc
import importlib
import os
import selectors
import signal
import socket
from collections.abc import Iterator

from orchestrator.contracts.forks import Born, Ended, encode, requests
from orchestrator.procs import PARENT_ENV, die_with_parent, name_process

NAME, WORKER_NAME = "env-worker-warm", "env-worker"  # what ps and top show (its command line is the workers')

# what every worker imports before its first rollout, measured (-X importtime of a worker loading the built-in
# envs): verifiers, the tasksets its loader imports to find one (nemo_gym's brings mcp), and openai's chat client
WARM = ("orchestrator.workers.process", "verifiers.v1", "verifiers.v1.tasksets", "openai.resources.chat.completions")


def warm() -> None:
    for name in WARM:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # what is imported now is never collected, here or in a worker: collections do not copy its pages


def serve(fd: int) -> list[str]:
    """Warm up, then fork a worker per request on socket ``fd`` until the hub closes it. Returns only in a
    forked worker, with its command line; the warm process itself exits here."""
    conn = socket.socket(fileno=fd)
    name_process(NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warm()
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of every exit
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    me = os.getpid()
    buf = b""
    while True:
        for key, _ in sel.select():
            if key.fileobj is wake_r:
                wake_r.recv(4096)
                for pid, status in _reaped():
                    _send(conn, encode(Ended(pid, status)))
                continue
            try:
                data = conn.recv(65536)
            except OSError:  # reset: the hub closed its end with replies unread
                data = b""
            if not data:  # the hub closed its end: done (a worker still running dies with this process)
                raise SystemExit(0)
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                argv = requests.decode(line).argv
                pid = os.fork()
                if pid == 0:
                    _as_a_worker(me)
                    sel.close()
                    for s in (conn, wake_r, wake_w):
                        s.close()
                    return argv
                _send(conn, encode(Born(pid)))


def _as_a_worker(warm_pid: int) -> None:
    """In a forked worker, first thing: death with the warm process (if it died already, exit), its name, and
    the signal handling of a process started on its own."""
    os.environ[PARENT_ENV] = str(warm_pid)  # not getppid(): that is init's once the warm process has died
    die_with_parent()
    name_process(WORKER_NAME)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _send(conn: socket.socket, line: bytes) -> None:
    try:
        conn.sendall(line + b"\n")
    except OSError:  # the hub's end is gone: so is the hub (this process dies with it in a moment)
        raise SystemExit(0) from None


def _reaped() -> Iterator[tuple[int, int]]:
    """The workers that ended since the last call, with their status as asyncio reports it."""
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(raw)
