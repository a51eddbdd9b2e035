"""``orchestrator demo``: the whole job on one machine, with nothing to set up.

Starts simulated inference servers (subprocesses), env workers with the built-in environments, and the
reference trainer in its learning mode: it trains the tiny policy the simulated servers sample from
(``orchestrator.policy``) on every batch and announces each new checkpoint, so weights sync every step and the
reward climbs (``--no-learn``: it trains nothing and the reward stays where it started). ``--distill`` runs
``configs/distill.toml`` instead: on-policy distillation from a simulated teacher (another tiny policy), whose mean
KL to the student falls step by step in the summary. Runs ``--steps`` steps
with the progress bar of ``orchestrator run`` (orchestrator.progress), prints a summary table and renders the
plots of ``orchestrator report`` (when matplotlib, the ``plots`` extra, is installed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from orchestrator.cli import run_async
from orchestrator.commands.check import add_set_argument
from orchestrator.commands.run import interruptible
from orchestrator.config import JobConfig, load_config

HELP = "run the embedded demo: simulated inference, built-in environments, reference trainer"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="demo config (default: configs/demo.toml, with --distill "
                   "configs/distill.toml)")
    p.add_argument("--distill", action="store_true",
                   help="on-policy distillation: a simulated teacher (another tiny policy) scores every sample and the "
                        "trainer learns to imitate it; the summary shows the mean KL to it per step")
    p.add_argument("--steps", type=int, default=None, help="steps to run (default: run.max_steps of the config)")
    p.add_argument("--output-dir", default=None, help="where outputs go (default: run.output_dir of the config)")
    p.add_argument("--no-learn", action="store_true",
                   help="the trainer trains nothing: the simulated servers keep their weights (a flat curve)")
    p.add_argument("--real-stack", type=Path, default=None, metavar="DIR",
                   help="run on the real stack set up in DIR by scripts/real-stack.sh (.real-stack): real vLLM servers "
                        "on the tiny dense model and the PyTorch trainer, instead of the simulated servers and the "
                        "numpy policy (docs/real-stack.md)")
    add_set_argument(p)


def main(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"run.max_steps={args.steps}")
    if args.output_dir is not None:
        overrides.append(f'run.output_dir="{args.output_dir}"')
    cfg = load_config(args.config or ("configs/distill.toml" if args.distill else "configs/demo.toml"), overrides)
    real_stack = args.real_stack.resolve() if args.real_stack is not None else None
    if real_stack is not None and cfg.teacher is not None:
        print("demo: a teacher ([teacher], --distill) runs on the simulated servers only; run it without --real-stack",
              file=sys.stderr)
        return 2
    return run_async(interruptible(demo(cfg, learn=not args.no_learn, real_stack=real_stack)))


async def demo(cfg: JobConfig, *, learn: bool = True, real_stack: Path | None = None) -> None:
    import asyncio

    from orchestrator.app import Orchestrator
    from orchestrator.commands.report import render_report
    from orchestrator.errors import OrchestratorError
    from orchestrator.progress import StepProgress
    from orchestrator.trainer.learner import PolicyLearner
    from orchestrator.trainer.reference import ReferenceTrainer

    progress = StepProgress(cfg.run.max_steps)  # the same bar (or plain lines) as `orchestrator run`
    console = progress.console
    async with contextlib.AsyncExitStack() as stack:
        if real_stack is None:
            cfg = await stack.enter_async_context(with_sim_servers(cfg))
            what = "simulated inference servers"
        else:
            console.print(f"[bold]demo[/]: starting {cfg.sim.servers} real vLLM servers (35-60 s each) ...")
            cfg = await stack.enter_async_context(with_real_servers(cfg, real_stack))
            what = "real vLLM servers on the tiny dense model"
        console.print(f"[bold]demo[/]: {cfg.sim.servers} {what}: " + ", ".join(cfg.inference.servers))
        # before the env workers start: importing torch from a cold disk took 10-20 s on a fresh CI machine, and a
        # worker starved of I/O meanwhile went silent past scheduler.worker_silence_s and was killed
        learner = (None if not learn else PolicyLearner() if real_stack is None
                   else await asyncio.to_thread(torch_learner, Path(cfg.model.tokenizer or "")))
        orch = await stack.enter_async_context(Orchestrator.open(cfg))
        trainer = ReferenceTrainer(orch.sender.address, max_steps=cfg.run.max_steps,
                                   checkpoint_dir=Path(cfg.run.output_dir) / "checkpoints", learner=learner,
                                   broadcaster=broadcaster(cfg, learner))
        orch.on_step = progress.on_step
        with progress:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(trainer.run())
                summary = await orch.run()
        print_summary(console, summary.metrics, trainer.received, Path(cfg.run.output_dir))
    try:  # rendering is blocking: a worker thread
        plots = await asyncio.to_thread(render_report, Path(cfg.run.output_dir))
        console.print(f"plots: {plots[0].parent}/ ({', '.join(p.name for p in plots)}); "
                      f"again with `orchestrator report {cfg.run.output_dir}`")
    except OrchestratorError as e:
        console.print(f"plots skipped: {e}")


@contextlib.asynccontextmanager
async def with_sim_servers(cfg: JobConfig) -> AsyncIterator[JobConfig]:
    """Start the ``[sim]`` table's servers (subprocesses, stopped on exit); yields ``cfg`` pointing at them."""
    from orchestrator.sim.process import sim_process

    args = cfg.sim.arguments(cfg.model.name, cfg.inference.backend, cfg.inference.transfer_backend)
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(sim_process([*args, "--seed", str(cfg.sim.seed + i)]))
                   for i in range(cfg.sim.servers)]
        cfg = dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference,
                                                                     servers=tuple(s.url for s in servers)))
        if cfg.teacher is not None:  # one more simulated server per teacher URL, on another policy, never synced
            teachers = [await stack.enter_async_context(sim_process(teacher_arguments(cfg, i)))
                        for i in range(len(cfg.teacher.servers))]
            cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher,
                                                                       servers=tuple(t.url for t in teachers)))
        yield cfg


