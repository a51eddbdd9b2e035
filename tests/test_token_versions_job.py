"""Which weights sampled each token, end to end against simulated servers that sync every step while long replies
are in flight (the sim's keep pause cuts them in two, as a real vLLM does: sim/segments.py):

- vLLM 0.32 (``weight_versions``): every sampled token's version is exactly the label the server had when it sampled
  it (the sim's own record of each reply's spans), and ``max_token_lag`` masks the older ones out of the loss;
- vLLM 0.31 (no versions in replies): every sampled token is bounded, and the truth lies within its bounds.

Timing decides which replies a sync cuts; the assertions hold for any timing (each token, each sample). That some
reply is cut is made sure of, not left to timing (under load every reply could end before the next sync: seen with
two busy processes beside the suite): the requests that reach the server while the trainer learns a step are held
(``Faults.hold``) until the next weights are loaded and the server resumes, and the trainer waits (bounded) until
one is held, so the next sync's keep pause finds it generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.contracts.wire import Batch
from orchestrator.sim.log import GenerateCall
from orchestrator.sim.profiles import ProfileName
from orchestrator.sim.server import SimServer
from orchestrator.testing.jobs import ARITHMETIC, job_config
from orchestrator.testing.sim import Faults, sim_servers, weights_dir
from orchestrator.trainer.reference import ReferenceTrainer
from orchestrator.trainer.versions import version_bounds

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("verifiers_home")]
STEPS = 4
JOB_GUARD_S = 300
HELD_WAIT_S = 5.0


@dataclass
class Seen:
    step: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    versions: np.ndarray
    offsets: np.ndarray
    scalars: dict[str, list[Any]]
    bounds: tuple[np.ndarray, np.ndarray]


class Cutter:
    """Holds the requests that reach ``server`` from the start of the trainer's step ``s`` until the weights of step
    ``s + 1`` are loaded and it resumes (so that sync cuts them); ``learning(s)``, from the trainer's thread, returns
    once one is held, or after HELD_WAIT_S (when no rollout may start before that sync)."""

    def __init__(self, server: SimServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.loop = server, loop
        self.until = -1  # the hold lasts until the weights of this step are loaded (the newest window's)
        self.releases: list[asyncio.Task[None]] = []

    def learning(self, step: int) -> None:
        if step < STEPS - 1:  # a sync follows
            asyncio.run_coroutine_threadsafe(self._hold(step), self.loop).result(HELD_WAIT_S + 5)

    async def _hold(self, step: int) -> None:
        self.until = step + 1  # an earlier window's release, still pending, leaves this one's hold on
        self.server.faults = dataclasses.replace(self.server.faults, hold=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HELD_WAIT_S):
                await self.server.gate.wait_until(lambda st: st.running > 0)
        self.releases.append(asyncio.create_task(self._release(step + 1)))

    async def _release(self, step: int) -> None:
        with contextlib.suppress(TimeoutError):  # the run may end before that sync
            async with asyncio.timeout(JOB_GUARD_S):
                await self.server.gate.wait_until(
                    lambda st: st.mode is None and (self.server.weights_path or "").endswith(f"step_{step}"))
        if self.until == step:
            self.server.faults = dataclasses.replace(self.server.faults, hold=False)

    async def close(self) -> None:
        """Release what it holds; a release that failed raises here."""
        for task in self.releases:
            task.cancel()
        self.server.faults = dataclasses.replace(self.server.faults, hold=False)
        for outcome in await asyncio.gather(*self.releases, return_exceptions=True):
            if isinstance(outcome, Exception):
                raise outcome


class Recorder:
    """A trainer's learner that keeps what it got and saves the servers' initial policy as every checkpoint."""

    def __init__(self, cutter: Cutter) -> None:
        self.seen: list[Seen] = []
        self.cutter = cutter

    def update(self, batch: Batch) -> None:
        self.cutter.learning(batch.step)
        c = batch.columns
        none = np.zeros(0, np.int32)  # a step whose every sample max_token_lag dropped has no columns to speak of
        self.seen.append(Seen(batch.step, c["token_ids"].copy(), c["loss_mask"].copy(), c.get("versions", none).copy(),
                              batch.offsets.copy(), {k: list(v) for k, v in batch.scalars.items()},
                              version_bounds(batch)))

    def save(self, directory: Path) -> None:
        weights_dir(directory)

    def resume(self, directory: Path) -> bool:
        return False


async def run(tmp_path: Path, profile: ProfileName, data_plane: str, *, async_level: int = 1,
              max_token_lag: int | None = None) -> tuple[Recorder, list[GenerateCall], list[dict[str, Any]]]:
    """A job of STEPS steps; replies of 12-16 tokens that take 0.3-0.7 s each."""
    env = {**ARITHMETIC, "sampling": {"max_tokens": 16, "extra_body": {"min_tokens": 12, "ignore_eos": True}},
           **({"max_token_lag": max_token_lag} if max_token_lag is not None else {})}
    faults = Faults(latency_ms=300, latency_max_ms=700)
    async with sim_servers(1, profile=profile, record_replies=True, faults=faults) as [srv]:
        cfg = job_config(tmp_path, overrides=["pipeline.gates=[]", "pipeline.filters=[]"],
                         run={"name": "versions", "max_steps": STEPS},
                         inference={"servers": [srv.url], "backend": "vllm", "request_timeout_s": 120.0,
                                    "probe_interval_s": 0.2},
                         scheduler={"batch_size": 8, "max_inflight": 16, "max_async_level": async_level,
                                    "max_off_policy_steps": async_level + 1, "max_buffered_rollouts": 64},
                         transport={"data_plane": data_plane}, env=[env])
        cutter = Cutter(srv, asyncio.get_running_loop())
        recorder = Recorder(cutter)
        try:
            async with Orchestrator.open(cfg) as orch:
                trainer = ReferenceTrainer(orch.sender.address, max_steps=STEPS, checkpoint_dir=tmp_path / "ckpt",
                                           learner=recorder)
                async with asyncio.timeout(JOB_GUARD_S), asyncio.TaskGroup() as tg:
                    tg.create_task(trainer.run())
                    await orch.run()
        finally:
            await cutter.close()
        calls = [c for c in srv.log.generate if c.status == 200 and c.token_ids is not None]
    metrics = [orjson.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_bytes().splitlines()]
    return recorder, calls, metrics


def truths(seen: Seen, calls: Sequence[GenerateCall]) -> list[np.ndarray]:
    """Per sample, the label the server had for each of its tokens when it sampled it (-1: not sampled), from the
    sim's own record of each reply (arithmetic is one turn: a sample is one reply's prompt and completion)."""
    by_tokens = {tuple(c.token_ids or ()): c for c in calls}
    out = []
    for i in range(len(seen.offsets) - 1):
        a, b = int(seen.offsets[i]), int(seen.offsets[i + 1])
        call = by_tokens[tuple(seen.token_ids[a:b].tolist())]
        truth = np.full(b - a, -1, np.int64)
        start = call.prompt_tokens
        for label, s, e in call.versions or []:
            truth[start + s:start + e] = int(label)
        out.append(truth)
    return out


async def test_on_0_32_every_token_has_the_version_the_server_sampled_it_with_and_stale_ones_are_masked(
        tmp_path: Path) -> None:
    recorder, calls, metrics = await run(tmp_path, "vllm-0.32", "direct", async_level=2, max_token_lag=0)
    assert [s.step for s in recorder.seen] == list(range(STEPS))
    mixed = masked = 0
    for seen in recorder.seen:
        for i, truth in enumerate(truths(seen, calls)):
            a, b = int(seen.offsets[i]), int(seen.offsets[i + 1])
            versions, mask = seen.versions[a:b], seen.loss_mask[a:b]
            np.testing.assert_array_equal(versions, truth)  # exact, token by token
            assert truth[truth >= 0].min() >= seen.scalars["policy"][i]  # none older than its rollout
            mixed += len(set(truth[truth >= 0].tolist())) > 1
            assert seen.scalars["min_version"][i] == seen.step
            stale = (truth >= 0) & (truth < seen.step)
            assert not mask[stale].any()  # older than max_token_lag = 0: out of the loss
            assert mask[truth == seen.step].all()  # the step's own: trained
            assert mask[truth >= 0].any()  # a sample left with nothing to train is not in the step
            masked += int(stale.sum())
    # some replies were cut by a sync (counted over every sample, those max_token_lag dropped too)
    assert sum(m["versions"]["mixed_samples"] for m in metrics) >= max(mixed, 1)
    assert sum(m["versions"]["masked"] for m in metrics) >= masked >= 1  # masked are counted (dropped samples too)
    assert sum(m["versions"]["exact"] for m in metrics) > 0
    assert all(m["versions"]["bounded"] == 0 for m in metrics)


async def test_on_0_31_every_sampled_token_is_bounded_and_its_version_lies_within(tmp_path: Path) -> None:
    recorder, calls, metrics = await run(tmp_path, "vllm-0.31", "through")
    spans = 0
    for seen in recorder.seen:
        lo, hi = seen.bounds
        for i, truth in enumerate(truths(seen, calls)):
            a, b = int(seen.offsets[i]), int(seen.offsets[i + 1])
            sampled = truth >= 0
            assert (seen.versions[a:b][sampled] <= -2).all()  # bounded: the server did not say
            assert (seen.versions[a:b][~sampled] == -1).all()
            assert (lo[a:b][sampled] == seen.scalars["policy"][i]).all()
            assert (lo[a:b][sampled] <= truth[sampled]).all()
            assert (truth[sampled] <= hi[a:b][sampled]).all()
            spans += seen.scalars["policy_max"][i] > seen.scalars["policy"][i]
    assert spans >= 1  # some rollouts were in flight at a sync: their bounds are apart
    assert all(m["versions"]["exact"] == 0 and m["versions"]["bounded"] > 0 for m in metrics)
