"""The package's import layers: a module imports only modules of its own layer or of layers below it, and no
modules import each other in a loop.

Read top to bottom, ``LAYERS`` is the design (docs/architecture.md), one folder (or top-level module) per entry
and no exceptions for single modules: entry points; the job (the orchestrator and what it opens); its config; the
data plane; the step boundary; weight sync; rollouts; the env workers' hub; the inference pool; the env worker
process; scoring; the trainer library; delivery; the contracts every stage names (messages, wire formats, rows,
manifests, checkpoints); the column formats; the weight transfer engines (torch and vLLM only: a vLLM server's
venv imports them); the base. Every import counts, whether at module level, inside a
function or only for type checking. Run it alone: ``pytest tests/test_layers.py``; the failure lists every import
that goes up, or every loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import orchestrator

SRC = Path(orchestrator.__file__).parent

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry points", ("__main__", "cli", "commands", "testing", "transport")),
    ("the job", ("app", "engines", "outdir", "progress")),
    ("config, and its rendering for a cluster", ("config", "launch")),
    ("data plane", ("dataplane",)),
    ("step boundary", ("steps", "sinks")),
    ("weight sync", ("weights",)),
    ("rollouts", ("rollouts",)),
    ("env workers' hub", ("hub",)),
    ("inference", ("inference",)),
    ("env worker process", ("workers", "envs", "realstack", "sim")),
    ("scoring", ("scoring",)),
    ("trainer library", ("trainer",)),
    ("delivery", ("delivery",)),
    ("contracts", ("contracts",)),
    ("columns", ("columns",)),
    ("weight transfer engines (torch, vLLM)", ("transfer",)),
    ("base", ("errors", "configbase", "security", "background", "lagmon", "memory", "procs", "ipc", "state", "policy",
              "assets", "__init__")),
)


def layer_of(module: str) -> int:
    """The layer of ``module`` (dotted, without ``orchestrator.``): its folder's (or top-level module's)."""
    top = module.split(".")[0]
    for i, (_, names) in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"orchestrator.{module} is in no layer: add {top!r} to LAYERS")


def modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in src.rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
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


def import_cycles(src: Path = SRC) -> list[list[str]]:
    """Modules that import each other in a loop (Tarjan's strongly connected components, every import counted)."""
    mods = modules(src)
    known = set(mods)
    graph = {m: sorted(t for t in imports(p, known) if t in known and t != m) for m, p in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    assert import_cycles() == []


def test_the_check_sees_a_cycle(tmp_path: Path) -> None:
    """The cycle check can fail: two modules importing each other are found."""
    pkg = tmp_path / "orchestrator"
    pkg.mkdir()
    (pkg / "a.py").write_text("from orchestrator.b import x\n")
    (pkg / "b.py").write_text("from orchestrator import a\n")
    assert import_cycles(pkg) == [["a", "b"]]