@contextlib.asynccontextmanager
async def with_real_servers(cfg: JobConfig, root: Path) -> AsyncIterator[JobConfig]:
    """``cfg.sim.servers`` real vLLM servers on the real stack's dense model (stopped on exit); yields ``cfg``
    pointing at them (backend vllm, its served name and tokenizer). No routed experts: CPU servers have none."""
    import asyncio

    from orchestrator.realstack.install import StackPaths
    from orchestrator.realstack.server import ServeOptions, VLLMServer, start_all

    paths = StackPaths(root)
    model = paths.model("dense")
    servers = [VLLMServer(paths, ServeOptions(model, weight_transfer=cfg.inference.transfer_backend))
               for _ in range(cfg.sim.servers)]
    try:
        await start_all(servers)
        yield dataclasses.replace(
            cfg, inference=dataclasses.replace(cfg.inference, servers=tuple(s.url for s in servers), backend="vllm"),
            model=dataclasses.replace(cfg.model, name=servers[0].options.name, tokenizer=str(model)))
    finally:
        await asyncio.gather(*(s.kill() for s in servers))


def broadcaster(cfg: JobConfig, learner: Any) -> Any:
    """With ``inference.weight_transfer = "broadcast"``: the trainer sends its weights over gloo (the learner's,
    else the unchanged initial policy's); None otherwise."""
    if cfg.inference.weight_transfer != "broadcast":
        return None
    from orchestrator.commands.receive import broadcaster_of

    return broadcaster_of(learner, cfg.inference.broadcast.backend)


def torch_learner(model: Path) -> Any:
    """The PyTorch trainer's learner on ``model``, at the learning rate the real-stack tests learn with."""
    from orchestrator.trainer.torch_learner import TorchLearnConfig, TorchLearner

    return TorchLearner(model, TorchLearnConfig(lr=1e-2))


def teacher_arguments(cfg: JobConfig, i: int) -> list[str]:
    """``sim-inference`` flags of the demo's ``i``-th teacher server: the policy servers' profile, the teacher's
    model name and tiny policy, a context one token longer than theirs (a sample that fills theirs is scored)."""
    assert cfg.teacher is not None
    return ["--profile", cfg.sim.server_profile(cfg.inference.backend), "--model", cfg.teacher.model,
            "--policy-seed", str(cfg.sim.teacher_seed), "--seed", str(cfg.sim.seed + 1000 + i),
            "--max-model-len", "4097"]


def print_summary(console: Any, metrics: list[dict[str, Any]], received: list[Any], out: Path) -> None:
    from rich.table import Table

    envs = sorted({e for m in metrics for e in m["reward_mean"]})
    table = Table(title="demo summary: mean reward per environment, loop lag in ms")
    for col in ["step", *envs, "rollouts", "failed", "tokens", "rollouts/s", "lag p99", "lag max", "RSS MB"]:
        table.add_column(col, justify="right", no_wrap=True)
    for m in metrics:
        # "-": the environment had no rollout in the step (mixing by weight, or all failed), not a NaN reward
        table.add_row(str(m["step"]), *[f"{m['reward_mean'][e]:.3f}" if e in m["reward_mean"] else "-" for e in envs],
                      str(m["rollouts"]), str(m["failed"]), str(m["tokens"]),
                      f"{m['rollouts_per_s']:.1f}", f"{m['lag']['p99']:.1f}", f"{m['lag']['max']:.1f}",
                      f"{m['rss_mb']:.0f}")
    console.print(table)
    if len(metrics) >= 2:
        k = max(1, min(3, len(metrics) // 3))  # the mean of the first and of the last k steps, per env
        ends = [(e, [m["reward_mean"][e] for m in metrics if e in m["reward_mean"]]) for e in envs]
        console.print("reward, first -> last steps: " + ", ".join(
            f"{e} {sum(r[:k]) / len(r[:k]):.3f} -> {sum(r[-k:]) / len(r[-k:]):.3f}" for e, r in ends if r))
    kl = [(r.step, getattr(r.learned, "teacher_kl", None)) for r in received]
    kl = [(step, v) for step, v in kl if v is not None]
    if kl:  # on-policy distillation: what the trainer measured before each update
        console.print("mean KL to the teacher (trainer, before each update): " + ", ".join(
            f"step {step} {v:.3f}" for step, v in kl))
    console.print(f"trainer received {len(received)} steps in order: {[r.step for r in received]}")
    console.print(f"outputs: {out}/rollouts.jsonl, {out}/metrics.jsonl")
