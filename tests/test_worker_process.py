"""The env worker's group runner, on a real ZMQ pair: failures of a group's setup fail its rollouts only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import zmq
import zmq.asyncio

from orchestrator.contracts.protocol import (
    Assign,
    Records,
    decode_orchestrator_message,
    decode_worker_message,
    split_records,
)
from orchestrator.errors import Failure, WireError
from orchestrator.workers.process import LoadedEnv, Worker, classify


class SlotsRaise:
    """An environment whose ``slots`` raises (what verifiers does on a task it cannot serve)."""

    def __init__(self) -> None:
        self.taskset = [{"prompt": "1 + 1"}]

    def slots(self, task: Any, n: int) -> list[Any]:
        raise RuntimeError(f"cannot make {n} slots for {task}")


async def test_a_group_whose_setup_raises_fails_each_rollout_and_the_worker_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = zmq.asyncio.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://worker-test")
        b.connect("inproc://worker-test")
        worker = Worker("inproc://unused", "w0")
        worker.envs["bad"] = LoadedEnv("bad", SlotsRaise())
        monkeypatch.setattr(worker, "_model_context", lambda server, sampling: None)
        msg = Assign("g7", "bad", 0, ["g7-0", "g7-1"], "http://127.0.0.1:9/v1", {}, 3)
        await worker._run_group(a, msg)  # returns: no exception reaches the worker's TaskGroup
        frames = await b.recv_multipart(copy=False)
        head = decode_worker_message(frames[0].buffer)
        assert isinstance(head, Records)
        records = split_records(head, [f.buffer for f in frames[1:]])
        assert [r.rid for r in records] == ["g7-0", "g7-1"]
        assert all(not r.ok and r.header.failure is Failure.ENV for r in records)
        assert all(r.header.error == "RuntimeError: cannot make 2 slots for {'prompt': '1 + 1'}" for r in records)
        assert records[0].header.policy_step == 3
        for r in records:
            r.check()  # what the hub checks: a failed record names its failure and carries no data
        assert "g7" not in worker.groups
    finally:
        a.close()
        b.close()
        ctx.term()


@dataclass
class Recorded:
    """An error as verifiers records it on a trace (``vf.Error``: type, message, status_code)."""

    type: str
    message: str
    status_code: int | None = None


@pytest.mark.parametrize(("error", "kind"), [
    # verifiers surfaces a failed model call as the provider's own error, with the status it relayed
    (Recorded("ProviderError", "Error code: 500 - {'error': 'injected'}", 500), Failure.PROVIDER),
    (Recorded("ProviderError", "Connection error.", 503), Failure.PROVIDER),
    (Recorded("ProviderError", "Request timed out.", 504), Failure.TIMEOUT),
    # HarnessError is split: the harness died on a 5xx from the interception proxy, which answers 502 when the
    # server's reply could not be used (bad JSON, token strings, NaN logprobs): the server's fault ...
    (Recorded("HarnessError", "harness launch: InternalServerError: Error code: 502 - {'error': ...}"),
     Failure.MALFORMED),
    (Recorded("HarnessError", "harness 'null' exited 1: ... openai.InternalServerError: Error code: 502"),
     Failure.MALFORMED),
    # ... any other harness failure is the environment's (its program, its installs, its runtime)
    (Recorded("HarnessError", "harness 'null' exited 1: error: Failed to download `openai`"), Failure.ENV),
    (Recorded("InterceptionError", "harness 'null' model connection to interception failed: ..."), Failure.ENV),
    (Recorded("SandboxError", "runtime died under harness 'null' (exit -9): <no output>"), Failure.ENV),
    (Recorded("EnvError", "env run: KeyError: 'game'"), Failure.ENV),
    (Recorded("TaskError", "task setup: ValueError: no word"), Failure.ENV),
    (Recorded("TaskError", "task ArithmeticTask scoring: ZeroDivisionError: division by zero"), Failure.SCORING),
    (Recorded("ValueError", "something verifiers did not type"), Failure.ENV),
])
def test_verifiers_errors_map_to_our_failure_kinds(error: Recorded, kind: Failure) -> None:
    assert classify([error], is_timeout=False) is kind
    assert classify([error], is_timeout=True) is Failure.TIMEOUT  # a rollout past its deadline, whatever broke
    assert kind.server_fault == (kind in (Failure.PROVIDER, Failure.TIMEOUT, Failure.MALFORMED))


def test_an_episode_failed_without_a_recorded_error_is_the_environments() -> None:
    assert classify([], is_timeout=False) is Failure.ENV


def test_a_message_with_a_string_that_is_not_utf8_is_a_wire_error() -> None:
    """msgspec 0.22 raises UnicodeDecodeError, not DecodeError, for such a string: at the edge it is a WireError
    like any other invalid message (the hub counts it; a worker ignores it instead of exiting)."""
    hello = b"\x82\xa4type\xa5hello\xa6worker\xa2\xff\xfe"
    cancel = b"\x82\xa4type\xa6cancel\xa5group\xa2\xff\xfe"
    with pytest.raises(WireError, match="invalid worker message"):
        decode_worker_message(hello)
    with pytest.raises(WireError, match="invalid orchestrator message"):
        decode_orchestrator_message(cancel)
