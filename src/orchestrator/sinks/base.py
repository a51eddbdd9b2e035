"""The metrics sink interface and the fan-out the orchestrator writes through.

A sink takes any dict of metrics for a step, under a prefix (``""`` for the training step's metrics, e.g.
``"eval"`` for evaluation rows), and a small table of sample rollouts. Its methods block (files, a tracker's
client): the orchestrator calls them from its step thread, never on the event loop. ``Sinks`` sends each call
to every sink and says when a samples table is due, so the rollouts' text is decoded only then.

::

    sinks = open_sinks(cfg.monitor, output_dir, run_name=cfg.run.name, job=dataclasses.asdict(cfg))
                                                        # metrics.jsonl, plus W&B with [monitor.wandb]
    sinks.log(metrics, step=3)                          # metrics.jsonl and W&B
    sinks.log_eval({"envs": ...}, step=3)               # metrics.jsonl ("eval": true) and W&B's eval/...
    if sinks.samples_due(3): sinks.log_samples(table_rows, step=3)
    sinks.close()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from orchestrator.sinks.config import MonitorConfig


class MetricsSink(Protocol):
    """One place metrics go. Blocking; called from one thread at a time."""

    def log(self, metrics: Mapping[str, Any], *, step: int, prefix: str = "") -> None:
        """Record ``metrics`` (nested dicts allowed) for ``step`` under ``prefix``."""

    def log_samples(self, samples: Sequence[Mapping[str, Any]], *, step: int, prefix: str = "") -> None:
        """Record a table of sample rollouts (one dict of scalars and text per rollout)."""

    def close(self) -> None:
        """Flush and release whatever the sink holds (files, a tracker's run)."""


class Sinks:
    """Every configured sink; ``samples_every`` steps (0: never) a samples table is due."""

    def __init__(self, sinks: Sequence[MetricsSink], samples_every: int = 0, samples: int = 0) -> None:
        self.sinks = list(sinks)
        self.samples_every = samples_every
        self.samples = samples  # rollouts per samples table

    def samples_due(self, step: int) -> bool:
        return self.samples_every > 0 and self.samples > 0 and step % self.samples_every == 0

    def log(self, metrics: Mapping[str, Any], *, step: int, prefix: str = "") -> None:
        for sink in self.sinks:
            sink.log(metrics, step=step, prefix=prefix)

    def log_eval(self, metrics: Mapping[str, Any], *, step: int) -> None:
        """Evaluation metrics of the policy of ``step``: ``log`` under the prefix ``"eval"``."""
        self.log(metrics, step=step, prefix="eval")

    def log_samples(self, samples: Sequence[Mapping[str, Any]], *, step: int, prefix: str = "") -> None:
        for sink in self.sinks:
            sink.log_samples(samples, step=step, prefix=prefix)

    def close(self) -> None:
        """Close every sink, even when one fails (the first failure is raised after the others closed)."""
        errors: list[BaseException] = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # each sink gets its close
                errors.append(e)
        if errors:
            raise errors[0]


def open_sinks(monitor: MonitorConfig, output_dir: Path, *, run_name: str, job: Mapping[str, Any],
               resume: bool = False) -> Sinks:
    """``metrics.jsonl`` in ``output_dir``, and a W&B run when ``[monitor.wandb]`` is set (``resume``: the
    run of the previous attempt, when its id was saved), named ``run_name`` unless it names itself and
    recording ``job`` (the job's config, as plain data). Blocking: W&B starts its service process here."""
    from orchestrator.sinks.jsonl import JsonlSink

    sinks: list[MetricsSink] = [JsonlSink(output_dir)]
    wb = monitor.wandb
    if wb is None:
        return Sinks(sinks)
    from orchestrator.sinks.wandb import WandbSink

    sinks.append(WandbSink.open(wb, output_dir, run_name=run_name, job=job, resume=resume))
    return Sinks(sinks, wb.samples_every, wb.samples)
