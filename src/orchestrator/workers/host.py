"""Prepare a worker host to run verifiers' own harnesses and the TextArena taskset without network access.

Every harness verifiers 0.4.0 ships (``null``, ``bash``...) runs its chat program as a PEP 723 script through
``uv``: each new env worker process runs ``uv sync --script``, which installs the script's dependencies
(``openai``, ``mcp==2.0.0``, ``httpx``, ``httpx2``, ``tenacity``, ``certifi``) from a package index. The
TextArena taskset reads NLTK's ``words`` corpus, which it tries to download. ``prepare(directory)`` makes both
local, once, while PyPI can be reached:

1. ``DIR/wheels``: ``pip download`` (wheels only, for this interpreter) of the chat program's dependencies
   (read from verifiers' own script header) and any ``extra`` packages; skipped with ``download=False``
   (the wheels must already be there) and when they were downloaded for the same list and interpreter.
2. ``DIR/simple``: a PEP 503 index over those wheels (``UV_DEFAULT_INDEX=file://DIR/simple``).
3. ``DIR/nltk_data/corpora/words/{en,en-basic}``: word lists built from the ``en_US.dic`` that ships inside
   ``textarena`` (when it is installed): not NLTK's lists (those are only downloadable), the same format.
4. ``DIR/env.json`` and ``DIR/env.sh``: the variables an env worker needs (``worker_env(DIR)`` returns them).

``orchestrator prepare-worker-host DIR`` runs it; docs/bring-your-own-env.md says when.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from orchestrator.errors import OrchestratorError

STAMP = ".downloaded"  # what DIR/wheels was downloaded for (packages and interpreter)
WORD = re.compile(r"[a-z]+")
BASIC_LENGTHS = range(3, 9)  # en-basic: the dictionary's plain words of 3 to 8 letters


class PrepareError(OrchestratorError):
    """The worker host cannot be prepared (no uv, a download that failed, no wheels to index)."""


def chat_program_requirements() -> list[str]:
    """The dependencies verifiers' shared chat program declares (its PEP 723 header)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM

    match = re.search(r"^# dependencies = (\[.*\])$", CHAT_PROGRAM, re.MULTILINE)
    if match is None:  # verifiers changed its script header: say so rather than guess
        raise PrepareError("cannot read the dependencies of verifiers' chat program (its PEP 723 header changed)")
    requirements: list[str] = json.loads(match.group(1))
    return requirements


def prepare(directory: Path, *, download: bool = True, extra: Sequence[str] = ()) -> dict[str, str]:
    """Make ``directory`` a worker host's offline kit (module docstring); returns ``worker_env(directory)``.
    Blocking (pip, file writes); needs PyPI only when it downloads."""
    directory = directory.resolve()
    wheels = directory / "wheels"
    packages = [*chat_program_requirements(), *extra]
    if download:
        download_wheels(packages, wheels)
    if not any(wheels.glob("*.whl")):
        raise PrepareError(f"no wheels in {wheels}: run `orchestrator prepare-worker-host {directory}` on a host "
                           "that reaches PyPI (or copy that directory here)")
    write_index(wheels, directory / "simple")
    env = {"UV_DEFAULT_INDEX": (directory / "simple").as_uri(), "UV_PYTHON_DOWNLOADS": "never",
           "UV_PYTHON": sys.executable}
    if write_words(directory / "nltk_data"):
        env["NLTK_DATA"] = str(directory / "nltk_data")
    spec = {"env": env, "path": [str(Path(uv_binary()).parent)]}
    (directory / "env.json").write_text(json.dumps(spec, indent=2) + "\n")
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(f'export PATH={shlex.quote(":".join(spec["path"]))}:"$PATH"')
    (directory / "env.sh").write_text("# source this before `orchestrator run` or `orchestrator env-worker`\n"
                                      + "\n".join(lines) + "\n")
    return worker_env(directory)


def worker_env(directory: Path, path: str | None = None) -> dict[str, str]:
    """The variables of a prepared ``directory`` (its ``env.json``), ``PATH`` = uv's directory + ``path``
    (default: this process's PATH)."""
    try:
        spec = json.loads((directory / "env.json").read_text())
    except FileNotFoundError:
        raise PrepareError(f"{directory} is not prepared: run `orchestrator prepare-worker-host {directory}`") from None
    rest = os.environ.get("PATH", "") if path is None else path
    return {**spec["env"], "PATH": ":".join([*spec["path"], rest] if rest else spec["path"])}


def uv_binary() -> str:
    """The ``uv`` executable (the ``uv`` package installs it next to this interpreter)."""
    try:
        from uv import find_uv_bin
    except ImportError:
        raise PrepareError("uv is not installed: pip install 'rollout-orchestrator[worker-host]' (or uv)") from None
    return str(find_uv_bin())


def download_wheels(packages: Sequence[str], wheels: Path) -> None:
    """``pip download`` the wheels of ``packages`` (and their dependencies) for this interpreter, unless
    ``wheels`` already holds them for the same list and interpreter."""
    stamp = hashlib.sha256(json.dumps([sorted(packages), sys.version, sys.platform]).encode()).hexdigest()
    if (wheels / STAMP).is_file() and (wheels / STAMP).read_text() == stamp:
        return
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(wheels),
           *packages]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode:
        raise PrepareError(f"pip download failed ({shlex.join(cmd)}): {result.stderr.strip()[-2000:]}")
    (wheels / STAMP).write_text(stamp)


def write_index(wheels: Path, index: Path) -> None:
    """A PEP 503 simple index at ``index`` over the wheels in ``wheels`` (links relative to it)."""
    projects: dict[str, list[Path]] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        projects.setdefault(re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower(), []).append(wheel)
    for name, files in projects.items():
        page = index / name
        page.mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="{html.escape(os.path.relpath(f, page))}">{html.escape(f.name)}</a><br>\n'
                        for f in files)
        _write(page / "index.html", f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    listing = "".join(f'<a href="{n}/">{n}</a><br>\n' for n in sorted(projects))
    _write(index / "index.html", f"<!DOCTYPE html>\n<html><body>\n{listing}</body></html>\n")


def write_words(nltk_data: Path) -> bool:
    """NLTK's ``words`` corpus (``en``, ``en-basic``) from textarena's ``en_US.dic``; False without textarena."""
    try:
        import textarena
    except ImportError:
        return False
    dic = Path(textarena.__file__).parent / "envs" / "utils" / "data" / "en_US.dic"
    lines = dic.read_text(encoding="utf-8", errors="replace").splitlines()[1:]  # the first line is a count
    words = sorted({w for w in (line.split("/", 1)[0].strip() for line in lines) if WORD.fullmatch(w)})
    corpus = nltk_data / "corpora" / "words"
    corpus.mkdir(parents=True, exist_ok=True)
    _write(corpus / "en", "\n".join(words) + "\n")
    _write(corpus / "en-basic", "\n".join(w for w in words if len(w) in BASIC_LENGTHS) + "\n")
    _write(corpus / "README", f"Built by orchestrator.workers.host from {dic.name} of textarena "
                              f"{getattr(textarena, '__version__', '')}: not NLTK's own word lists.\n")
    return True


def _write(path: Path, text: str) -> None:
    """Write atomically (a temp file, then rename), so a worker reading the kit never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
