"""The scoring stage's config section, ``[pipeline]``: the advantage function, the filters and the gates.

Imports only ``configbase`` and the scoring modules' own sections, so scoring never imports the job's config.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from orchestrator.configbase import Source, opt
from orchestrator.scoring.gates import DEFAULT_GATES, GateConfig


@dataclass(frozen=True, kw_only=True)
class FilterConfig:
    name: str = opt(doc="'zero_advantage', 'gibberish', 'repetition', or module:function(rollout, **args) -> bool")
    enforce: bool = opt(doc="true: matched rollouts are not trained on; false: only counted (monitor)")
    args: dict[str, Any] = opt({}, doc="keyword arguments of the filter")


DEFAULT_FILTERS = (
    FilterConfig(name="zero_advantage", enforce=True),
    FilterConfig(name="gibberish", enforce=False),
    FilterConfig(name="repetition", enforce=False),
)


@dataclass(frozen=True)
class PipelineConfig:
    advantage: str = opt("default", doc="'default' or module:function(group, **kwargs) -> list[float]")
    advantage_kwargs: dict[str, Any] = opt({}, doc="keyword arguments of the advantage function")
    std_normalize: bool = opt(False, doc="default advantage: divide by the group's reward std")
    filters: tuple[FilterConfig, ...] = opt(DEFAULT_FILTERS, doc="[[pipeline.filters]] tables, in order")
    gates: tuple[GateConfig, ...] = opt(DEFAULT_GATES, doc="[[pipeline.gates]] tables: which completed groups count "
                                        "toward a step (the step refills past rejected ones)")
    dump_steps: int | tuple[int, ...] = opt(0, ge=0, doc="step dumps in output_dir/dumps for offline replay: N dumps "
                                            "steps 0, N, 2N...; a list dumps those steps; 0 or [] dumps none")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        if isinstance(self.dump_steps, tuple):  # the bound ge=0 applies to the int form only
            for i, n in enumerate(self.dump_steps):
                if n < 0:
                    yield (f"{source(f'{key}.dump_steps[{i}]')}: {key}.dump_steps[{i}]: expected a step "
                           f"number >= 0, got {n}")
