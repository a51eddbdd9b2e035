"""``[launch]``: where each role of the job runs on a cluster, for ``orchestrator launch slurm|k8s``.

One table per role (``[launch.servers]``, ``[launch.env_workers]``, ``[launch.orchestrator]``,
``[launch.trainer]``), each placed on nodes of its own (``nodes = N``, or by name: ``nodelist``) or on the
nodes of another role (``share = "servers"``); the job's settings (partition, time, account...) beside them,
and ``[launch.k8s]`` for Kubernetes. Commands are templates: ``{port}``, ``{address}``... are filled in inside
the allocation, once the nodes are known (``PLACEHOLDERS`` lists each role's); ``${VAR}`` is left to the shell.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.configbase import Source, opt

ROLES = ("servers", "env_workers", "orchestrator", "trainer")
Role = Literal["servers", "env_workers", "orchestrator", "trainer"]

_COMMON = ("job_dir", "orchestrator", "model")
PLACEHOLDERS: Mapping[str, tuple[str, ...]] = {
    "servers": (*_COMMON, "port", "index", "local_index", "node", "host", "sim_args"),
    "trainer": (*_COMMON, "address", "server_key", "client_key", "master_addr", "master_port", "nodes"),
}
# {name}, not ${name} (the shell's) nor {{name}}
_PLACEHOLDER = re.compile(r"(?<![$\\{])\{([A-Za-z_][A-Za-z0-9_]*)\}(?!\})")


def placeholders(template: str) -> list[str]:
    """The ``{name}`` placeholders of a command template, in order."""
    return _PLACEHOLDER.findall(template)


def fill(template: str, values: Mapping[str, object]) -> str:
    """``template`` with each ``{name}`` replaced by ``values[name]`` (KeyError for a name it lacks)."""
    return _PLACEHOLDER.sub(lambda m: str(values[m[1]]), template)


@dataclass(frozen=True)
class Placement:
    """Where a role runs: nodes of its own (a count, or names), or the nodes of another role."""

    nodes: int = opt(0, ge=0, doc="nodes of its own (0: none; see share)")
    nodelist: tuple[str, ...] = opt((), doc="its nodes by name (SLURM node names), instead of a count")
    share: Role | None = opt(None, doc="run on the nodes of this role instead of nodes of its own")

    def own_nodes(self) -> int:
        return len(self.nodelist) or self.nodes

    def placement_problems(self, key: str, source: Source) -> Iterable[str]:
        if self.nodes and self.nodelist:
            yield (f"{source(f'{key}.nodelist')}: {key}.nodes / {key}.nodelist: give a count or names, not both "
                   f"(nodelist = {list(self.nodelist)} is {len(self.nodelist)} nodes)")
        if self.share is not None and self.own_nodes():
            yield (f"{source(f'{key}.share')}: {key}.share: a role runs on nodes of its own or on another "
                   f"role's (share = {self.share!r}), not both; remove nodes/nodelist or share")


@dataclass(frozen=True)
class Command:
    """What a role runs as a job step: a shell command template, its environment and extra srun flags."""

    command: str | None = opt(None, doc="the shell command of each instance, a template (see PLACEHOLDERS)")
    env: dict[str, str] = opt({}, doc="environment variables of its steps (values are templates too)")
    srun: tuple[str, ...] = opt((), doc="extra srun flags of its steps, e.g. [\"--gres=gpu:1\"]")


@dataclass(frozen=True)
class ServersRole(Placement, Command):
    per_node: int = opt(1, ge=1, doc="servers per node (ports port, port + 1, ...)")
    port: int = opt(8000, ge=1, le=65535, doc="the first server's port on each node")
    health_path: str = opt("/health", doc="a GET that answers 200 once a server is ready (vLLM: /health)")
    restarts: int = opt(0, ge=0, doc="times a server step that died is started again (it rejoins rotation after "
                        "the pool's probe and a weight sync); 0: the job goes on with the others")


@dataclass(frozen=True)
class WorkersRole(Placement):
    per_node: int = opt(1, ge=1, doc="env workers per node")
    nice: int = opt(0, ge=0, le=19, doc="niceness of each env worker (orchestrator env-worker --nice)")
    srun: tuple[str, ...] = opt((), doc="extra srun flags of its steps")
    restarts: int = opt(0, ge=0, doc="times an env worker step that died is started again (it reconnects)")


@dataclass(frozen=True)
class OrchestratorRole(Placement):
    nodes: int | None = opt(None, ge=0, le=1, doc="unset: a node of its own, or none with share")  # type: ignore[assignment]
    worker_port: int = opt(5600, ge=1, le=65535, doc="env workers connect here (scheduler.worker_address)")
    trainer_port: int = opt(5555, ge=1, le=65534, doc="batches to the trainer (transport.address); "
                            "acknowledgements on the port after it")
    srun: tuple[str, ...] = opt((), doc="extra srun flags of its step")

    def own_nodes(self) -> int:
        return len(self.nodelist) or (self.nodes if self.nodes is not None else int(self.share is None))


@dataclass(frozen=True)
class TrainerRole(Placement, Command):
    master_port: int = opt(29500, ge=1, le=65535, doc="{master_port}: torchrun's rendezvous port")


@dataclass(frozen=True)
class K8sConfig:
    """``orchestrator launch k8s``: the cluster side of each workload."""

    image: str | None = opt(None, doc="container image with this package (and vLLM / the trainer) installed")
    namespace: str = opt("default", doc="namespace of every object")
    volume_claim: str | None = opt(None, doc="an existing ReadWriteMany PersistentVolumeClaim, mounted in every pod "
                                   "at mount_path (checkpoints, outputs, the trainer's journal); unset: the manifests "
                                   "make one, JOB-shared, of `storage`")
    storage: str = opt("50Gi", doc="the size of the volume claim the manifests make")
    storage_class: str | None = opt(None, doc="its storageClassName (one that offers ReadWriteMany: NFS, CephFS...); "
                                    "unset: the cluster's default")
    mount_path: str = opt("/job", doc="where the shared volume is mounted, and the working directory of every pod")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = opt("IfNotPresent", doc="imagePullPolicy")
    resources: dict[str, dict[str, Any]] = opt({}, doc="per role, its container's resources.limits, e.g. "
                                               "{ servers = { \"nvidia.com/gpu\" = 1 } }")
    discover_interval_s: float = opt(5.0, gt=0, doc="how often the orchestrator resolves the servers' headless "
                                     "service (inference.discover_interval_s)")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    job_name: str | None = opt(None, doc="the job's name (unset: run.name)")
    partition: str | None = opt(None, doc="sbatch --partition (unset: the cluster's default)")
    account: str | None = opt(None, doc="sbatch --account")
    qos: str | None = opt(None, doc="sbatch --qos")
    time: str | None = opt(None, doc="sbatch --time, e.g. \"2-00:00:00\" (unset: the partition's limit)")
    exclusive: bool = opt(True, doc="whole nodes (sbatch --exclusive)")
    requeue: bool = opt(False, doc="sbatch --requeue: a requeued job resumes where the journal says")
    sbatch: tuple[str, ...] = opt((), doc="more sbatch flags, one #SBATCH line each, e.g. [\"--gres=gpu:8\"]")
    setup: tuple[str, ...] = opt((), doc="shell lines run first in the batch script, e.g. [\"module load cuda\"]; "
                                 "steps inherit its environment")
    python: str | None = opt(None, doc="the Python that runs this package on the nodes (unset: the one running "
                             "`orchestrator launch`, which must be on a filesystem every node sees)")
    job_dir: str | None = opt(None, doc="the job's directory on a filesystem every node sees: keys, logs, status "
                              "(unset: <run.output_dir>/launch)")
    ready_timeout_s: float = opt(1800.0, gt=0, doc="servers not healthy, or the orchestrator not listening, this "
                                 "long after their start end the job")
    stop_timeout_s: float = opt(20.0, gt=0, doc="at the end, steps still running this long after SIGTERM are killed")
    servers: ServersRole = opt(ServersRole(), doc="inference servers (nodes = 0: inference.servers as written)")
    env_workers: WorkersRole = opt(WorkersRole(), doc="env workers (nodes = 0: the orchestrator's own, local)")
    orchestrator: OrchestratorRole = opt(OrchestratorRole(), doc="the orchestrator (one)")
    trainer: TrainerRole = opt(TrainerRole(), doc="the trainer")
    k8s: K8sConfig = opt(K8sConfig(), doc="Kubernetes (orchestrator launch k8s)")

    def role(self, name: str) -> Placement:
        return {"servers": self.servers, "env_workers": self.env_workers, "orchestrator": self.orchestrator,
                "trainer": self.trainer}[name]

    def nodes_needed(self) -> int:
        """Nodes of the allocation: every role's own."""
        return sum(self.role(r).own_nodes() for r in ROLES)

    def problems(self, key: str, source: Source) -> Iterable[str]:
        for name in ROLES:
            yield from self.role(name).placement_problems(f"{key}.{name}", source)
        for name in ROLES:
            share = self.role(name).share
            if share is not None and (share == name or not self.role(share).own_nodes()):
                yield (f"{source(f'{key}.{name}.share')}: {key}.{name}.share: {share!r} has no nodes of its own to "
                       f"share (its nodes / nodelist)")
        if not self.orchestrator.own_nodes() and self.orchestrator.share is None:
            yield (f"{source(f'{key}.orchestrator.nodes')}: {key}.orchestrator: needs a node: nodes = 1, or share = "
                   "\"env_workers\" (or another role's)")
        if len(self.orchestrator.nodelist) > 1:
            yield f"{source(f'{key}.orchestrator.nodelist')}: {key}.orchestrator.nodelist: one orchestrator, one node"
        for name, role in (("servers", self.servers), ("trainer", self.trainer)):
            yield from _command_problems(f"{key}.{name}", name, role, source)
        if self.trainer.command is None:
            yield (f"{source(f'{key}.trainer.command')}: {key}.trainer.command: required, e.g. \"{{orchestrator}} "
                   "receive {address} --server-key {server_key} --client-key {client_key}\" or a torchrun line")
        if not self.trainer.own_nodes() and self.trainer.share is None:
            yield (f"{source(f'{key}.trainer.nodes')}: {key}.trainer: needs nodes = N (or share = another role)")
        o = self.orchestrator
        if o.trainer_port + 1 == o.worker_port or o.trainer_port == o.worker_port:
            yield (f"{source(f'{key}.orchestrator.worker_port')}: {key}.orchestrator.worker_port: {o.worker_port} "
                   f"collides with trainer_port {o.trainer_port} (which takes the port after it too)")


