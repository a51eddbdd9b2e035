from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--data-plane", choices=("through", "direct"), default="through",
        help="transport.data_plane of the jobs the end-to-end, resume, fault, shutdown and supervision tests run "
             "(those whose transport is kind = zmq with keep_acked = 0, through the data_plane fixture; the others "
             "keep their own); with direct, tests that do not take the fixture are deselected (they ran already); "
             "scripts/test.sh runs those files once more with direct")
    parser.addoption(
        "--real-stack", default=None, metavar="DIR",
        help="run the real-stack tests (tests/real: a real vLLM server, real models, the PyTorch trainer) with the "
             "stack set up in DIR by scripts/real-stack.sh (.real-stack); without it tests/real is not collected")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/real needs the real stack (minutes to set up, GBs on disk): collected only with ``--real-stack``."""
    if collection_path.name == "real" and collection_path.parent == REPO / "tests":
        return config.getoption("--real-stack") is None or None
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked slow first (in their order): with the suite in several processes (pytest-xdist, by file),
    the long files start early and the short ones fill the end, so no long file runs alone at the end. With
    ``--data-plane direct``, only tests that take the ``data_plane`` fixture run: every other test runs the same
    either way, and the default run has run it already."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: files stay in order
    if config.getoption("--data-plane") == "through":
        return
    keep: list[pytest.Item] = []
    other: list[pytest.Item] = []
    for item in items:
        (keep if "data_plane" in getattr(item, "fixturenames", ()) else other).append(item)
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = keep


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def data_plane(request: pytest.FixtureRequest) -> str:
    """The ``--data-plane`` this session runs its zmq jobs with: ``"through"`` (default) or ``"direct"``."""
    value: str = request.config.getoption("--data-plane")
    return value


@pytest.fixture
def verifiers_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$HOME in the test's ``tmp_path``: verifiers writes ``~/.cache/verifiers``, and env workers (children)
    inherit it. The files that run jobs use it (``pytestmark = pytest.mark.usefixtures("verifiers_home")``); not
    autouse, since Hypothesis refuses function-scoped fixtures on its ``@given`` tests and most tests start no
    env worker."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
