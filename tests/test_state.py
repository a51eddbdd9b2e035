from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orchestrator.state import STATE_FILE, OrchestratorState, StateError, load_state, save_state


def test_round_trip_including_rng_state(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    rng.random(10)
    state = OrchestratorState(run="r", next_step=5, acked_step=4, policy_step=4,
                              task_cursors={"a": 12, "b": 3}, rng_state=rng.bit_generator.state)
    save_state(tmp_path, state)
    back = load_state(tmp_path, "r")
    assert back == state
    restored = np.random.default_rng()
    restored.bit_generator.state = back.rng_state
    assert restored.random() == rng.random()


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
