"""Resolve the ``[pipeline]`` hooks at load time, so one that cannot run is a config error before anything starts.

Called by the config loader (config.py imports scoring, never the reverse).
"""

from __future__ import annotations

from orchestrator.configbase import Source
from orchestrator.errors import ConfigError
from orchestrator.scoring.advantage import AdvantageFn
from orchestrator.scoring.config import PipelineConfig
from orchestrator.scoring.filters import FilterSet


def hook_problems(pipeline: PipelineConfig, source: Source) -> list[str]:
    """Build the advantage function and the filters once: a hook that cannot be imported, or arguments a
    filter does not take, are named here (not a failure minutes into the run)."""
    problems: list[str] = []
    for build in (lambda: AdvantageFn(pipeline), lambda: FilterSet(pipeline.filters, vocab_size=2**17)):
        try:
            build()
        except ConfigError as e:  # each problem starts with its key; the source is the key's without ".args"
            problems += [f"{source(p.split(':', 1)[0].split('.args')[0])}: {p}" for p in e.problems]
    return problems
