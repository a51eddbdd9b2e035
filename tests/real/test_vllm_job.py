"""A job against two real vLLM servers (0.32), both built-in environments (arithmetic: one turn; guess-number: 2-6), the
PyTorch trainer training the real model and announcing a real checkpoint every step.

What it proves: every step reaches the trainer once and in order; a weight reload every step on both servers; no
failed rollout; and the trainer's first-pass recomputation of every shipped logprob matches what vLLM shipped to
1e-4 (float32: it measures < 1e-6) after several reloads, multi-turn samples included, in the processed mode at
temperature 0.7. The same recomputation with the loss mask shifted by one token is far off: the report is what
catches a misaligned mask.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest

from orchestrator.contracts.wire import Batch
from orchestrator.realstack.server import VLLMServer
from orchestrator.testing.real_job import RealJob, Servers, get_json, reload_base, run_real_job
from orchestrator.trainer.torch_learner import Sample, TorchLearnConfig, TorchLearner, TorchLearnStats

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("verifiers_home")]
STEPS = 4
TEMPERATURE = 0.7  # != 1: raw and processed logprobs differ, and the servers ship processed ones
PARITY = 1e-4


class ShiftedProbe(TorchLearner):
    """Also recomputes each batch with its loss mask one token late, as a trainer with an off-by-one would, and
    keeps both reports. The update itself trains on the right tokens."""

    def __init__(self, model_dir: Path, config: TorchLearnConfig) -> None:
        super().__init__(model_dir, config)
        self.shifted: list[float] = []
        self.multi_turn: list[int] = []  # per step: samples whose loss mask has more than one run (turns)

    def update(self, batch: Batch) -> TorchLearnStats:
        mask = batch.columns["loss_mask"].astype(np.int8)
        runs = [int(np.count_nonzero(np.diff(mask[a:b], prepend=0) == 1))
                for a, b in zip(batch.offsets[:-1], batch.offsets[1:], strict=True)]
        self.multi_turn.append(sum(r > 1 for r in runs))
        samples = [Sample(s.token_ids, s.positions[s.positions + 1 < s.token_ids.numel()] + 1, s.shipped[
            s.positions + 1 < s.token_ids.numel()], s.advantage, s.temperature, s.on_policy)
            for s in self.samples(batch)]
        with_grad = self._backward(samples, self.mode(batch), len(samples), report=True)
        self.model.zero_grad(set_to_none=True)
        self.shifted.append(with_grad["mismatch_mean"])
        return super().update(batch)


async def test_a_job_on_real_servers_trains_every_step_in_order_with_exact_logprobs(servers: Servers,
                                                                                   tmp_path: Path) -> None:
    model = servers.model("dense")
    for s in servers.dense:
        await reload_base(s.url, model)
    job = RealJob(tmp_path, model, tuple(s.url for s in servers.dense), steps=STEPS, temperature=TEMPERATURE)
    learner = ShiftedProbe(model, TorchLearnConfig(lr=1e-2))
    result = await run_real_job(job, learner)

    assert [row["step"] for row in result.journal] == list(range(STEPS))  # once each, in order
    metrics = [orjson.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["policy"] for m in metrics] == list(range(STEPS))  # step s sampled by weights s: a sync every step
    assert all(m["failed"] == 0 for m in metrics), [m["failed"] for m in metrics]
    assert {"arith", "guess"} <= {env for m in metrics for env in m["reward_mean"]}
    for s in servers.dense:  # both servers loaded the last checkpoint the run synced
        assert (await get_json(s.root + "/weight_info"))["weight_version"] == str(STEPS - 1)

    reports = [row["learned"] for row in result.journal]
    assert all(r["mode"] == "processed" for r in reports)
    assert max(r["mismatch_max"] for r in reports) <= PARITY, [r["mismatch_max"] for r in reports]
    assert sum(learner.multi_turn) > 0  # multi-turn samples were among those that matched
    assert min(learner.shifted) > 100 * PARITY, learner.shifted  # a one-token shift is caught every step


async def test_a_job_on_vllm_0_31_trains_every_step_with_exact_logprobs_and_bounded_versions(
        server_031: VLLMServer, tmp_path: Path) -> None:
    """vLLM 0.31 (the newest whose replies verifiers reads unchanged) stays covered: one server, a sync every step,
    the same parity. Its replies do not say which weights sampled a token, so every sampled token's version is
    bounded by its rollout's policy (on-policy here: the bounds meet, and the learner counts them as its own)."""
    model = server_031.paths.model("dense")
    await reload_base(server_031.url, model)
    job = RealJob(tmp_path, model, (server_031.url,), steps=3, temperature=TEMPERATURE)
    learner = Bounded(model, TorchLearnConfig(lr=1e-2))
    result = await run_real_job(job, learner)
    assert [row["step"] for row in result.journal] == [0, 1, 2]
    metrics = [orjson.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_bytes().splitlines()]
    assert all(m["failed"] == 0 for m in metrics), [m["failed"] for m in metrics]
    assert all(m["versions"]["exact"] == 0 and m["versions"]["bounded"] > 0 for m in metrics)
    assert learner.bounded_only
    reports = [row["learned"] for row in result.journal]
    assert all(r["own_tokens"] > 0 for r in reports)
    assert max(r["mismatch_max"] for r in reports) <= PARITY, [r["mismatch_max"] for r in reports]


class Bounded(TorchLearner):
    """Checks each batch's sampled tokens are all bounded (the server said nothing about versions)."""

    bounded_only = True

    def update(self, batch: Batch) -> TorchLearnStats:
        versions = batch.columns["versions"]
        self.bounded_only &= bool((versions[versions != -1] <= -2).all())
        return super().update(batch)
