"""An inference server's load, read from its Prometheus ``/metrics``: KV-cache usage, running and waiting
requests, preemptions.

vLLM exposes one sample per engine (label ``engine``; several with data parallelism) in these families
(read in vLLM 0.31.0's ``v1/metrics/loggers.py``; prime-rl's inference server is vLLM's, with the same):

- ``vllm:kv_cache_usage_perc`` (gauge, 0..1): the server's usage is its fullest engine's, since a group is
  pinned to a server and any of its engines may be the one that fills;
- ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges): summed over engines;
- ``vllm:num_requests_waiting_by_reason`` (gauge, label ``reason``: ``capacity`` or ``deferred``; 0.31 and
  later): the ``capacity`` ones, summed; None where the version does not have the family;
- ``vllm:num_preemptions`` (counter, written ``vllm:num_preemptions_total``; ``_created`` is skipped): summed;
- ``vllm:request_success`` (counter, written ``vllm:request_success_total``, one sample per ``finished_reason``;
  optional): requests that left the engine, summed: the denominator of the preemption rate;
- ``vllm:cache_config_info`` (a gauge at 1 whose labels are the engine's cache config; optional): the KV capacity
  in tokens, the sum over engines of the label ``kv_cache_size_tokens`` (each engine's own; vLLM 0.26, 0.31, 0.32
  and 0.33 all write it: ``config/cache.py`` ``CacheConfig.metrics_info``, ``v1/engine/core_client.py`` "Keep these
  as per-engine cache_config_info values"), else ``num_gpu_blocks`` x ``block_size`` (``num_gpu_blocks`` is already
  summed over a data-parallel server's engines there). A real vLLM 0.31 started with
  ``--num-gpu-blocks-override 16`` wrote ``num_gpu_blocks="16"``, ``block_size="128"``,
  ``kv_cache_size_tokens="2048"`` (2026-11-28). None where the family is missing.

``parse_load`` is pure and refuses, with a ``LoadUnreadable`` naming the cause, text in which a family it needs
is missing or a value is not a finite number: such a server keeps its static cap (the controller's rule).
Lines of other families (a real server has a few hundred) are not parsed beyond their name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

USAGE, RUNNING, WAITING = "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"
BY_REASON, PREEMPTIONS = "vllm:num_requests_waiting_by_reason", "vllm:num_preemptions_total"
CACHE_CONFIG, FINISHED = "vllm:cache_config_info", "vllm:request_success_total"
_NEEDED = (USAGE, RUNNING, WAITING, PREEMPTIONS)
_WANTED = frozenset((*_NEEDED, BY_REASON, CACHE_CONFIG, FINISHED))
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class LoadUnreadable(ValueError):
    """A ``/metrics`` text the load cannot be read from; ``str()`` says why."""


@dataclass(frozen=True)
class ServerLoad:
    usage: float  # KV-cache usage of the fullest engine, 0..1
    running: int
    waiting: int
    waiting_for_capacity: int | None  # None: the server does not break ``waiting`` down by reason
    preemptions: int  # cumulative since the server started
    engines: int
    capacity_tokens: int | None = None  # the KV cache's size in tokens (all engines); None: not advertised
    finished: int | None = None  # requests finished since the server started; None: not counted


def parse_load(text: str) -> ServerLoad:
    """The load in a ``/metrics`` exposition (LoadUnreadable: a needed family is missing or malformed)."""
    values: dict[str, list[tuple[str, float]]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(" ", 1)[0]
        if name not in _WANTED:
            continue
        labels, value = _sample(line, brace, number)
        values.setdefault(name, []).append((labels, value))
    missing = [n for n in _NEEDED if n not in values]
    if missing:
        raise LoadUnreadable(f"no {', '.join(missing)} in the metrics (not a vLLM server, or a version without them)")
    engines = {_label(labels, "engine") for labels, _ in values[USAGE]}
    capacity = [v for labels, v in values.get(BY_REASON, []) if _label(labels, "reason") == "capacity"]
    return ServerLoad(usage=max(v for _, v in values[USAGE]), running=_total(values[RUNNING]),
                      waiting=_total(values[WAITING]), waiting_for_capacity=round(sum(capacity)) if capacity else None,
                      preemptions=_total(values[PREEMPTIONS]), engines=len(engines),
                      capacity_tokens=_capacity([labels for labels, _ in values.get(CACHE_CONFIG, [])]),
                      finished=_total(values[FINISHED]) if FINISHED in values else None)


def _capacity(engines: list[str]) -> int | None:
    """The KV capacity in tokens from each engine's ``vllm:cache_config_info`` labels (module docstring)."""
    sizes = [_label(labels, "kv_cache_size_tokens") for labels in engines]
    if sizes and all(s.isdigit() for s in sizes):
        return sum(int(s) for s in sizes) or None
    blocks = [(_label(labels, "num_gpu_blocks"), _label(labels, "block_size")) for labels in engines]
    known = [int(n) * int(b) for n, b in blocks if n.isdigit() and b.isdigit()]
    return max(known) or None if known else None


def _sample(line: str, brace: int, number: int) -> tuple[str, float]:
    """A sample line's label text and value (a timestamp after the value is ignored)."""
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            raise LoadUnreadable(f"line {number}: unclosed labels: {line[:120]!r}")
        labels, rest = line[brace + 1:close], line[close + 1:]
    else:
        labels, rest = "", line.split(" ", 1)[1] if " " in line else ""
    fields = rest.split()
    try:
        value = float(fields[0])
    except (IndexError, ValueError):
        raise LoadUnreadable(f"line {number}: no number after the name: {line[:120]!r}") from None
    if not math.isfinite(value) or value < 0:
        raise LoadUnreadable(f"line {number}: {value} is not a load: {line[:120]!r}")
    return labels, value


def _label(labels: str, key: str) -> str:
    for m in _LABEL.finditer(labels):
        if m[1] == key:
            return str(m[2])
    return ""


def _total(samples: list[tuple[str, float]]) -> int:
    return round(sum(v for _, v in samples))
