"""Benchmark weights over the wire against weights through the disk, and both against the bare transfer.

A Qwen3 model big enough that copying its weights dominates a sync (``--hidden``/``--layers``/``--intermediate``:
by default ~150 M parameters, 0.6 GB in float32), built here (no hub) into the real stack's models directory, served
by one real vLLM (float32, the gloo engine). This process holds the trainer's copy of the weights (the model's
tensors) and plays both the trainer and the orchestrator, with the project's own code for each. Each repeat, in
rotating order:

- **broadcast**: a full sync as a job runs it, trainer done -> the server serving the new weights: the
  orchestrator's ``BroadcastSync.update`` (the trainer asked over the real ZMQ trainer link, then pause, start,
  ``/update_weights`` while the trainer's ``GlooBroadcaster`` sends, finish, resume), the group formed once
  before the repeats (its formation is reported apart);
- **filesystem**: the trainer writes the weights (``safetensors.save_file``, as ``save_pretrained`` does), then
  the orchestrator's ``InferencePool.update_weights`` (check, pause, ``reload_weights``, version, resume);
- **bare**: the same bytes, in the same chunks, through a gloo broadcast from this process to another with no
  vLLM (``orchestrator.transfer.gloo``, the receiver acknowledging the last chunk): the floor of the transfer.

``broadcast_to_filesystem`` = median broadcast / median filesystem (target <= 0.5); ``broadcast_to_bare`` =
median broadcast / median bare (target <= 1.5). The JSON carries both, each phase's median and the machine's
load. ``--quick``: a ~6 M-parameter model and 2 repeats (a smoke run). Needs the real stack with this package in
the server's venv (``bash scripts/real-stack.sh``).

    .venv/bin/python scripts/perf/bench_weight_transfer.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import torch
from _machine import with_machine

from orchestrator.config import load_config
from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.delivery.zmq_link import BatchSender
from orchestrator.inference.pool import InferencePool
from orchestrator.realstack.install import StackPaths
from orchestrator.realstack.models import COMMON
from orchestrator.realstack.server import ServeOptions, vllm_server
from orchestrator.testing.jobs import toml_text
from orchestrator.testing.procs import wait_until
from orchestrator.trainer.gloo_broadcast import GlooBroadcaster
from orchestrator.trainer.receiver import BatchReceiver
from orchestrator.transfer.gloo import GlooGroup, GlooUpdateInfo, dtype_name, plan
from orchestrator.weights.broadcast import BroadcastSync

TIMEOUT_S = 300.0
BARE_RECEIVER = """
import sys, torch
from orchestrator.transfer.gloo import GlooGroup, GlooInitInfo, GlooUpdateInfo, plan
import json
spec = json.loads(sys.argv[1])
info = GlooInitInfo(**spec["init"])
update = GlooUpdateInfo(**spec["update"])
group = GlooGroup.connect(info, 1)
done = torch.zeros(1, dtype=torch.int64)
for _ in range(spec["repeats"]):
    for _pairs in group.receive(plan(update, info.packed_buffer_size_bytes)):
        pass
    group.pg.broadcast(done, 1).wait()  # the last chunk is in: tell the sender
