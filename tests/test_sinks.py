"""Metrics sinks: metrics.jsonl always, Weights & Biases in offline mode (no network), read back from the files
W&B wrote (orchestrator.testing.wandb_offline)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.app import Orchestrator
from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError
from orchestrator.sinks import JsonlSink, flatten, open_sinks
from orchestrator.testing.jobs import ARITHMETIC, Section, job_config
from orchestrator.testing.sim import sim_servers
from orchestrator.testing.wandb_offline import offline_runs, read_offline_run
from orchestrator.trainer.reference import ReferenceTrainer


def wandb(tag: str, every: int) -> Section:
    """A ``[monitor.wandb]`` section, offline."""
    return {"project": "orchestrator-tests", "name": f"offline-{tag}", "mode": "offline", "tags": ["test", tag],
            "samples_every": every, "samples": 2}


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # W&B's and verifiers' settings and caches
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network, whatever a config says
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))


def job(tmp_path: Path, url: str = "http://127.0.0.1:9/v1", wandb: Section | None = None, steps: int = 2,
        data_plane: str = "through") -> JobConfig:
    return job_config(
        tmp_path, run={"name": "sinks", "max_steps": steps},
        inference={"servers": [url], "request_timeout_s": 10.0}, scheduler={"batch_size": 8, "max_inflight": 8},
        transport={"data_plane": data_plane}, env=[{**ARITHMETIC, "name": "arith", "sampling": {"max_tokens": 6}}],
        monitor={"wandb": wandb} if wandb else {})


def test_flatten_keeps_numbers_under_slash_keys() -> None:
    flat = flatten({"a": 1, "b": {"c": 2.5, "d": {"e": True}}, "s": "text", "n": None, "l": [1]}, "eval")
    assert flat == {"eval/a": 1, "eval/b/c": 2.5, "eval/b/d/e": 1}


def test_check_names_the_missing_wandb_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python spells "not installed" to find_spec
    with pytest.raises(ConfigError) as e:
        job(tmp_path, wandb=wandb("x", 1))
    (problem,) = e.value.problems
    assert "job.toml: monitor.wandb: needs the wandb package: pip install 'rollout-orchestrator[wandb]'" in problem
    job(tmp_path)  # without [monitor.wandb], nothing needs it


def test_jsonl_sink_writes_one_file_with_other_prefixes_marked(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path)
    sink.log({"reward": 0.5}, step=3)
    sink.log({"envs": {"arith": {"pass@1": 0.25}}, "at_step": 4}, step=3, prefix="eval")
    sink.log_samples([{"text": "x"}], step=3)  # rollouts.jsonl has every rollout: nothing more here
    lines = [orjson.loads(x) for x in (tmp_path / "metrics.jsonl").read_bytes().splitlines()]
    assert lines == [{"step": 3, "reward": 0.5}, {"step": 3, "eval": True, "envs": {"arith": {"pass@1": 0.25}},
                                                  "at_step": 4}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_wandb_gets_every_metric_eval_metrics_and_sample_tables(tmp_path: Path) -> None:
    cfg = job(tmp_path, wandb=wandb("unit", 2))
    out = tmp_path / "out"
    sinks = open_sinks(cfg.monitor, out, run_name=cfg.run.name, job=dataclasses.asdict(cfg))
    try:
        for step in range(3):
            sinks.log({"rollouts": 8, "reward_mean": {"arith": step / 10}, "sent": True, "note": "x"}, step=step)
            if sinks.samples_due(step):
                sinks.log_samples([{"rollout": f"g{step}-0", "reward": 0.5, "completion": "42"}], step=step)
        sinks.log_eval({"reward_mean": {"arith": 0.9}}, step=2)  # what an eval section would send
    finally:
        sinks.close()
    assert [sinks.samples_due(s) for s in range(5)] == [True, False, True, False, True]
    (run_dir,) = offline_runs(out)
    run = read_offline_run(run_dir)
    assert run.name == "offline-unit"
    assert run.tags == ["test", "unit"]
    assert run.config["run"]["name"] == "sinks"  # the job's config, for comparing runs
    steps: dict[int, dict[str, Any]] = {}
    for row in run.history:
        steps.setdefault(row["_step"], {}).update(row)
    assert sorted(s for s, row in steps.items() if "rollouts" in row) == [0, 1, 2]
    assert [steps[s]["reward_mean/arith"] for s in range(3)] == [0.0, 0.1, 0.2]
    assert steps[1]["rollouts"] == 8
    assert steps[1]["sent"] == 1
    assert "note" not in steps[1]  # text stays in metrics.jsonl
    (evals,) = [row for row in steps.values() if "eval/reward_mean/arith" in row]
    assert (evals["eval/reward_mean/arith"], evals["eval/step"]) == (0.9, 2)  # on its own axis
    assert [run.table(steps[s]["samples"]) for s in (0, 2)] == [
        [{"rollout": "g0-0", "reward": 0.5, "completion": "42"}],
        [{"rollout": "g2-0", "reward": 0.5, "completion": "42"}]]
    assert "samples" not in steps[1]
    lines = [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert [m.get("note") for m in lines] == ["x", "x", "x", None]  # metrics.jsonl, as always
    assert lines[-1] == {"step": 2, "eval": True, "reward_mean": {"arith": 0.9}}  # the eval row, marked


@pytest.mark.slow
async def test_a_run_logs_to_wandb_offline_and_reads_back(tmp_path: Path, data_plane: str) -> None:
    """Direct mode too: the samples table's token text is read back from the env workers' pools."""
    async with sim_servers(1) as servers:
        cfg = job(tmp_path, servers[0].url, wandb=wandb("run", 1), steps=2, data_plane=data_plane)
        async with Orchestrator.open(cfg) as orch:
            trainer = ReferenceTrainer(orch.sender.address, max_steps=2, checkpoint_dir=tmp_path / "ckpt")
            # a hang guard, env workers' start-up included: importing verifiers took over 90 s with the machine
            # at a load of ~9 (a flake of this guard at 100 s)
            async with asyncio.timeout(300), asyncio.TaskGroup() as tg:
                tg.create_task(trainer.run())
                await orch.run()
    out = tmp_path / "out"
    metrics = [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()]
    (run_dir,) = offline_runs(out)
    run = read_offline_run(run_dir)
    steps: dict[int, dict[str, Any]] = {}
    for row in run.history:
        steps.setdefault(int(row["_step"]), {}).update(row)
    assert sorted(steps) == [0, 1]
    for m in metrics:
        logged = steps[m["step"]]
        assert logged["rollouts"] == m["rollouts"]
        assert logged["reward_mean/arith"] == pytest.approx(m["reward_mean"]["arith"])
        assert logged["lag/p99"] == pytest.approx(m["lag"]["p99"])
        assert logged["phase_s/wait"] == pytest.approx(m["phase_s"]["wait"])
        table = run.table(logged["samples"])
        assert 1 <= len(table) <= 2
        rows = {r["rollout"]: r for r in map(orjson.loads, (out / "rollouts.jsonl").read_bytes().splitlines())}
        for sample in table:
            row = rows[sample["rollout"]]
            assert (sample["step"], sample["env"], sample["reward"]) == (m["step"], "arith", row["reward"])
            assert "what is" in sample["prompt"]  # decoded with the model's (here: lowercasing) tokenizer
            assert sample["completion"]
    assert (out / "wandb-run-id").read_text().strip() == run_dir.name.rsplit("-", 1)[-1]
