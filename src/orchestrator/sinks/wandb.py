"""Weights & Biases: every step's metrics (flattened to ``a/b`` keys), other prefixes' metrics (``eval/...``),
and a table of sample rollouts every ``samples_every`` steps (``samples``, or ``<prefix>/samples``).

Needs ``pip install 'rollout-orchestrator[wandb]'``. ``mode = "offline"`` writes the run under
``output_dir/wandb`` without network (``wandb sync`` uploads it later). W&B does not capture the process's
console (``console = "off"``): the orchestrator's log stays where it was. The run's id is kept in
``output_dir/wandb-run-id``, so ``orchestrator run --resume`` continues the same W&B run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.sinks.config import WandbConfig

RUN_ID_FILE = "wandb-run-id"


class WandbSink:
    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def open(cls, wb: WandbConfig, output_dir: Path, *, run_name: str, job: Mapping[str, Any],
             resume: bool = False) -> WandbSink:
        """Start (or, with ``resume`` and a saved id, continue) the run recording ``job``, the job's config.
        Blocking: W&B starts its service."""
        import wandb
        from wandb.sdk.lib.runid import generate_id

        id_file = output_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else generate_id()
        id_file.write_text(run_id + "\n")
        run = wandb.init(project=wb.project, entity=wb.entity, name=wb.name or run_name, mode=wb.mode,
                         tags=list(wb.tags), dir=str(output_dir), id=run_id, resume="allow" if resume else None,
                         config=dict(job), settings=wandb.Settings(console="off"))
        run.define_metric("eval/*", step_metric="eval/step")  # eval rows arrive after later steps: own axis
        return cls(run)

    def log(self, metrics: Mapping[str, Any], *, step: int, prefix: str = "") -> None:
        if prefix:  # W&B's own step only grows: a row about an earlier step goes on the prefix's axis
            self.run.log({**flatten(metrics, prefix), f"{prefix}/step": step})
        else:
            self.run.log(flatten(metrics, prefix), step=step)

    def log_samples(self, samples: Sequence[Mapping[str, Any]], *, step: int, prefix: str = "") -> None:
        import wandb

        if not samples:
            return
        columns = [str(c) for c in samples[0]]
        table = wandb.Table(columns=list[str | int](columns), data=[[s.get(c) for c in columns] for s in samples])
        self.run.log({f"{prefix}/samples" if prefix else "samples": table}, step=step)

    def close(self) -> None:
        """Finish the run and stop W&B's service process: ``finish`` alone can return before the service has
        written the run's log (an offline run read right after could be empty)."""
        import wandb

        self.run.finish()
        wandb.teardown()


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float | int]:
    """Nested metrics as ``{"a/b/c": number}``: numbers and booleans only (strings, lists and None are left out:
    the JSONL file keeps everything)."""
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name))
        elif isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, int | float):
            out[name] = value
        elif hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # a numpy scalar
            out[name] = value.item()
    return out
