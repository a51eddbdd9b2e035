"""Where metrics go: a ``MetricsSink`` per tracker, ``metrics.jsonl`` always, Weights & Biases optionally.

See ``base.py`` for the interface and ``open_sinks`` for how ``[monitor]`` chooses them.
"""

from orchestrator.sinks.base import MetricsSink, Sinks, open_sinks
from orchestrator.sinks.jsonl import JsonlSink
from orchestrator.sinks.wandb import flatten

__all__ = ["JsonlSink", "MetricsSink", "Sinks", "flatten", "open_sinks"]
