from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from orchestrator.rollouts.sampler import EnvDraws, TaskSampler
from orchestrator.state import STATE_FILE, STATE_VERSION, OrchestratorState, StateError, load_state, save_state


def test_round_trip_of_the_sampler_state_draws_what_the_original_draws_next(tmp_path: Path) -> None:
    envs = [EnvDraws("a", 7, 2.0), EnvDraws("b", 5, 1.0)]
    sampler = TaskSampler(envs, seed=3)
    for _ in range(11):  # past an epoch of both envs
        sampler.take()
    sampler.peek()  # a peeked, untaken draw is drawn again after resume
    state = OrchestratorState(run="r", next_step=5, acked_step=4, policy_step=4, scheduler={"sampler": sampler.state()})
    save_state(tmp_path, state)
    back = load_state(tmp_path, "r")
    assert back == state
    resumed = TaskSampler(envs, seed=3, state=back.scheduler["sampler"])
    assert [resumed.take() for _ in range(20)] == [sampler.take() for _ in range(20)]


def test_a_state_file_of_another_version_is_refused_naming_both(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_bytes(msgpack.packb({"version": 1, "run": "r"}))
    with pytest.raises(StateError, match=f"version 1, this build reads {STATE_VERSION}"):
        load_state(tmp_path, "r")


def test_save_replaces_atomically_and_leaves_no_temp(tmp_path: Path) -> None:
    save_state(tmp_path, OrchestratorState(run="r", next_step=1))
    save_state(tmp_path, OrchestratorState(run="r", next_step=2))
    assert load_state(tmp_path, "r").next_step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]


def test_missing_state(tmp_path: Path) -> None:
    with pytest.raises(StateError, match="no saved state"):
        load_state(tmp_path, "r")


@pytest.mark.parametrize("data", [b"\xc1garbage", b"", b"\x92\x01\x02"])
def test_corrupt_state(tmp_path: Path, data: bytes) -> None:
    (tmp_path / STATE_FILE).write_bytes(data)
    with pytest.raises(StateError, match=STATE_FILE):
        load_state(tmp_path, "r")


def test_state_of_another_run(tmp_path: Path) -> None:
    save_state(tmp_path, OrchestratorState(run="other"))
    with pytest.raises(StateError, match="saved by run 'other'"):
        load_state(tmp_path, "r")
