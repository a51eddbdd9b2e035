"""Which checkpoint directories can be loaded (inference/checkpoint_files.py), what ``check --servers`` says of a
``weights_path`` template, and the reference trainer's checkpoints: real files, each loadable, appearing whole."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from orchestrator.inference.checkpoint_files import weights_path_report, why_unloadable
from orchestrator.policy import FILE, Policy
from orchestrator.trainer.learner import PolicyLearner
from orchestrator.trainer.reference import ReferenceTrainer


def safetensors(path: Path, data: int = 16, *, cut: int = 0) -> Path:
    """A safetensors file with one float32 tensor of ``data`` bytes, less ``cut`` bytes at the end."""
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "w": {"dtype": "F32", "shape": [data // 4], "data_offsets": [0, data]}}).encode()
    blob = struct.pack("<Q", len(header)) + header + bytes(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob[:len(blob) - cut])
    return path


def test_a_directory_with_weights_of_any_loadable_kind_passes(tmp_path: Path) -> None:
    safetensors(tmp_path / "st" / "model.safetensors")
    (tmp_path / "st" / "config.json").write_text("{}")
    Policy.initial().save(tmp_path / "sim")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a torch zip")
    (tmp_path / "bin" / "broken.pt").write_bytes(b"")  # vLLM takes *.bin first and never reads the *.pt
    for name in ("st", "sim", "bin"):
        assert why_unloadable(str(tmp_path / name)) is None, name


def test_what_cannot_be_loaded_is_named_with_why(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    for name in ("config.json", "STABLE", ".model.safetensors.tmp"):  # a hidden file is not vLLM's weights
        (tmp_path / "other" / name).write_text("x")
    (tmp_path / "file").write_text("x")
    assert why_unloadable(str(tmp_path / "missing")) == "does not exist"
    assert why_unloadable(str(tmp_path / "file")) == "is not a directory"
    assert why_unloadable(str(tmp_path / "empty")) == "is empty"
    assert why_unloadable(str(tmp_path / "other")) == (
        "holds no weight files (*.safetensors, *.bin, *.pt or tiny_policy.npz); it holds: .model.safetensors.tmp, "
        "STABLE, config.json")


@pytest.mark.parametrize(("write", "why"), [
    (lambda d: safetensors(d / "model.safetensors", cut=5),
     "holds a corrupt file model.safetensors: its header puts tensor data up to byte "),
    (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}"),
     "holds a corrupt file model.safetensors: its header length says 1000000 bytes, the file has 2 after it"),
    (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{"),
     "holds a corrupt file model.safetensors: its header is not JSON"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x01\x02"),
     "holds a corrupt file model.safetensors: 2 bytes, shorter than the 8-byte header length"),
    (lambda d: (d / "model.safetensors").write_bytes(b""), "holds a corrupt file model.safetensors: it is empty"),
    (lambda d: (d / FILE).write_bytes(b"not a zip at all"), f"holds a corrupt file {FILE}: not a readable zip"),
    (lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})),
     "lacks model-2.safetensors, which model.safetensors.index.json names"),
])
def test_a_corrupt_or_incomplete_file_is_named(tmp_path: Path, write: Callable[[Path], object], why: str) -> None:
    d = tmp_path / "ckpt"
    safetensors(d / "model-1.safetensors")  # a good shard beside the bad file
    write(d)
    got = why_unloadable(str(d))
    assert got is not None
    assert got.startswith(why), got


def test_a_truncated_policy_file_is_corrupt(tmp_path: Path) -> None:
    file = Policy.initial().save(tmp_path / "ckpt")
    file.write_bytes(file.read_bytes()[:-40])  # a zip's directory is at its end
    got = why_unloadable(str(tmp_path / "ckpt"))
    assert got is not None
    assert got.startswith(f"holds a corrupt file {FILE}: not a readable zip"), got


def test_check_servers_view_of_a_template_is_never_wrong_about_future_steps(tmp_path: Path) -> None:
    missing = f"{tmp_path}/nowhere/step_{{step}}"
    problem, _ = weights_path_report(missing)
    assert problem is not None
    assert f"{tmp_path}/nowhere does not exist on this host" in problem, problem
    assert weights_path_report(f"{tmp_path}/step_{{step}}") == (None, f"{tmp_path} exists; no checkpoint in it yet")
    Policy.initial().save(tmp_path / "step_2")
    (tmp_path / "step_10").mkdir()  # the newest, and empty
    problem, _ = weights_path_report(f"{tmp_path}/./step_{{step}}")
    assert problem == (f"inference.weights_path = '{tmp_path}/./step_{{step}}': step 10, the newest there, "
                       f"{tmp_path}/./step_10 is empty"), problem  # the path the run would fill in
    Policy.initial().save(tmp_path / "step_10")
    assert weights_path_report(f"{tmp_path}/step_{{step}}") == (
        None, f"step 10, the newest there, {tmp_path}/step_10 can be loaded")
    # no {step}: one directory the trainer overwrites; checked if it is there, else its parent must be
    assert weights_path_report(f"{tmp_path}/latest") == (None, f"{tmp_path} exists; nothing is there yet")
    assert weights_path_report(f"{tmp_path}/step_2") == (None, f"{tmp_path}/step_2 can be loaded")


def test_the_reference_trainer_writes_loadable_checkpoints_hard_linked_to_one_initial_policy(
        tmp_path: Path) -> None:
    trainer = ReferenceTrainer("ipc:///unused", checkpoint_dir=tmp_path / "ckpt")
    paths = [Path(str(trainer._save(s))) for s in (1, 2, 2)]  # step 2 again: a restart
    assert [p.name for p in paths] == ["step_1", "step_2", "step_2"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".initial", "step_1", "step_2"]  # no temps
    inodes = {(p / FILE).stat().st_ino for p in paths} | {(tmp_path / "ckpt" / ".initial" / FILE).stat().st_ino}
    assert len(inodes) == 1  # one file on disk, however many steps
    for p in paths:
        assert why_unloadable(str(p)) is None
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
        assert why_unloadable(path) is None
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
    assert why_unloadable(path) is None
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_1"]
    assert trainer._save(1) == path  # an existing one: its file replaced in place
    assert seen == [False, True]
