"""What a perf figure was measured on: the machine, and the commit of the code measured. Every perf script puts
``machine_info()`` into its final JSON (``with_machine``), because the same commit reads ~3x apart on two machines of
the same kind: a figure without its machine cannot tell a regression from a slower CPU.

The commit is that of the source tree the ``orchestrator`` package was imported from (not the current directory's:
``regress.py`` runs these scripts against another commit's sources), with ``-dirty`` when that tree has changes
git sees (tracked or untracked, not ignored). Linux only (``/proc/cpuinfo``); elsewhere the CPU fields are None.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def cpu_info(path: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The first processor's model name, family/model (a VM often hides the name: "AMD EPYC"), and its flags."""
    fields: dict[str, str] = {}
    try:
        for line in path.read_text().splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                if fields:
                    break  # the first processor's block ends at its blank line
                continue
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return {"cpu": None, "cpu_family_model": None, "avx2": None, "avx512": None, "hypervisor": None}
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name"),
            "cpu_family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}",
            "avx2": "avx2" in flags, "avx512": "avx512f" in flags, "hypervisor": "hypervisor" in flags}


def source_commit() -> str:
    """The commit of the tree ``orchestrator`` is imported from (12 hex digits, ``-dirty`` if changed), or
    ``unknown`` when that is not a git checkout (an installed wheel)."""
    import orchestrator

    root = Path(orchestrator.__file__).resolve().parents[2]  # <root>/src/orchestrator/__init__.py
    try:
        commit = _git(root, "rev-parse", "--short=12", "HEAD")
        dirty = _git(root, "status", "--porcelain")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def _git(root: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.strip()


def machine_info(*, commit: bool = True) -> dict[str, Any]:
    """CPU, cores, vector extensions, the commit measured (unless ``commit`` is False), Python, the time (UTC) and
    the 1-minute load average when it was called (the load other work puts on a shared machine: read a figure
    with it)."""
    info = {**cpu_info(), "cores": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_1m": round(os.getloadavg()[0], 2)}
    return {**info, "commit": source_commit()} if commit else info


def machine_label(info: dict[str, Any]) -> str:
    """One short line for a table: ``AMD EPYC 25/1, 2 cores, AVX2, VM``."""
    vector = "AVX-512" if info.get("avx512") else "AVX2" if info.get("avx2") else "no AVX2"
    vm = ", VM" if info.get("hypervisor") else ""
    return f"{info.get('cpu') or 'unknown CPU'} {info.get('cpu_family_model')}, {info.get('cores')} cores, {vector}{vm}"


def with_machine(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with ``machine``: what every perf script's last JSON line carries."""
    return {**result, "machine": machine_info()}
