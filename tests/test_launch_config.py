"""``[launch]`` and what is made of it without a cluster: the section is checked like every other (a bad key exits 2
naming it), roles are placed on an allocation's nodes as written, commands are filled in, and the sbatch script
``--dry-run`` prints is valid bash with the flags the section asks for; the allocation's runner tells a step that
died from one that SLURM's stop reached first. The script runs on a real SLURM in test_launch_slurm.py."""

from __future__ import annotations

import asyncio
import shlex
import subprocess
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.launch.allocation import Allocation, JobEnded
from orchestrator.launch.config import fill, placeholders
from orchestrator.launch.plan import Plan, PlanError, assign
from orchestrator.launch.sbatch import JobFiles

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "launch_demo.toml"
VLLM = REPO / "configs" / "launch_vllm.toml"


@pytest.mark.parametrize(("override", "key", "says"), [
    ("launch.servers.gpus=8", "launch.servers.gpus", "unknown key"),
    ('launch.servers.nodes="two"', "launch.servers.nodes", "expected an integer"),
    ("launch.servers.per_node=0", "launch.servers.per_node", "expected a value >= 1"),
    ('launch.servers.command="vllm serve M --port {porrt}"', "launch.servers.command", "unknown placeholder {porrt}"),
    ('launch.trainer.env={ X = "{port}" }', "launch.trainer.env.X", "unknown placeholder {port}"),
    ('launch.env_workers.share="trainer"', "launch.env_workers.share", "not both"),
    ('launch.orchestrator.share="nobody"', "launch.orchestrator.share", "expected one of"),
    ('launch.servers.nodelist=["a", "b"]', "launch.servers.nodelist", "give a count or names, not both"),
    ("launch.orchestrator.worker_port=5556", "launch.orchestrator.worker_port", "collides with trainer_port"),
    ('transport.kind="filesystem"', "transport.kind", "connects the trainer over zmq"),
    ("launch.ready_timeout_s=0", "launch.ready_timeout_s", "expected a value > 0"),
])
def test_a_bad_launch_section_exits_2_naming_the_key(override: str, key: str, says: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "slurm", str(DEMO), "--dry-run", "--set", override]) == 2
    err = capsys.readouterr().err
    assert f"{key}:" in err, err
    assert says in err, err


def test_servers_without_a_command_and_a_trainer_without_one_are_named(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "job.toml").write_text("""
[inference]

[scheduler]
batch_size = 8

[[env]]
taskset = "orchestrator-arithmetic"
group_size = 2

[launch.servers]
nodes = 1

[launch.trainer]
nodes = 1
""")
    assert main(["check", str(tmp_path / "job.toml")]) == 2
    err = capsys.readouterr().err
    assert "launch.servers.command: required with nodes" in err
    assert "launch.trainer.command: required" in err


def test_a_job_without_launch_cannot_be_launched(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "slurm", str(REPO / "configs" / "demo.toml"), "--dry-run"]) == 2
    assert "this job has no [launch] section" in capsys.readouterr().err


def test_roles_take_the_allocations_nodes_in_order() -> None:
    launch = load_config(VLLM).launch
    assert launch is not None
    nodes = ["gpu1", "gpu2", "cpu1", "gpu3", "gpu4"]
    assert assign(launch, nodes) == {"servers": ("gpu1", "gpu2"), "env_workers": ("cpu1",),
                                     "orchestrator": ("cpu1",), "trainer": ("gpu3", "gpu4")}
    with pytest.raises(PlanError, match=r"launch\.trainer: needs 2 node"):
        assign(launch, nodes[:4])
    plan = Plan.make(launch, nodes, {n: f"10.0.0.{i}" for i, n in enumerate(nodes)})
    assert plan.server_urls[:2] == ["http://10.0.0.0:8000/v1", "http://10.0.0.0:8001/v1"]
    assert len(plan.server_urls) == 16
    assert (plan.worker_address, plan.trainer_address, plan.master_addr) == (
        "tcp://10.0.0.2:5600", "tcp://10.0.0.2:5555", "10.0.0.3")


