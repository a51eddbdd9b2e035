"""``[monitor]``: the event-loop-lag monitor's bounds, and where metrics go besides metrics.jsonl
(``[monitor.wandb]``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from orchestrator.configbase import Source, opt


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases (``pip install 'rollout-orchestrator[wandb]'``); its API key comes from W&B's own
    login or ``WANDB_API_KEY``, never from this file."""

    project: str = opt(doc="W&B project")
    entity: str | None = opt(None, doc="W&B entity (team or user); unset: your default entity")
    name: str | None = opt(None, doc="run name; unset: run.name")
    mode: Literal["online", "offline", "disabled"] = opt(
        "online", doc="offline: write the run under output_dir/wandb, upload later with `wandb sync`")
    tags: tuple[str, ...] = opt((), doc="run tags")
    samples_every: int = opt(10, ge=0, doc="a table of sample rollouts (text, reward, advantage) every N steps; "
                             "0: none")
    samples: int = opt(8, ge=1, doc="rollouts in each samples table (the first rollout of the step's first groups)")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        if importlib.util.find_spec("wandb") is None:  # an optional dependency: say so before the run starts
            yield (f"{source(key)}: {key}: needs the wandb package: "
                   f"pip install 'rollout-orchestrator[wandb]' (or remove [{key}])")


@dataclass(frozen=True)
class MonitorConfig:
    lag_interval_s: float = opt(0.1, gt=0, le=10, doc="event-loop-lag sampling interval")
    lag_window: int = opt(4096, ge=16, doc="lag samples kept per step (oldest dropped first)")
    lag_warn_ms: float = opt(50.0, gt=0, doc="a stall longer than this is logged as a warning")
    lag_error_ms: float = opt(500.0, gt=0, doc="a stall longer than this is logged as an error")
    stall_warn_s: float = opt(30.0, gt=0, doc="liveness bound: a step that makes no progress for this long gets a "
                              "line saying what it waits for (a checkpoint, the trainer, workers, servers), again "
                              "every as long")
    wandb: WandbConfig | None = opt(None, doc="[monitor.wandb]: also log to Weights & Biases; unset: metrics.jsonl "
                                    "only")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        if self.lag_error_ms < self.lag_warn_ms:
            yield (f"{source(f'{key}.lag_error_ms')}: {key}.lag_error_ms: must be >= {key}.lag_warn_ms "
                   f"({self.lag_error_ms} < {self.lag_warn_ms})")
