"""Which node runs what: the job's roles placed on the nodes of an allocation, and the addresses that follow.

``assign(launch, nodes)`` gives each role its nodes, in the allocation's order (``SLURM_JOB_NODELIST``
expanded): a role's ``nodelist`` takes those nodes, then each role with a count takes the next free ones (servers,
env workers, the orchestrator, the trainer, in that order), then a role with ``share`` runs on the nodes of the
role it names. ``Plan`` adds each node's address (SLURM's NodeAddr) and derives what every role is told: the
servers' URLs, the orchestrator's two addresses, the trainer's rendezvous address. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.errors import OrchestratorError
from orchestrator.launch.config import ROLES, LaunchConfig, OrchestratorRole


class PlanError(OrchestratorError, ValueError):
    """The allocation cannot hold the roles as ``[launch]`` places them (names what is missing)."""


def assign(launch: LaunchConfig, nodes: list[str]) -> dict[str, tuple[str, ...]]:
    """Each role's nodes (PlanError if the allocation lacks a named node, or has too few)."""
    free = list(nodes)
    out: dict[str, tuple[str, ...]] = {}
    for role in ROLES:
        names = launch.role(role).nodelist
        missing = [n for n in names if n not in free]
        if missing:
            raise PlanError(f"launch.{role}.nodelist: {', '.join(missing)} not in the allocation's free nodes "
                            f"({', '.join(free) or 'none'})")
        out[role] = tuple(names)
        free = [n for n in free if n not in names]
    for role in ROLES:
        placement = launch.role(role)
        count = placement.own_nodes() if not placement.nodelist else 0
        if count > len(free):
            raise PlanError(f"launch.{role}: needs {count} node(s), the allocation has {len(free)} left "
                            f"(of {len(nodes)}: {', '.join(nodes)})")
        if count:
            out[role], free = tuple(free[:count]), free[count:]
    for role in ROLES:
        share = launch.role(role).share
        if share is not None:
            out[role] = out[share][:1] if isinstance(launch.role(role), OrchestratorRole) else out[share]
    return out


@dataclass(frozen=True)
class Instance:
    """One process of a role: a server, an env worker (the trainer and the orchestrator are one step each)."""

    role: str
    index: int  # among the role's instances
    local_index: int  # among the role's instances on its node
    node: str
    host: str  # the node's address
    port: int | None = None

    @property
    def name(self) -> str:
        return f"{'server' if self.role == 'servers' else 'env-worker'}-{self.index}"


@dataclass(frozen=True)
class Plan:
    launch: LaunchConfig
    nodes: dict[str, tuple[str, ...]]  # role -> its nodes
    addresses: dict[str, str]  # node -> its address (NodeAddr)

    @classmethod
    def make(cls, launch: LaunchConfig, nodes: list[str], addresses: dict[str, str]) -> Plan:
        return cls(launch, assign(launch, nodes), addresses)

    def instances(self, role: str) -> list[Instance]:
        per_node = {"servers": self.launch.servers.per_node, "env_workers": self.launch.env_workers.per_node}[role]
        out: list[Instance] = []
        for node in self.nodes[role]:
            for k in range(per_node):
                port = self.launch.servers.port + k if role == "servers" else None
                out.append(Instance(role, len(out), k, node, self.addresses[node], port))
        return out

    @property
    def server_urls(self) -> list[str]:
        return [f"http://{s.host}:{s.port}/v1" for s in self.instances("servers")]

    @property
    def orchestrator_node(self) -> str:
        return self.nodes["orchestrator"][0]

    @property
    def orchestrator_host(self) -> str:
        return self.addresses[self.orchestrator_node]

    @property
    def worker_address(self) -> str:
        return f"tcp://{self.orchestrator_host}:{self.launch.orchestrator.worker_port}"

    @property
    def trainer_address(self) -> str:
        return f"tcp://{self.orchestrator_host}:{self.launch.orchestrator.trainer_port}"

    @property
    def master_addr(self) -> str:
        return self.addresses[self.nodes["trainer"][0]]

    def describe(self) -> dict[str, Any]:
        """Each role's nodes and addresses, as the job's status file and log say them."""
        out: dict[str, Any] = {role: [f"{n} ({self.addresses[n]})" for n in self.nodes[role]] for role in ROLES}
        out["server_urls"] = self.server_urls
        out["worker_address"] = self.worker_address
        out["trainer_address"] = self.trainer_address
        return out
