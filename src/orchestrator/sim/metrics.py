"""``GET /metrics``: the engine's load in vLLM's Prometheus families, as its exposition text carries them.

The families and their help texts are vLLM 0.31's (``v031:v1/metrics/loggers.py``, ``PrometheusStatLogger``),
one sample per engine labelled ``engine`` and ``model_name``; prometheus_client writes a counter ``X`` as
``X_total`` (with ``X_created``), a gauge under its own name. Only what the orchestrator reads is simulated:

- ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:num_requests_waiting_by_reason``
  (``capacity``: waiting for KV blocks; ``deferred``: never, here);
- ``vllm:kv_cache_usage_perc`` (0..1, despite its name);
- ``vllm:num_preemptions`` (a counter).

Without a KV model (sim/kv.py) the cache is never used and nothing waits: ``running`` counts the requests inside
the engine (admitted, not answered).
"""

from __future__ import annotations

from orchestrator.sim.kv import KVLoad

_FAMILIES = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("vllm:num_requests_waiting_by_reason", "gauge",
     "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
     "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
     "reasons equals vllm:num_requests_waiting."),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."),
)


def exposition(model: str, load: KVLoad, created: float) -> str:
    """The text ``/metrics`` answers (content type ``text/plain; version=0.0.4``)."""
    labels = f'engine="0",model_name="{_escape(model)}"'
    values = {
        "vllm:num_requests_running": [("", float(load.running))],
        "vllm:num_requests_waiting": [("", float(load.waiting))],
        "vllm:num_requests_waiting_by_reason": [(',reason="capacity"', float(load.waiting)),
                                                (',reason="deferred"', 0.0)],
        "vllm:kv_cache_usage_perc": [("", load.usage)],
    }
    lines = []
    for name, kind, doc in _FAMILIES:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        if kind == "counter":
            lines += [f"{name}_total{{{labels}}} {float(load.preemptions)!r}",
                      f"{name}_created{{{labels}}} {created!r}"]
        else:
            lines += [f"{name}{{{labels}{extra}}} {value!r}" for extra, value in values[name]]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