def test_named_nodes_are_taken_first(tmp_path: Path) -> None:
    cfg = load_config(DEMO, ['launch.trainer.nodelist=["n9"]', "launch.trainer.nodes=0"])
    assert cfg.launch is not None
    assert assign(cfg.launch, ["n1", "n9", "n2"]) == {"servers": ("n1",), "env_workers": ("n2",),
                                                      "orchestrator": ("n2",), "trainer": ("n9",)}
    with pytest.raises(PlanError, match="n9 not in the allocation"):
        assign(cfg.launch, ["n1", "n2", "n3"])


def test_placeholders_leave_the_shells_own() -> None:
    text = "torchrun --node-rank $SLURM_NODEID --rdzv ${MASTER:-x} {master_addr}:{master_port} {{literal}}"
    assert placeholders(text) == ["master_addr", "master_port"]
    assert fill(text, {"master_addr": "h", "master_port": 1}) == (
        "torchrun --node-rank $SLURM_NODEID --rdzv ${MASTER:-x} h:1 {{literal}}")


def test_the_dry_run_script_is_bash_with_the_sections_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "slurm", str(VLLM), "--dry-run", "--set", "run.max_steps=7"]) == 0
    script = capsys.readouterr().out
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
    flags = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    job_dir = tmp_path / "outputs" / "qwen3-8b-math" / "launch"
    assert flags == ["--job-name=qwen3-8b-math", "--nodes=5", "--ntasks-per-node=1", f"--chdir={tmp_path}",
                     f"--output={job_dir}/logs/job.log", "--open-mode=append", "--partition=gpu",
                     "--time=2-00:00:00", "--exclusive", "--requeue", "--gres=gpu:8", "--mem=0"]
    assert "source /shared/venvs/rl/bin/activate" in script.splitlines()
    last = shlex.split(script.splitlines()[-1])
    assert last == ["exec", "/shared/venvs/rl/bin/python", "-m", "orchestrator", "launch", "allocation", str(VLLM),
                    "--job-dir", str(job_dir), "--set", "run.max_steps=7"]
    assert (job_dir / "logs").is_dir()  # sbatch opens --output there before the script runs
    assert not (job_dir / "job.sbatch").exists()  # a dry run submits and keeps nothing


@pytest.mark.parametrize("slurm_says", ["CANCELLED", "RUNNING"])
async def test_a_trainer_that_ends_before_the_runner_hears_slurm_s_stop_is_stopped_not_failed(
        tmp_path: Path, slurm_says: str) -> None:
    """slurmd signals a job's steps one by one, node by node: the trainer (which exits at once on SIGTERM, status
    130) can end before the batch step's runner is signalled. The runner asks SLURM then: a job SLURM is ending
    is stopped, its trainer's exit part of the stop; in a job that runs on, the same exit ends it as failed."""
    cfg = load_config(DEMO)
    assert cfg.launch is not None
    nodes = ["n1", "n2", "n3"]
    plan = Plan.make(cfg.launch, nodes, {n: f"10.0.0.{i}" for i, n in enumerate(nodes)})
    asked: list[str] = []

    async def job_state(job_id: str) -> str:
        asked.append(job_id)
        return slurm_says

    alloc = Allocation(cfg, DEMO, [], JobFiles(tmp_path / "job"), plan, "7", 0, "python3", job_state=job_state)
    trainer = alloc.steps["trainer"]
    trainer.proc = await asyncio.create_subprocess_exec("bash", "-c", "exit 130")
    await trainer.proc.wait()
    await alloc.exits.put(trainer)
    async with asyncio.timeout(30):  # a hang guard: the watch either ends the job or takes the exit as the stop
        if slurm_says == "RUNNING":
            with pytest.raises(ExceptionGroup) as group:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(alloc._watch_exits(tg))
            [ended] = group.value.exceptions
            assert isinstance(ended, JobEnded)
            assert (ended.state, ended.code) == ("failed", 1)
            assert ended.why.startswith("trainer (on n3) was ended by SIGINT (status 130)"), ended.why
        else:
            async with asyncio.TaskGroup() as tg:
                watch = tg.create_task(alloc._watch_exits(tg))
                await alloc.stopped.wait()  # as SIGTERM would set it: the runner's stop takes over
                watch.cancel()
            assert alloc.status.steps["trainer"].state != "exited"  # the stop records it as stopped
    assert asked == ["7"]
