"""A job on two real vLLM 0.32 servers whose weight syncs land while long replies are in flight.

Arithmetic replies are long (256 tokens, ``ignore_eos``) and guess-number's short (4 tokens a turn, 2-6 turns), so
each step holds long replies begun before its sync and short rollouts begun after it. What it proves: a reply a sync's
keep pause cut in two comes back with two ``weight_versions`` spans, and the batch's ``versions`` column names, token by
token, exactly the step the server said (checked against what the servers sent, recorded by a proxy in front of
them; multi-turn samples call by call); some samples carry two versions; the PyTorch trainer's recomputation matches
the shipped logprobs to 1e-4 over the tokens its own weights sampled, token by token, in samples begun under those
weights. The tokens its weights sampled after a sync in a reply begun before it are left out of that check and
reported apart, exactly those: vLLM keeps such a request's KV cache, computed by the older weights, across the
reload, so they are not what the new weights compute from scratch (docs/inference-servers.md).

No ``min_tokens``: vLLM masks the stop tokens of a reply's first ``min_tokens`` before sampling, so their processed
logprobs are of another distribution than the trainer recomputes (off by ``-log(1 - p_stop)``: 1.1-1.6e-3 here).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator.columns.versions import expand
from orchestrator.contracts.wire import Batch
from orchestrator.testing.real_job import RealJob, Servers, reload_base, run_real_job
from orchestrator.testing.recording_proxy import RecordingProxy
from orchestrator.trainer.torch_learner import TorchLearnConfig, TorchLearner, TorchLearnStats

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("verifiers_home")]
STEPS = 4
PARITY = 1e-4


def runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of True in ``flags``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class Keeper(TorchLearner):
    """Keeps each batch's tokens, offsets, versions, loss mask and policies beside the learner's report, and moves
    every weight by 2% after each update: a batch whose every group scored alike has no gradient, and then the next
    weights are the last ones, and the KV cache older weights computed is what the new ones compute (seen in CI:
    mixed_max 4.8e-7 after such a step). What it ships are the weights it holds, so parity is unchanged."""

    def __init__(self, model_dir: Path, config: TorchLearnConfig) -> None:
        super().__init__(model_dir, config)
        self.kept: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]] = []
        self.noise = torch.Generator().manual_seed(0)

    def update(self, batch: Batch) -> TorchLearnStats:
        c = batch.columns
        self.kept.append((batch.step, c["token_ids"].copy(), batch.offsets.copy(),
                          c.get("versions", np.zeros(0, np.int32)).copy(), c["loss_mask"].copy(),
                          list(batch.scalars.get("policy", []))))
        stats = super().update(batch)
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(1 + 0.02 * torch.randn(p.shape, generator=self.noise, dtype=p.dtype))
        return stats


async def test_syncs_during_long_replies_give_tokens_of_two_versions_each_named_exactly(servers: Servers,
                                                                                        tmp_path: Path) -> None:
    model = servers.model("dense")
    for s in servers.dense:
        await reload_base(s.url, model)
    async with contextlib.AsyncExitStack() as stack:
        proxies = [await stack.enter_async_context(RecordingProxy.open(s.url)) for s in servers.dense]
        # long replies, two steps' worth in flight: each sync's pause catches some mid-way
        job = RealJob(tmp_path, model, tuple(p.url for p in proxies), steps=STEPS, envs=("arith", "guess"),
                      batch_size=8, max_inflight=16, temperature=0.7, max_async_level=1,
                      env_sampling={"arith": {"max_tokens": 256, "extra_body": {"ignore_eos": True}},
                                    "guess": {"max_tokens": 4}},
                      pipeline={"gates": [], "filters": []})  # every rollout trains: long ones score 0
        learner = Keeper(model, TorchLearnConfig(lr=1e-2))
        result = await run_real_job(job, learner)
    assert [row["step"] for row in result.journal] == list(range(STEPS))
    sent = {k: g for p in proxies for k, g in p.by_tokens().items()}
    two = 0
    cut = {}  # per step: trained tokens its weights sampled after a sync cut their reply, from what the servers sent
    for step, ids, offsets, versions, mask, policies in learner.kept:
        cut[step] = 0
        for i in range(len(offsets) - 1):
            a, b = int(offsets[i]), int(offsets[i + 1])
            sample, column = ids[a:b].tolist(), versions[a:b]
            labels = set()
            for start, end in runs(column >= 0):  # each run of sampled tokens: one reply's completion
                g = sent[tuple(sample[:end])]
                assert len(g.prompt) == start
                spans = [(int(v["version"]), v["start"], v["end"]) for v in g.weight_versions]
                np.testing.assert_array_equal(column[start:end], expand(tuple(spans), end - start),
                                              err_msg=f"step {step} sample {i} tokens {start}:{end}")
                labels |= {v for v, _, _ in spans}
                for v, s, e in spans[1:]:  # after a cut: of newer weights than the reply's first span
                    if v == step > spans[0][0]:
                        cut[step] += int(np.count_nonzero(mask[a + start + s:a + start + e]))
            assert policies[i] <= min(labels)
            assert max(labels) <= step
            two += len(labels) > 1
    assert two >= 1, "no sample holds tokens of two versions: no reply was in flight at a sync"
    reports = [row["learned"] for row in result.journal]
    print("reports:", [{k: r[k] for k in ("own_tokens", "mismatch_max", "mixed_tokens", "mixed_max", "grad_norm")}
                       for r in reports])
    checked = [r for r in reports if r["own_tokens"]]  # step 0, and later steps' rollouts begun after their sync
    assert reports[0] in checked, [r["own_tokens"] for r in reports]
    # later steps have own tokens only if some rollout began after its sync: under load none may (seen in CI)
    assert max(r["mismatch_max"] for r in checked) <= PARITY, [r["mismatch_max"] for r in checked]
    # the tokens reported apart are exactly those after a cut in a reply, as the servers' replies say
    assert [r["mixed_tokens"] for r in reports] == [cut[s] for s in range(STEPS)], cut
    mixed = [r for r in reports if r["mixed_tokens"]]
    # vLLM keeps an in-flight request's KV cache across a keep-pause reload (observed on 0.32.0): if this fails,
    # it recomputes it now, and those tokens can join the parity check (trainer/versions.py cut_by_sync). A run
    # whose every cut reply finished after its step's batch was full trains none of them: nothing to compare
    assert not mixed or max(r["mixed_max"] for r in mixed) > 10 * PARITY, [r["mixed_max"] for r in mixed]