def _command_problems(key: str, role: str, cmd: ServersRole | TrainerRole, source: Source) -> Iterable[str]:
    has_nodes = cmd.own_nodes() or cmd.share is not None
    if role == "servers" and has_nodes and cmd.command is None:
        yield (f"{source(f'{key}.command')}: {key}.command: required with nodes (e.g. \"vllm serve MODEL --host "
               "0.0.0.0 --port {port}\", or \"{orchestrator} sim-inference --host 0.0.0.0 --port {port} "
               "{sim_args}\")")
    known = PLACEHOLDERS[role]
    templates: list[tuple[str, object]] = [("command", cmd.command or "")]
    templates += [(f"env.{k}", v) for k, v in cmd.env.items()]  # TOML gives any value: checked here
    for name, text in templates:
        if not isinstance(text, str):
            yield f"{source(f'{key}.{name}')}: {key}.{name}: expected a string, got {text!r}"
            continue
        for p in placeholders(text):
            if p not in known:
                yield (f"{source(f'{key}.{name}')}: {key}.{name}: unknown placeholder {{{p}}}; {role} commands "
                       f"know {', '.join('{' + k + '}' for k in known)} (a shell variable is ${{{p}}})")


def launch_problems(launch: LaunchConfig, transport_kind: str, source: Source) -> Iterable[str]:
    """What ``[launch]`` needs of the other sections (the loader's cross-section checks). ``[security]`` is the
    launcher's to set: it makes the job's keys."""
    if transport_kind != "zmq":
        yield (f"{source('transport.kind')}: transport.kind: orchestrator launch connects the trainer over zmq; "
               f"got {transport_kind!r} (remove [launch], or use kind = 'zmq')")
