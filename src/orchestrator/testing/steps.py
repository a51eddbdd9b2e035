"""Synthetic step inputs: finished groups of rollout records shaped like an env worker's, without a run.

``synthetic_groups`` makes ``rollouts`` records in groups of ``group_size``; each record has one sample of
``tokens`` tokens over ``turns`` turns (half prompt, half sampled per turn), routed experts ``layers`` x
``top_k`` (none when either is 0), a ``versions`` column (policy 0 on the sampled tokens), binary rewards, and
the same header fields and column frames as ``worker.process.episode_record``. Seeded: the same arguments give
the same bytes. Used by tests and by ``scripts/perf`` (synthetic dumps, replay, bench_step). ``rollout_row`` makes
a rollout's row with only the fields a test of a row's reader cares about.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from orchestrator.columns.versions import NOT_SAMPLED
from orchestrator.config import EnvConfig, InferenceConfig, JobConfig, RunConfig, SchedulerConfig
from orchestrator.contracts.protocol import RolloutHeader, RolloutRecord
from orchestrator.contracts.rows import RolloutRow
from orchestrator.steps.dump import ReplayGroup

ENVS = ("synth-a", "synth-b")


def synthetic_config(rollouts: int, group_size: int = 8, run: str = "synthetic") -> JobConfig:
    """A job config for synthetic steps: default pipeline (advantages, filters), the two synthetic envs."""
    return JobConfig(run=RunConfig(name=run), inference=InferenceConfig(servers=("http://127.0.0.1:8000/v1",)),
                     scheduler=SchedulerConfig(batch_size=rollouts, max_inflight=max(64, group_size),
                                               max_buffered_rollouts=max(1024, rollouts)),
                     env=tuple(EnvConfig(name=e, taskset=f"synthetic.{e}", group_size=group_size) for e in ENVS))


def synthetic_record(rng: np.random.Generator, rid: str, gid: str, env: str, task: int, turns: int, tokens: int,
                     layers: int, top_k: int) -> RolloutRecord:
    """One successful rollout record with a single ``turns``-turn sample of ``tokens`` tokens."""
    turns = max(1, min(turns, tokens // 2 or 1))
    bounds = np.linspace(0, tokens, 2 * turns + 1).astype(np.int64)
    mask = np.zeros(tokens, np.uint8)
    for t in range(turns):  # the second half of each turn is what the policy sampled
        mask[bounds[2 * t + 1]:bounds[2 * t + 2]] = 1
    token_ids = rng.integers(0, 150_000, tokens, dtype=np.int32)
    logprobs = np.where(mask, rng.normal(-1.0, 0.5, tokens), 0.0).astype(np.float32)
    versions = np.where(mask, 0, NOT_SAMPLED).astype(np.int32)
    routed = (np.frombuffer(rng.bytes(tokens * layers * top_k), np.uint8) if layers and top_k
              else np.zeros(0, np.uint8))
    shape = (tokens, layers, top_k) if layers and top_k else (tokens, 0, 0)
    header = RolloutHeader(rid=rid, group=gid, env=env, task=task, policy_step=0, worker="synthetic",
                           server="synthetic", ok=True, reward=float(rng.integers(0, 2)), metrics={"correct": 1.0},
                           stop="length", samples=[shape], tokens=tokens, optional=["versions"],
                           wall_s=round(float(rng.uniform(1, 30)), 4), frames=5)
    frames = [a.data.cast("B") for a in (token_ids, mask, logprobs, versions, routed)]
    return RolloutRecord(header, frames)


def synthetic_groups(rollouts: int, turns: int, tokens: int, layers: int, top_k: int, *, group_size: int = 8,
                     seed: int = 0) -> list[ReplayGroup]:
    """``rollouts`` records in groups of ``group_size`` (the last group may be smaller), two environments."""
    rng = np.random.default_rng(seed)
    groups: list[ReplayGroup] = []
    for g, start in enumerate(range(0, rollouts, group_size)):
        size = min(group_size, rollouts - start)
        gid, env = f"g{g}", ENVS[g % len(ENVS)]
        group = ReplayGroup(gid, env, task=g, policy=0, size=size)
        group.records = [synthetic_record(rng, f"{gid}-{i}", gid, env, g, turns, tokens, layers, top_k)
                         for i in range(size)]
        groups.append(group)
    return groups


def rollout_row(**fields: Any) -> RolloutRow:
    """A successful rollout's row of step 0, with ``fields`` (any of ``RolloutRow``'s) instead of the defaults."""
    row = RolloutRow(step=0, env=ENVS[0], task=0, group="g0", rollout="g0-0", reward=0.0, advantage=0.0, ok=True,
                     filters=[], filtered=False, dropped=False, failure=None, error=None, tokens=0, policy=0,
                     off_policy=0, stop=None, wall_s=0.0, worker="synthetic")
    return msgspec.structs.replace(row, **fields)
