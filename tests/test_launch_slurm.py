"""``orchestrator launch slurm`` against a real SLURM (orchestrator.testing.slurm): munged, slurmctld on a login
host and three slurmd nodes, each in its own network namespace, so the job really spans hosts. The job is the
demo's parts: two simulated servers on one node, two env workers and the orchestrator on another, the learning
reference trainer on a third.

- A job that loses a server step (``scancel --signal=KILL JOB.STEP``) goes on with the other; ``scancel`` ends
  it cleanly within KillWait (the orchestrator and the trainer exit 130: not killed; the journal and the state are
  whole); submitted again it resumes; requeued (``scontrol requeue``) it resumes again; the trainer's journal
  holds every step once, in order, across the three runs.
- A trainer step that dies ends the job, naming the trainer and its cause; the script ``--dry-run`` printed is
  what sbatch ran.

Needs SLURM (``bash scripts/slurm-setup.sh``): without it these tests fail saying so. Needs root for the
namespaces (CI is root): skipped elsewhere, with the reason.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.launch.status import read_status
from orchestrator.state import STATE_FILE, load_state
from orchestrator.testing.procs import wait_until
from orchestrator.testing.slurm import SlurmCluster, missing, unavailable
from orchestrator.trainer.reference import read_journal

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "launch_demo.toml"
STEPS = 12  # room for each run to stop mid-way, whatever the pace of steps
SMALL = ["--set", f"run.max_steps={STEPS}", "--set", "scheduler.batch_size=16", "--set", "scheduler.max_inflight=16",
         "--set", "launch.env_workers.per_node=1"]  # one env worker: each takes a core for seconds to import verifiers
WAIT_S = 240.0  # a hang guard: every wait ends on a state or a file's content (processes start slowly under load)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


@pytest.fixture(autouse=True)
def _slurm_is_here() -> None:
    if (why := missing()) is not None:
        pytest.fail(why)  # not a skip: CI installs SLURM, so its absence is a broken setup
    if (why := unavailable()) is not None:
        pytest.skip(why)


class Job:
    """What a launched job leaves in its directory, read as it goes."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.dir = work / "outputs" / "launch-demo" / "launch"
        self.journal = self.dir / "trainer-journal.jsonl"

    def steps(self) -> list[int]:
        return [int(line["step"]) for line in read_journal(self.journal)]

    def status(self) -> dict[str, Any]:
        status = read_status(self.dir / "status.json")
        assert status is not None
        return status

    def log(self, name: str) -> str:
        return (self.dir / "logs" / f"{name}.log").read_text(errors="replace")


async def launch(cluster: SlurmCluster, work: Path, *flags: str) -> str:
    out = await cluster.call(sys.executable, "-m", "orchestrator", "launch", "slurm", str(CONFIG), *SMALL, *flags,
                             cwd=work)
    return out.split()[0]


async def step_id(cluster: SlurmCluster, job_id: str, name: str) -> str:
    out = await cluster.call("squeue", "-h", "-s", "-j", job_id, "-o", "%i %j")
    found = [line.split()[0] for line in out.splitlines() if line.split()[1:] == [name]]
    assert found, f"no step {name} in job {job_id}: {out}"
    return found[0]


