"""Benchmark: building one long multi-turn sample vs a memcpy of the same output, in the same run.

One rollout of ``--turns`` turns and ``--tokens`` tokens with routed experts ``--layers`` x ``--top-k``
(default: 64 turns, 64k tokens, 48 x 8, as in a long agentic MoE rollout). Nodes carry Python lists for
token ids, masks and logprobs and a numpy array for routed experts, as verifiers' MessageNode does.

Prints: ``build_s`` (orchestrator.columns.samples.build_sample, with the ``versions`` column a vLLM 0.32+
rollout gets: every sampled node attributed to its generate call), ``build_without_versions_s``, ``memcpy_s``
(copying the output arrays: the physical floor), ``ratio_to_memcpy`` (target <= 3), and ``quadratic_s``, a
reference that re-packs the whole sample after every turn (what O(N^2) assembly costs). Last line with --json:
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from _machine import with_machine

from orchestrator.columns.samples import PlainNode as Node
from orchestrator.columns.samples import build_sample
from orchestrator.columns.versions import CallKey, CallSpans, TokenVersions, call_key


def make_nodes(turns: int, tokens: int, layers: int, top_k: int, seed: int = 0) -> list[Node]:
    rng = np.random.default_rng(seed)
    per_node = tokens // (2 * turns)
    nodes = []
    for _ in range(turns):
        for sampled in (False, True):
            ids = rng.integers(0, 150_000, per_node).tolist()
            mask = [sampled] * per_node
            lps = rng.normal(-1, 0.5, per_node).tolist() if sampled else []
            routed = rng.integers(0, 256, (per_node, layers, top_k), dtype=np.uint8)
            nodes.append(Node(ids, mask, lps, routed))
    return nodes


def versions_of(nodes: list[Node]) -> TokenVersions:
    """What a vLLM 0.32+ rollout's generate calls reported: each sampled node's tokens of one step (the worker's
    shim keeps these; the sample's ``versions`` column is built from them)."""
    calls: dict[CallKey, list[CallSpans]] = {}
    at = 0
    for node in nodes:
        if node.mask and node.mask[0]:
            calls[call_key(at, node.token_ids)] = [((1, 0, len(node.token_ids)),)]
        at += len(node.token_ids)
    return TokenVersions(0, calls)


def quadratic(nodes: list[Node]) -> float:
    """Re-pack the accumulated sample after every node (the anti-pattern), timed."""
    start = time.perf_counter()
    ids = np.zeros(0, np.int32)
    routed = np.zeros((0, *nodes[0].routed_experts.shape[1:]), np.uint8)
    for node in nodes:
        ids = np.concatenate([ids, np.asarray(node.token_ids, dtype=np.int32)])
        routed = np.concatenate([routed, node.routed_experts])
    return time.perf_counter() - start


def best(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=64)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--repeat", type=int, default=20, help="best of N runs, for build and memcpy alike")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args()

    nodes = make_nodes(args.turns, args.tokens, args.layers, args.top_k)
    versions = versions_of(nodes)
    sample = build_sample(nodes, versions)
    assert sample.routed_experts is not None
    assert sample.versions is not None
    assert versions.bounded == 0  # every sampled token attributed to its call
    routed = sample.routed_experts
    outputs = [sample.token_ids, sample.loss_mask, sample.logprobs, sample.versions, routed]
    build_s = best(lambda: build_sample(nodes, versions), args.repeat)
    plain_s = best(lambda: build_sample(nodes), args.repeat)
    memcpy_s = best(lambda: [np.copy(a) for a in outputs], args.repeat)
    quad_s = min(quadratic(nodes) for _ in range(max(1, args.repeat // 2)))
    result = {
        "turns": args.turns, "tokens": sample.num_tokens, "routed_mb": round(routed.nbytes / 2**20, 1),
        "build_s": round(build_s, 5), "build_without_versions_s": round(plain_s, 5), "memcpy_s": round(memcpy_s, 5),
        "ratio_to_memcpy": round(build_s / memcpy_s, 2), "quadratic_s": round(quad_s, 5),
        "quadratic_ratio": round(quad_s / build_s, 2),
    }
    if not args.json:
        print(f"build {build_s * 1e3:.1f} ms, memcpy {memcpy_s * 1e3:.1f} ms "
              f"(ratio {result['ratio_to_memcpy']}), re-pack per turn {quad_s * 1e3:.1f} ms")
    print(json.dumps(with_machine(result)))


if __name__ == "__main__":
    main()
