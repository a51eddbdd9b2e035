"""The job builder tests use (orchestrator.testing.jobs): what it writes is the TOML it was given."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from orchestrator.testing.jobs import ARITHMETIC, job_config, toml_text, write_job_toml


def test_sections_tables_arrays_and_inline_tables_read_back_as_given() -> None:
    text = toml_text(run={"name": "t", "max_steps": 3, "output_dir": Path("/x/out")},
                     inference={"servers": ["http://a/v1"], "request_timeout_s": 1.5, "weights_path": 'a "b" é 🙂'},
                     pipeline={"gates": [], "dump_steps": [1, 2]}, monitor={"wandb": {"tags": ["t"], "samples": 2}},
                     transport={}, env=[ARITHMETIC, {**ARITHMETIC, "name": "two", "args": {"max_turns": 3}}],
                     eval=[], scheduler={"dotted.key": True, "inf": float("inf")})
    assert tomllib.loads(text) == {
        "run": {"name": "t", "max_steps": 3, "output_dir": "/x/out"},
        "inference": {"servers": ["http://a/v1"], "request_timeout_s": 1.5, "weights_path": 'a "b" é 🙂'},
        "pipeline": {"gates": [], "dump_steps": [1, 2]}, "monitor": {"wandb": {"tags": ["t"], "samples": 2}},
        "env": [dict(ARITHMETIC), {**ARITHMETIC, "name": "two", "args": {"max_turns": 3}}],
        "scheduler": {"dotted.key": True, "inf": float("inf")}}  # empty sections left out: their defaults


def test_a_value_toml_cannot_hold_is_refused() -> None:
    with pytest.raises(TypeError, match="no TOML for None"):
        toml_text(run={"seed": None})


def test_the_output_dir_defaults_to_out_beside_the_file_and_the_job_loads(tmp_path: Path) -> None:
    path = write_job_toml(tmp_path / "j", run={"name": "t"}, inference={"servers": ["http://127.0.0.1:9/v1"]},
                          scheduler={"batch_size": 8}, env=[ARITHMETIC])
    assert path == tmp_path / "j" / "job.toml"
    assert tomllib.loads(path.read_text())["run"]["output_dir"] == str(tmp_path / "j" / "out")
    cfg = job_config(tmp_path / "k", overrides=["run.seed=7"], run={"name": "t", "max_steps": 2},
                     inference={"servers": ["http://127.0.0.1:9/v1"]}, scheduler={"batch_size": 8}, env=[ARITHMETIC])
    assert (cfg.run.output_dir, cfg.run.max_steps, cfg.run.seed) == (str(tmp_path / "k" / "out"), 2, 7)
    assert [(e.taskset, e.group_size, e.workers) for e in cfg.env] == [("orchestrator-arithmetic", 4, 1)]