async def test_a_job_survives_a_dead_server_stops_cleanly_and_resumes_resubmitted_and_requeued(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    job = Job(work)
    async with SlurmCluster.open(tmp_path / "cluster") as cluster:
        first = await launch(cluster, work)
        with pytest.raises(RuntimeError, match=f"job {first} of .* is (PENDING|RUNNING): one job per job directory"):
            await launch(cluster, work)  # a second job would share its directory: refused while it lives
        await wait_until(lambda: len(job.steps()) >= 2, WAIT_S, "the trainer's first two steps", poll_s=0.5)
        killed = await step_id(cluster, first, "server-1")
        await cluster.call("scancel", "--signal=KILL", killed)
        seen = len(job.steps())
        await wait_until(lambda: len(job.steps()) >= seen + 2, WAIT_S, "two steps after the server died", poll_s=0.5)
        assert job.status()["state"] == "running"
        cancelled_at = time.monotonic()
        await cluster.call("scancel", first)
        fields = await cluster.wait_job(first, ENDED, WAIT_S)
        await wait_until(lambda: job.status()["state"] != "running", WAIT_S, "the runner to record the job's end")
        stopped_in = time.monotonic() - cancelled_at
        assert fields["JobState"] == "CANCELLED"

        status = job.status()
        assert status["state"] == "stopped", (status["why"], job.log("job")[-3000:])
        dead = status["steps"]["server-1"]
        assert (dead["state"], dead["exit"]) == ("exited", 137), dead  # SIGKILL: the step died, the job went on
        assert "leaves rotation" in job.log("orchestrator")
        # ended within KillWait, each by its own shutdown: the orchestrator and the trainer exit 130 (a SIGKILL
        # would be 137, a hung shutdown 124)
        assert stopped_in < cluster.kill_wait_s, stopped_in
        assert status["steps"]["orchestrator"]["exit"] == 130, status["steps"]["orchestrator"]
        assert status["steps"]["trainer"]["exit"] == 130, status["steps"]["trainer"]
        # nothing half-written: every journal line whole, the state loads, no checkpoint left under a temp name
        lines = job.journal.read_bytes().splitlines()
        assert [orjson.loads(line)["step"] for line in lines] == list(range(len(lines)))
        state = load_state(work / "outputs" / "launch-demo", "launch-demo")
        assert 0 <= state.acked_step <= len(lines) - 1
        assert not [p.name for p in (job.dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]
        assert (work / "outputs" / "launch-demo" / STATE_FILE).exists()
        before = job.steps()
        assert 0 < len(before) < STEPS

        second = await launch(cluster, work, "--set", "launch.requeue=true")
        await wait_until(lambda: len(job.steps()) > len(before), WAIT_S, "a step of the resubmitted job", poll_s=0.5)
        assert len(job.steps()) < STEPS
        await cluster.call("scontrol", "requeue", second)
        await cluster.wait_job(second, ("PENDING",), WAIT_S)  # requeued once every step has ended
        await cluster.call("scontrol", "update", f"jobid={second}", "StartTime=now")  # not SLURM's 120 s delay
        fields = await cluster.wait_job(second, ENDED, WAIT_S)
        assert fields["JobState"] == "COMPLETED", (fields, job.log("job")[-3000:])
        assert fields["Restarts"] == "1"
        status_lines = await cluster.call(sys.executable, "-m", "orchestrator", "launch", "status", str(CONFIG),
                                          *SMALL, cwd=work)
    assert job.steps() == list(range(STEPS))  # every step once, in order, across the two jobs
    assert job.status()["state"] == "completed"
    starts = job.log("orchestrator").split("=== ")
    assert len(starts) == 4  # the log before the first banner, then three starts
    assert ["--resume" in s for s in starts[1:]] == [False, True, True]  # resumed after scancel and the requeue
    assert status_lines.startswith(f"job {second} (attempt 1): completed: the orchestrator finished every step; "
                                   "SLURM: COMPLETED"), status_lines
    assert f"step {STEPS - 1} of {STEPS - 1} done" in status_lines
    assert str(job.dir / "logs" / "trainer.log") in status_lines


async def test_a_trainer_step_that_dies_ends_the_job_naming_it(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    job = Job(work)
    bad = ("launch.trainer.command=\"{orchestrator} receive {address} --no-such-flag --server-key {server_key} "
           "--client-key {client_key}\"")
    async with SlurmCluster.open(tmp_path / "cluster") as cluster:
        script = await cluster.call(sys.executable, "-m", "orchestrator", "launch", "slurm", str(CONFIG), *SMALL,
                                    "--set", bad, "--dry-run", cwd=work)
        (work / "printed.sbatch").write_text(script)
        job_id = (await cluster.call("sbatch", "--parsable", str(work / "printed.sbatch"), cwd=work)).strip()
        fields = await cluster.wait_job(job_id, ENDED, WAIT_S)
    assert fields["JobState"] == "FAILED", fields
    status = job.status()
    assert status["state"] == "failed"
    assert status["why"].startswith("trainer (on n3) exited with status 2"), status["why"]
    assert "unrecognized arguments: --no-such-flag" in status["why"]  # its log's last lines
    assert f"job {job_id} failed: trainer (on n3) exited with status 2" in job.log("job")
    assert {s["state"] for name, s in status["steps"].items() if name != "trainer"} == {"stopped"}
