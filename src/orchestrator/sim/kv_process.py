"""The simulated KV engine in a process of its own, as vLLM's engine core runs beside its API server.

On the server's loop, the engine's iterations were late whenever the loop was answering requests: at
``--kv-step-ms 2.5`` on 2 cores they took 1.3-1.8x their modelled time, more the more the engine served
(scripts/perf/README.md), so a benchmark compared the machine's CPU rather than the concurrency caps it ran. Here
the child runs a ``KVDriver`` (kv.py) on a loop that does nothing else; the server's ``KVProcess`` forwards
requests to it and hears back when they are done.

The pipe, one JSON object a line. To the child (stdin): ``{"submit": id, "prompt": n, "target": n}``,
``{"cancel": id}``, ``{"paused": bool}`` (a keep pause freezes the engine) and ``{"load": id}``; end of input
stops it. From the child (stdout): ``{"done": id}`` and ``{"load": id, "value": [KVLoad's fields]}``, each with
``"timing": [iterations, modeled_s, wall_s]``. The child exits at the end of its input, so it never outlives the
server, whatever ended the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
from dataclasses import asdict, astuple
from typing import IO, TYPE_CHECKING, Any

from orchestrator.sim.kv import KVDriver, KVLoad, KVModel

if TYPE_CHECKING:
    from orchestrator.sim.gate import Gate, GateState


class KVProcess:
    """The server's side: ``await decode(prompt, target)`` returns once the engine process has generated the
    request's tokens (ValueError at once: its context never fits the cache; CancelledError: the engine stopped).
    ``run()`` starts the child and serves it until ``stop()``; its owner runs it in a TaskGroup. ``load()`` asks
    the engine for its state (``/metrics``); ``timing`` is the engine's iteration count and their modelled and
    wall durations as of its last message (``GET /sim/log``'s ``kv``). A keep pause on ``gate`` freezes the
    engine until it ends."""

    def __init__(self, model: KVModel, gate: Gate, time_scale: float = 1.0) -> None:
        self.model, self.gate, self.time_scale = model, gate, time_scale
        self.timing: tuple[int, float, float] = (0, 0.0, 0.0)
        self._waiting: dict[int, asyncio.Future[Any]] = {}  # request and load ids the child has not answered
        self._next_id = 0
        self._stdin: asyncio.StreamWriter | None = None
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()

    @property
    def iterations(self) -> int:
        return self.timing[0]

    @property
    def modeled_s(self) -> float:
        return self.timing[1]

    @property
    def wall_s(self) -> float:
        return self.timing[2]

    async def decode(self, prompt: int, target: int) -> None:
        self.model.check_fits(prompt, target)
        key, done = await self._ask({"prompt": prompt, "target": target}, "submit")
        try:
            await done
        finally:
            if not done.done() or done.cancelled():  # the client went away: the engine frees its blocks
                self._waiting.pop(key, None)
                self._send({"cancel": key})

    async def load(self) -> KVLoad:
        _, answer = await self._ask({}, "load")
        return KVLoad(*await answer)

    def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator.sim.kv_process", json.dumps([asdict(self.model), self.time_scale]),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert child.stdin is not None
        assert child.stdout is not None
        self._stdin = child.stdin
        self._ready.set()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._read(child.stdout))
                pausing = tg.create_task(self._follow_pause())
                await self._stopped.wait()
                pausing.cancel()
                child.stdin.close()  # the child's end of input: it stops
        finally:
            with contextlib.suppress(ProcessLookupError):
                if child.returncode is None:
                    child.stdin.close()
                    try:
                        async with asyncio.timeout(5):  # not wait_for: on 3.11 it can swallow a cancel
                            await child.wait()
                    except TimeoutError:
                        child.kill()
                        await child.wait()
            for fut in self._waiting.values():
                fut.cancel()
            self._waiting.clear()

    async def _ask(self, body: dict[str, Any], verb: str) -> tuple[int, asyncio.Future[Any]]:
        await self._ready.wait()
        if self._stopped.is_set():
            raise RuntimeError("the simulated KV engine has stopped")
        key, self._next_id = self._next_id, self._next_id + 1
        fut = self._waiting[key] = asyncio.get_running_loop().create_future()
        self._send({verb: key, **body})
        return key, fut

    def _send(self, message: dict[str, Any]) -> None:
        if self._stdin is not None and not self._stdin.is_closing():
            self._stdin.write(json.dumps(message).encode() + b"\n")

    async def _read(self, stdout: asyncio.StreamReader) -> None:
        """Answers from the child, until it ends (the server stopped, or the child died: then every request
        inside fails with CancelledError)."""
        while line := await stdout.readline():
            message = json.loads(line)
            iterations, modeled_s, wall_s = message["timing"]
            self.timing = (iterations, modeled_s, wall_s)
            key = message["done"] if "done" in message else message["load"]
            fut = self._waiting.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(message.get("value"))
        self._stopped.set()

    async def _follow_pause(self) -> None:
        paused = False

        def changed(state: GateState) -> bool:
            return (state.mode == "keep") != paused

        while True:
            paused = (await self.gate.wait_until(changed)).mode == "keep"
            self._send({"paused": paused})


async def _serve(model: KVModel, time_scale: float, out: IO[bytes]) -> None:
    """The child: a ``KVDriver`` answering the server's pipe (module docstring) until its input ends."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    paused = False
    driver = KVDriver(model, lambda: paused, time_scale)
    requests: dict[int, asyncio.Future[None]] = {}

    def reply(message: dict[str, Any]) -> None:
        message["timing"] = [driver.iterations, driver.modeled_s, driver.wall_s]
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()

    def finished(key: int, done: asyncio.Future[None]) -> None:
        if requests.pop(key, None) is not None and not done.cancelled():
            reply({"done": key})

    async with asyncio.TaskGroup() as tg:
        tg.create_task(driver.run())
        while line := await reader.readline():  # each message acted on before the next is read: in order
            message = json.loads(line)
            if "submit" in message:
                key = message["submit"]
                done = requests[key] = driver.submit(message["prompt"], message["target"])
                done.add_done_callback(functools.partial(finished, key))
            elif "cancel" in message:
                request = requests.pop(message["cancel"], None)
                if request is not None:
                    driver.cancel(request)
            elif "paused" in message:
                paused = message["paused"]
            else:
                reply({"load": message["load"], "value": list(astuple(driver.engine.load()))})
        driver.stop()


def main() -> None:
    fields, time_scale = json.loads(sys.argv[1])
    asyncio.run(_serve(KVModel(**fields), time_scale, sys.stdout.buffer))


if __name__ == "__main__":
    main()
