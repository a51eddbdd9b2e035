"""The warm env worker: one process per hub imports what every env worker imports, then forks the workers.

An env worker's interpreter spends ~5 s of CPU importing verifiers 0.4.0 (anthropic's and openai's SDKs, sympy
through math_verify) and ~1.5 s more on its first environment load (verifiers' tasksets, openai's resources)
before it serves a rollout (``python -X importtime``; py-spy on a test's workers: 73% of their CPU). A host's
local workers all import the same, so the hub starts one warm process (``orchestrator env-worker --connect
ADDRESS --forks FD``) that imports it once and forks each worker from it: a worker, or a restart, is ready in
the time its environments take to load, and the imported pages are shared until written.

The protocol, one JSON object a line on the socket ``FD`` (the hub's end: hub/forks.py): the hub sends
``{"argv": [...]}`` (an ``env-worker`` command line for this worker: ``--id``, ``--nice``...), the warm process
answers ``{"pid": N}`` once it has forked it, and ``{"exit": N, "status": S}`` when worker N ends (S as asyncio
reports a child's: its exit code, or minus the signal that ended it). It stops when the hub closes the socket.

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

import orjson

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
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of every exit
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    buf = b""
    while True:
        for key, _ in sel.select():
            if key.fileobj is wake_r:
                wake_r.recv(4096)
                _report_exits(conn)
                continue
            data = conn.recv(65536)
            if not data:  # the hub closed its end: done (a worker still running dies with this process)
                raise SystemExit(0)
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                argv = [str(a) for a in orjson.loads(line)["argv"]]
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    for s in (conn, wake_r, wake_w):
                        s.close()
                    _as_a_worker()
                    return argv
                _send(conn, {"pid": pid})


def _as_a_worker() -> None:
    """In a forked worker: its name, the signal handling of a process started on its own, and death with the warm
    one."""
    name_process(WORKER_NAME)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ[PARENT_ENV] = str(os.getppid())
    die_with_parent()


def _report_exits(conn: socket.socket) -> None:
    for pid, status in _reaped():
        _send(conn, {"exit": pid, "status": status})


def _send(conn: socket.socket, msg: dict[str, int]) -> None:
    try:
        conn.sendall(orjson.dumps(msg) + b"\n")
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
