"""verifiers' own TrainClient against the simulated server: the cross-check that the simulator's replies are
the real servers' (what verifiers 0.4.0 parses from prime-rl works; what it cannot parse from vLLM fails here
too).

verifiers is imported lazily inside the test (its import costs ~6 s) and writes its cache under a
temporary HOME.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.assets import tokenizer_dir
from orchestrator.sim.profiles import ProfileName
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


def sampled_nodes(episodes: list[Any]) -> list[Any]:
    nodes = []
    for ep in episodes:
        assert ep.ok, ep.errors
        trace = ep.traces[0]
        assert trace.ok, trace.errors
        assert 0.0 <= trace.reward <= 1.0
        for branch in trace.branches:
            assert len(branch.token_ids) == len(branch.sampled_mask)
        sampled = [node for node in trace.nodes if any(node.mask)]
        assert sampled, "no node with sampled tokens"
        for node in sampled:
            assert len(node.token_ids) == len(node.mask)
            assert len(node.logprobs) == sum(node.mask)
            assert all(np.isfinite(lp) and lp < 0 for lp in node.logprobs)
        nodes += sampled
    return nodes


@pytest.mark.slow
@pytest.mark.parametrize("num_experts", [64, 512])
async def test_prime_rl_replies_parse_with_routed_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         num_experts: int) -> None:
    """prime-rl's reply (routed experts as {data, shape, start, dtype}, tokens - 1 rows) is what verifiers
    reads: every node gets one row per token, in the dtype the server chose (uint16 above 255)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    async with sim_servers(1, profile="prime-rl", layers=LAYERS, top_k=TOP_K, num_experts=num_experts) as [srv]:
        episodes = await run_group(srv.url, 3)
        assert srv.counters.requests >= 3
    nodes = sampled_nodes(episodes)
    for node in nodes:
        experts = node.routed_experts
        assert isinstance(experts, np.ndarray)
        assert experts.dtype == (np.uint16 if num_experts > 256 else np.uint8)
        assert experts.shape == (len(node.token_ids), LAYERS, TOP_K)
        assert int(experts.max()) < num_experts
    if num_experts > 256:
        assert max(int(n.routed_experts.max()) for n in nodes) > 255  # ids above uint8 arrive intact


@pytest.mark.slow
async def test_vllm_0_26_replies_parse_without_routed_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    async with sim_servers(1, profile="vllm-0.26") as [srv]:
        episodes = await run_group(srv.url, 2)
    assert all(node.routed_experts is None for node in sampled_nodes(episodes))


@pytest.mark.slow
async def test_the_built_in_harness_keeps_one_client_for_all_rollouts(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rollout has its own secret; the harness sends it per request, so its clients (and their connection
    pools) do not pile up one per rollout in a long-running worker."""
    from orchestrator.envs import harness

    monkeypatch.setenv("HOME", str(tmp_path))
    before = set(harness._clients)
    async with sim_servers(1) as [srv]:
        episodes = await run_group(srv.url, 4)
    sampled_nodes(episodes)  # every rollout authenticated and scored
    assert len(set(harness._clients) - before) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("profile", "layers", "refusal"), [
    ("vllm-0.33", 0, "logprobs.content[0].token must be"),  # {"token_id": N} entries, no "token" string
    ("vllm-0.26", LAYERS, "string indices must be integers"),  # routed experts as a .npy string, not an object
])
async def test_verifiers_rejects_what_real_servers_send_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           profile: ProfileName, layers: int, refusal: str) -> None:
    """The real incompatibilities (research doc, section 5): the server answers 200, verifiers' client fails."""
    monkeypatch.setenv("HOME", str(tmp_path))
    async with sim_servers(1, profile=profile, layers=layers, top_k=TOP_K if layers else 0) as [srv]:
        [episode] = await run_group(srv.url, 1)
        assert [g.status for g in srv.log.generate] == [200]
    assert not episode.ok
    errors = [e.message for trace in episode.traces for e in trace.errors]
    assert any(refusal in message for message in errors), errors