"""


def build(directory: Path, args: argparse.Namespace) -> int:
    """The benchmark's Qwen3 (float32, seeded) in ``directory`` unless its spec is there already; its parameters."""
    spec = {**COMMON, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "intermediate_size": args.intermediate, "num_attention_heads": args.hidden // 64,
            "num_key_value_heads": max(1, args.hidden // 128), "head_dim": 64}
    stamp = directory / "bench-spec.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return int(json.loads((directory / "params.json").read_text()))
    import transformers

    from orchestrator.assets import tokenizer_dir, vocab_size

    config = transformers.Qwen3Config(**spec, vocab_size=vocab_size(tokenizer_dir()) or 0)
    torch.manual_seed(0)
    model: Any = transformers.Qwen3ForCausalLM(config)
    model = model.to(torch.float32)
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").unlink(missing_ok=True)
    for f in tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy(f, directory / f.name)
    n = int(sum(p.numel() for p in model.parameters()))
    (directory / "params.json").write_text(str(n))
    stamp.write_text(json.dumps(spec))
    return n


def weights(directory: Path) -> dict[str, torch.Tensor]:
    """The trainer's copy: every tensor of the checkpoint, in memory."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def job_toml(root: Path, url: str, buffer_mb: int) -> Path:
    path = root / "job.toml"
    path.write_text(toml_text(
        run={"output_dir": root / "out"}, model={"name": "tiny"},
        inference={"servers": [url], "weight_transfer": "broadcast", "weight_sync_timeout_s": TIMEOUT_S,
                   "broadcast": {"timeout_s": TIMEOUT_S, "buffer_mb": buffer_mb}},
        scheduler={"batch_size": 8}, env=[{"name": "a", "taskset": "orchestrator-arithmetic", "group_size": 2}]))
    return path


class Bare:
    """The floor: this process sends, another (no vLLM) receives, in the same chunks."""

    def __init__(self, tensors: dict[str, torch.Tensor], buffer_bytes: int, repeats: int) -> None:
        self.tensors = tensors
        self.buffer_bytes = buffer_bytes
        self.update = GlooUpdateInfo(list(tensors), [dtype_name(t.dtype) for t in tensors.values()],
                                     [list(t.shape) for t in tensors.values()])
        self.group = GlooGroup.listen("127.0.0.1", 0, 2, TIMEOUT_S)
        spec = {"init": {"master_address": "127.0.0.1", "master_port": self.group.port, "rank_offset": 1,
                         "world_size": 2, "group": "bare", "timeout_s": TIMEOUT_S,
                         "packed_buffer_size_bytes": buffer_bytes},
                "update": {"names": self.update.names, "dtype_names": self.update.dtype_names,
                           "shapes": self.update.shapes}, "repeats": repeats}
        self.proc = subprocess.Popen([sys.executable, "-c", BARE_RECEIVER, json.dumps(spec)])
        self.group.join("bare", "127.0.0.1")
        self.done = torch.zeros(1, dtype=torch.int64)

    def run(self) -> float:
        t0 = time.perf_counter()
        self.group.send(self.tensors.values(), plan(self.update, self.buffer_bytes), self.buffer_bytes)
        self.group.pg.broadcast(self.done, 1).wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.group.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        if self.proc.poll() is None:
            self.proc.kill()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    stack = StackPaths(args.stack.resolve())
    name = "bench-quick" if args.quick else f"bench-{args.hidden}x{args.layers}"
    model_dir = stack.models / name
    params = await asyncio.to_thread(build, model_dir, args)
    tensors = await asyncio.to_thread(weights, model_dir)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    log(f"model {name}: {params / 1e6:.1f} M parameters, {nbytes / 2**20:.0f} MB; starting vLLM (35-60 s) ...")
    rows: dict[str, list[float]] = {"bare": [], "broadcast": [], "filesystem": []}
    phases: dict[str, list[dict[str, float]]] = {"broadcast": [], "filesystem": []}
    buffer_bytes = args.buffer_mb << 20
    options = ServeOptions(model_dir, weight_transfer="gloo", max_model_len=512, kv_cache_gib=1)
    with tempfile.TemporaryDirectory(prefix="bench-wt-") as tmp:
        root = Path(tmp)
        async with vllm_server(stack, options) as server:
            cfg = load_config(job_toml(root, server.url, args.buffer_mb))
            async with InferencePool.open(cfg.inference, "tiny") as pool, \
                    BatchSender.open(f"ipc://{root}/trainer.sock") as sender:
                receiver = BatchReceiver(sender.address, broadcaster=GlooBroadcaster(lambda: tensors))
                serving = asyncio.ensure_future(receiver.recv())  # serves the transfer requests as they come
                try:
                    await wait_until(lambda: sender.holder is not None, 60, "the trainer link")
                    sync = BroadcastSync(pool, sender, cfg.inference.broadcast)
                    await receiver.announce(1)
                    t = time.perf_counter()
                    first = await sync.update(Checkpoint(1), pool.servers)  # forms the group: warm-up
                    formed = {"form_s": first.phases.get("form", 0.0), "first_sync_s": time.perf_counter() - t}
                    bare = await asyncio.to_thread(Bare, tensors, buffer_bytes, args.repeats + 1)
                    await asyncio.to_thread(bare.run)  # warm-up
                    step = 1
                    for r in range(args.repeats):
                        order = ["bare", "broadcast", "filesystem"]
                        order = order[r % 3:] + order[:r % 3]
                        for kind in order:
                            step += 1
                            if kind == "bare":
                                rows[kind].append(await asyncio.to_thread(bare.run))
                            elif kind == "broadcast":
                                await receiver.announce(step)
                                report = await sync.update(Checkpoint(step), pool.servers)
                                rows[kind].append(report.total_s)
                                phases[kind].append(dict(report.phases))
                            else:
                                rows[kind].append(await filesystem(pool, tensors, root / f"step_{step}", step,
                                                                   phases[kind]))
                            log(f"repeat {r + 1}/{args.repeats}: {kind} {rows[kind][-1]:.3f} s")
                    bare.close()
                finally:
                    serving.cancel()
                    await asyncio.gather(serving, return_exceptions=True)
                    receiver.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"model": {"name": name, "params": params, "bytes": nbytes, "dtype": "float32"},
            "repeats": args.repeats, "buffer_mb": args.buffer_mb, "median_s": med,
            "broadcast_to_filesystem": round(med["broadcast"] / med["filesystem"], 3),
            "broadcast_to_bare": round(med["broadcast"] / med["bare"], 3),
            "bare_gb_per_s": round(nbytes / med["bare"] / 1e9, 3),
            "phases_median_s": {k: {p: round(statistics.median(x[p] for x in v), 4) for p in v[0]}
                                for k, v in phases.items() if v},
            "group": formed, "samples_s": rows, "loadavg": os.getloadavg(),
            "targets": {"broadcast_to_filesystem": 0.5, "broadcast_to_bare": 1.5}}


async def filesystem(pool: InferencePool, tensors: dict[str, torch.Tensor], directory: Path, step: int,
                     phases: list[dict[str, float]]) -> float:
    """The trainer writes the weights, the orchestrator has the server reload them: the wall time of both."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    await asyncio.to_thread(directory.mkdir, parents=True)
    await asyncio.to_thread(save_file, tensors, str(directory / "model.safetensors"))
    saved = time.perf_counter() - t0
    result = await pool.update_weights(Checkpoint(step, str(directory)))
    total = time.perf_counter() - t0
    if result.failed:
        raise RuntimeError(f"the reload failed: {result.failed}")
    phases.append({"save": saved, **result.phases})
    shutil.rmtree(directory)
    return total


def log(text: str) -> None:
    print(f"bench_weight_transfer: {text}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stack", type=Path, default=Path(".real-stack"), help="the real stack (default: .real-stack)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats of each kind (default: 5)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default: 1024)")
    p.add_argument("--layers", type=int, default=12, help="decoder layers (default: 12: ~150 M parameters)")
    p.add_argument("--intermediate", type=int, default=3072, help="MLP size (default: 3072)")
    p.add_argument("--buffer-mb", type=int, default=256, help="chunk size of a broadcast (default: 256)")
    p.add_argument("--quick", action="store_true", help="a ~6 M-parameter model, 2 repeats: a smoke run")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.intermediate, args.repeats = 256, 4, 1024, 2
    return args


if __name__ == "__main__":
    opts = parse()
    out = with_machine(asyncio.run(main(opts)))
    print(orjson.dumps(out).decode() if opts.json else json.dumps(out, indent=2))
