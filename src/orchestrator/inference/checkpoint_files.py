"""Whether a checkpoint directory can be loaded, checked before any inference server is asked to load it.

A real vLLM asked to reload a directory without weights answers 500 ("Cannot find any model weights"), and so
does a path that does not exist (it tries the hub); either way its engine dies at the next forward pass and the
server process exits (REAL-VLLM.md: 0.26, 0.31, 0.32). So the pool refuses such a checkpoint itself
(``[inference] check_checkpoints``, default on) and no server ever sees it.

What a directory must hold: the weight files of vLLM's default loader, in the order it looks (``*.safetensors``,
else ``*.bin``, else ``*.pt``: it loads the first kind it finds and ignores the rest; hidden files are not
matched), or the simulated servers' ``tiny_policy.npz`` (``orchestrator.policy.FILE``). Each file of the kind
that counts is checked as far as it can be without reading its tensors: none may be empty; a safetensors file's
header must parse and the file must be at least as long as the header says (a truncated copy is not); a
``*.safetensors.index.json`` must name only shards that are there; the ``.npz`` must open as a zip holding the
policy's ``meta``. Only headers are read, so the check costs milliseconds for any model size. Blocking (stat,
listing, reads): run it in a worker thread.

``weights_path_report`` is ``orchestrator check --servers``'s view of an ``inference.weights_path`` template
before the run, when the steps it names mostly do not exist yet.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import re
import zipfile
from pathlib import Path

from orchestrator.policy import FILE as POLICY_FILE

LOADER_ORDER = ("*.safetensors", "*.bin", "*.pt")  # vLLM's default loader takes the first kind present
INDEX = "*.safetensors.index.json"
SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library refuses a larger header
LISTED = 8  # names shown of a directory without weights


def why_unloadable(path: str) -> str | None:
    """Why directory ``path`` cannot be loaded, as a phrase that follows the path ("does not exist", "holds no
    weight files (...); it holds: a, b", "holds a corrupt file X: ..."), or None when it can be."""
    d = Path(path)
    try:
        if not d.exists():
            return "does not exist"
        if not d.is_dir():
            return "is not a directory"
        return _contents_problem(d, sorted(p.name for p in d.iterdir()))
    except OSError as e:  # e.g. permissions: this host cannot tell; check_checkpoints = false if servers can
        return f"cannot be read on this host ({e})"


def _contents_problem(d: Path, names: list[str]) -> str | None:
    if not names:
        return "is empty"
    visible = [n for n in names if not n.startswith(".")]  # a writer's temp files; vLLM's glob skips them too
    kind = next((found for pattern in LOADER_ORDER if (found := fnmatch.filter(visible, pattern))), [])
    files = kind + ([POLICY_FILE] if POLICY_FILE in visible else [])
    if not files:
        return (f"holds no weight files ({', '.join(LOADER_ORDER)} or {POLICY_FILE}); it holds: "
                f"{_listing(names)}")
    for name in files:
        why = _corrupt(d / name)
        if why is not None:
            return f"holds a corrupt file {name}: {why}"
    if kind and kind[0].endswith(".safetensors"):
        return _index_problem(d, visible)
    return None


def _listing(names: list[str]) -> str:
    more = len(names) - LISTED
    return ", ".join(names[:LISTED]) + (f" and {more} more" if more > 0 else "")


def _corrupt(p: Path) -> str | None:
    size = p.stat().st_size
    if size == 0:
        return "it is empty (0 bytes)"
    if p.name.endswith(".safetensors"):
        return _safetensors_problem(p, size)
    if p.name == POLICY_FILE:
        return _npz_problem(p)
    return None  # .bin / .pt: a pickle or a zip, which only loading it can check


def _safetensors_problem(p: Path, size: int) -> str | None:
    """The format: an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape,
    data_offsets: [begin, end]}}, offsets into the bytes after the header), then the tensors' bytes."""
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        n = int.from_bytes(head, "little")
        if n > min(size - 8, SAFETENSORS_MAX_HEADER):
            return f"its header length says {n} bytes, the file has {size - 8} after it"
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            return f"its header is not JSON ({e})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return f"tensor {name!r} has no valid data_offsets in the header"
        end = max(end, offsets[1])
    if 8 + n + end > size:
        return f"its header puts tensor data up to byte {8 + n + end}, the file has {size} bytes (truncated?)"
    return None


def _npz_problem(p: Path) -> str | None:
    try:
        with zipfile.ZipFile(p) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        return f"not a readable zip ({e})"
    return None if "meta.npy" in names else "a zip without the policy's meta"


def _index_problem(d: Path, visible: list[str]) -> str | None:
    """A sharded checkpoint's index names every shard; vLLM loads only those, so each must be there."""
    for index in fnmatch.filter(visible, INDEX):
        try:
            shards = set(json.loads((d / index).read_bytes())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return f"holds a corrupt file {index}: no weight_map ({e!r})"
        missing = sorted(str(s) for s in shards - set(visible))
        if missing:
            return f"lacks {_listing(missing)}, which {index} names"
    return None


def weights_path_report(template: str) -> tuple[str | None, str]:
    """(a problem or None, a line saying what was checked) for ``inference.weights_path`` before a run.

    A template names steps that mostly do not exist yet, so only what must hold already is a problem: the
    directory above the first ``{step}`` exists, and the newest step already there (if any) can be loaded. A
    path without ``{step}`` (a trainer overwriting one directory) can be loaded if it exists, else its parent
    exists. Blocking."""
    parts = str(Path(template)).split("{step}")  # normalized as Path.glob yields paths ("./a//b" is "a/b")
    if len(parts) == 1:
        path = Path(template)
        if path.exists():
            return _loads(template, template)
        return _exists(template, path.parent, "nothing is there yet")
    head = parts[0]
    fixed = Path(head) if head.endswith("/") else Path(head).parent
    problem, line = _exists(template, fixed, "")
    if problem is not None:
        return problem, line
    number = re.compile(r"(\d+)".join(re.escape(p) for p in parts))
    pattern = "*".join(glob.escape(p) for p in parts)
    anchor = Path(pattern).anchor  # Path.glob takes relative patterns only
    steps = [int(m.group(1)) for p in Path(anchor or ".").glob(pattern[len(anchor):])
             if (m := number.fullmatch(str(p)))]
    if not steps:
        return None, f"{fixed} exists; no checkpoint in it yet"
    return _loads(template, template.replace("{step}", str(max(steps))), f"step {max(steps)}, the newest there, ")


def _exists(template: str, directory: Path, then: str) -> tuple[str | None, str]:
    if directory.is_dir():
        return None, f"{directory} exists{'; ' + then if then else ''}"
    return (f"inference.weights_path = {template!r}: {directory} does not exist on this host, so every checkpoint "
            "there would be refused: create it (or start the trainer that writes it first), fix the path, or set "
            "inference.check_checkpoints = false if the servers see other files than this host"), ""


def _loads(template: str, path: str, which: str = "") -> tuple[str | None, str]:
    why = why_unloadable(path)
    if why is None:
        return None, f"{which}{path} can be loaded"
    return f"inference.weights_path = {template!r}: {which}{path} {why}", ""
