"""verifiers' TrainClient against the simulated server: token ids, logprobs and routed experts come back.

verifiers is imported lazily inside the test (its import costs ~6 s) and writes its cache under a
temporary HOME.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.assets import tokenizer_dir
from orchestrator.testing.sim import sim_servers

LAYERS, TOP_K = 3, 2


async def run_group(url: str, n: int) -> list[Any]:
    import verifiers.v1 as vf
    from renderers.configs import DefaultRendererConfig

    cfg = vf.resolve_env_config({"taskset": {"id": "orchestrator-arithmetic", "num_tasks": 4},
                                 "agent": {"runtime": {"type": "subprocess"}}})
    env = vf.load_environment(cfg)
    task = next(iter(env.taskset))
    client = vf.TrainClientConfig(base_url=url, renderer=DefaultRendererConfig(),
                                  renderer_model_name=str(tokenizer_dir()))
    ctx = vf.ModelContext(model="sim-model", client=client, sampling=vf.SamplingConfig(max_tokens=12))
    async with env.serving():
        return [await env.run_slot(slot, ctx) for slot in env.slots(task, n)]


@pytest.mark.slow
async def test_train_client_gets_token_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    async with sim_servers(1, layers=LAYERS, top_k=TOP_K) as [srv]:
        episodes = await run_group(srv.url, 3)
        assert srv.counters.requests >= 3
    rewards = []
    for ep in episodes:
        assert ep.ok, ep.errors
        trace = ep.traces[0]
        assert trace.ok, trace.errors
        rewards.append(trace.reward)
        sampled = [node for node in trace.nodes if any(node.mask)]
        assert sampled, "no node with sampled tokens"
        for node in sampled:
            n_sampled = sum(node.mask)
            assert len(node.token_ids) == len(node.mask)
            assert len(node.logprobs) == n_sampled
            assert all(np.isfinite(lp) and lp < 0 for lp in node.logprobs)
            experts = node.routed_experts
            assert isinstance(experts, np.ndarray)
            assert experts.dtype == np.uint8
            assert experts.shape[1:] == (LAYERS, TOP_K)
            assert experts.shape[0] == len(node.token_ids)
        for branch in trace.branches:
            assert len(branch.token_ids) == len(branch.sampled_mask)
    assert all(0.0 <= r <= 1.0 for r in rewards)
