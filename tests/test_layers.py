"""The package's import layers: a module imports only modules of its own layer or of layers below it.

Read top to bottom, ``LAYERS`` is the design (docs/architecture.md): entry points; the job (the orchestrator and
what it opens); its config; the data plane; the step boundary; weight sync; rollouts; the env workers' hub; the
inference pool; the env worker process; scoring; the trainer library and delivery; the contracts every stage
names (messages, wire formats); the column formats and pools; the base. Every import counts, whether at module
level, inside a function or only for type checking. Run it alone: ``pytest tests/test_layers.py``; the failure
lists every import that goes up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import orchestrator

SRC = Path(orchestrator.__file__).parent

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry points", ("__main__", "cli", "commands", "testing", "transport", "launch")),
    ("the job", ("app", "stepping", "engines", "outdir", "progress")),
    ("config", ("config", "launch.config")),
    ("data plane", ("columns.plane", "columns.direct", "columns.unacked", "columns.readback")),
    ("step boundary", ("steps", "sinks")),
    ("weight sync", ("weights",)),
    ("rollouts", ("rollouts",)),
    ("env workers' hub", ("workers", "columns.pools", "columns.spans")),
    ("inference", ("inference", "weights.checkpoint_files")),
    ("env worker process", ("workers.process", "workers.envconfig", "workers.host", "workers.quiet", "envs",
                            "realstack", "sim")),
    ("scoring", ("scoring",)),
    ("trainer library", ("trainer", "columns.reader")),
    ("delivery", ("delivery",)),
    ("contracts", ("workers.protocol", "workers.events", "delivery.wire", "delivery.link", "delivery.reports",
                   "steps.rows", "columns.manifest", "weights.checkpoints")),
    ("columns", ("columns",)),
    ("base", ("errors", "configbase", "security", "background", "lagmon", "memory", "procs", "ipc", "state", "policy",
              "assets", "__init__")),
)


def layer_of(module: str) -> int:
    """The layer of ``module`` (dotted, without ``orchestrator.``): its longest listed prefix's."""
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank >= 0, f"orchestrator.{module} is in no layer: add it to LAYERS"
    return rank


def modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The orchestrator modules ``path`` imports (``from orchestrator.a import b`` names ``a.b`` if that is a
    module, else ``a``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orchestrator"):
            base = node.module.removeprefix("orchestrator").removeprefix(".")
            for alias in node.names:
                name = f"{base}.{alias.name}" if base else alias.name
                found.add(name if name in known else base or "__init__")
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("orchestrator.") for a in node.names if a.name.startswith("orchestrator.")}
    return found


def upward_imports() -> list[str]:
    mods = modules()
    known = set(mods)
    bad = []
    for mod, path in sorted(mods.items()):
        for target in sorted(imports(path, known)):
            if target != mod and target in known and layer_of(target) < layer_of(mod):
                bad.append(f"{mod} ({LAYERS[layer_of(mod)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    return bad


def test_every_module_has_a_layer() -> None:
    for mod in modules():
        layer_of(mod)


def test_no_import_goes_up_a_layer() -> None:
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The check can fail: a base module importing the app is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from orchestrator.app import Orchestrator\nimport orchestrator.config\n")
    assert imports(bad, set(modules())) == {"app", "config"}
    assert layer_of("app") < layer_of("errors")
