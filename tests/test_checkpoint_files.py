"""The reference trainer's checkpoints: real files, each loadable, appearing whole."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from orchestrator.policy import FILE, Policy
from orchestrator.transport.learner import PolicyLearner
from orchestrator.transport.trainer import ReferenceTrainer


def test_the_reference_trainer_writes_loadable_checkpoints_hard_linked_to_one_initial_policy(
        tmp_path: Path) -> None:
    trainer = ReferenceTrainer("ipc:///unused", checkpoint_dir=tmp_path / "ckpt")
    paths = [Path(p) for s in (1, 2, 2) if (p := trainer._save(s)) is not None]  # step 2 again: a restart
    assert [p.name for p in paths] == ["step_1", "step_2", "step_2"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".initial", "step_1", "step_2"]  # no temps
    inodes = {(p / FILE).stat().st_ino for p in paths} | {(tmp_path / "ckpt" / ".initial" / FILE).stat().st_ino}
    assert len(inodes) == 1  # one file on disk, however many steps
    for p in paths:
        policy = Policy.load(p)
        assert policy is not None
        assert all(np.array_equal(policy.weights[k], Policy.initial().weights[k]) for k in policy.weights)


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or Path("/dev/shm").stat().st_dev == Path("/tmp").stat().st_dev,
                    reason="needs /dev/shm on another filesystem than /tmp")
def test_a_checkpoint_on_another_filesystem_gets_a_copy(tmp_path: Path) -> None:
    elsewhere = Path(f"/dev/shm/ckpt-test-{os.getpid()}")
    elsewhere.mkdir()
    try:
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "step_1").symlink_to(elsewhere)  # step_1 resolves to another filesystem
        path = ReferenceTrainer("ipc:///unused", checkpoint_dir=tmp_path / "ckpt")._save(1)
        assert path == str(elsewhere)
        assert Policy.load(Path(path)) is not None
        assert (elsewhere / FILE).read_bytes() == (tmp_path / "ckpt" / ".initial" / FILE).read_bytes()
    finally:
        shutil.rmtree(elsewhere)


def test_a_learning_trainer_checkpoint_appears_whole(tmp_path: Path) -> None:
    """Its directory appears once the policy is in it (temp name, then rename), never empty or half written."""
    final = tmp_path / "ckpt" / "step_1"
    seen: list[bool] = []

    class Watched(PolicyLearner):
        def save(self, directory: Path) -> Path:
            seen.append(final.exists())  # while the policy is written
            return super().save(directory)

    trainer = ReferenceTrainer("ipc:///unused", checkpoint_dir=tmp_path / "ckpt", learner=Watched())
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / f".step_1.{os.getpid()}.tmp").mkdir()  # left by a killed writer
    path = trainer._save(1)
    assert seen == [False]
    assert path == str(final)
    assert Policy.load(Path(path)) is not None
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_1"]
    assert trainer._save(1) == path  # an existing one: its file replaced in place
    assert seen == [False, True]
