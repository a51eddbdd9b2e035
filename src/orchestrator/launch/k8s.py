"""``orchestrator launch k8s``: the job's roles as Kubernetes objects, from ``[launch]`` and ``[launch.k8s]``.

For a job named J in namespace N (every object carries ``app.kubernetes.io/instance: J``):

- ``Secret J-keys``: the job's CURVE keys, made at render time; each pod mounts only the files its role needs
  (mode 0400) at /keys. ``ConfigMap J-config``: the job's config, resolved (``to_toml``), at /config/job.toml.
- ``PersistentVolumeClaim J-shared`` (unless ``volume_claim`` names one): ReadWriteMany, mounted in every pod at
  ``mount_path``, the working directory: the trainer writes checkpoints there and the servers load them; the
  orchestrator's output and the trainer's journal survive restarts there.
- ``StatefulSet J-servers`` behind the **headless** ``Service J-servers``: one pod per server; the orchestrator
  follows the service's DNS name (``inference.discover``), so a server joins when its readiness probe (its health
  route) passes and leaves when it goes. Probes: startup, readiness and liveness on the health route.
- ``Job J-orchestrator`` (restarted on failure, each restart with ``--resume`` once its state exists) and
  ``Service J-orchestrator`` (the env workers' port, the trainer's two). Probes: startup, readiness and liveness
  on the env workers' port (a TCP connect; it binds once its preflight passed).
- ``Deployment J-env-workers``: they connect to the orchestrator's service. ``Job J-trainer``: indexed, one pod
  per trainer node, behind the headless ``Service J-trainer`` (``{master_addr}`` is pod 0's name); restarted on
  failure, its journal says where to go on. Env workers and the trainer serve nothing: no probes (the
  orchestrator watches both, by heartbeats and acknowledgements).
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.config import JobConfig, to_toml
from orchestrator.launch.config import LaunchConfig, fill
from orchestrator.security import create_key_pair

Manifest = dict[str, Any]
KEYS, CONFIG = "/keys", "/config"
PYTHON = "python -m orchestrator"


def render_manifests(cfg: JobConfig, config_path: Path, overrides: list[str]) -> list[tuple[str, Manifest]]:
    """Every object of the job, in the order to apply them, each with a file name."""
    launch = cfg.launch
    assert launch is not None
    k8s = launch.k8s
    if k8s.image is None:
        from orchestrator.errors import ConfigError

        raise ConfigError([f"{config_path}: launch.k8s.image: required for orchestrator launch k8s (an image with "
                           "this package installed, and vLLM or your trainer)"])
    job = dns_name(launch.job_name or cfg.run.name)
    r = _Render(cfg, launch, job, k8s.namespace)
    out = [("secret-keys", r.secret()), ("configmap", r.configmap())]
    if k8s.volume_claim is None:
        out.append(("pvc", r.pvc()))
    if launch.servers.own_nodes():
        out += [("servers-service", r.headless("servers", launch.servers.port)), ("servers", r.servers())]
    out += [("orchestrator-service", r.orchestrator_service()), ("orchestrator", r.orchestrator())]
    if launch.env_workers.own_nodes():
        out.append(("env-workers", r.workers()))
    out += [("trainer-service", r.headless("trainer", launch.trainer.master_port)), ("trainer", r.trainer())]
    return out


def dns_name(text: str) -> str:
    """``text`` as a DNS-1123 label (Kubernetes object names): lower case, letters, digits and '-'."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40].strip("-")
    return name or "job"


class _Render:
    def __init__(self, cfg: JobConfig, launch: LaunchConfig, job: str, namespace: str) -> None:
        self.cfg, self.launch, self.job, self.ns = cfg, launch, job, namespace
        self.k8s = launch.k8s
        self.mount = self.k8s.mount_path

    def labels(self, role: str | None = None) -> dict[str, str]:
        out = {"app.kubernetes.io/name": "rollout-orchestrator", "app.kubernetes.io/instance": self.job}
        if role:
            out["app.kubernetes.io/component"] = role
        return out

    def meta(self, name: str, role: str | None = None) -> dict[str, Any]:
        return {"name": name, "namespace": self.ns, "labels": self.labels(role)}

    def selector(self, role: str) -> dict[str, str]:
        return {"app.kubernetes.io/instance": self.job, "app.kubernetes.io/component": role}

    def fqdn(self, service: str) -> str:
        return f"{self.job}-{service}.{self.ns}.svc.cluster.local"

    # ------------------------------------------------------------------------------- shared objects

    def secret(self) -> Manifest:
        """The job's keys, made now (in a private scratch directory, removed after)."""
        data = {}
        with tempfile.TemporaryDirectory(prefix="keys-") as tmp:
            for name in ("orchestrator", "worker", "trainer"):
                public, secret = create_key_pair(Path(tmp), name)
                data[public.name] = base64.b64encode(public.read_bytes()).decode()
                data[secret.name] = base64.b64encode(secret.read_bytes()).decode()
        return {"apiVersion": "v1", "kind": "Secret", "metadata": self.meta(f"{self.job}-keys"), "type": "Opaque",
                "data": data}

    def configmap(self) -> Manifest:
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": self.meta(f"{self.job}-config"),
                "data": {"job.toml": to_toml(self.cfg)}}

    def pvc(self) -> Manifest:
        spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"],
                                "resources": {"requests": {"storage": self.k8s.storage}}}
        if self.k8s.storage_class is not None:
            spec["storageClassName"] = self.k8s.storage_class
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": self.meta(f"{self.job}-shared"),
                "spec": spec}

    def headless(self, role: str, port: int) -> Manifest:
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(f"{self.job}-{role}", role),
                "spec": {"clusterIP": "None", "selector": self.selector(role),
                         "ports": [{"name": "main", "port": port, "targetPort": port}]}}

    def pod(self, role: str, command: str, keys: Mapping[str, str], *, env: Mapping[str, str] | None = None,
            probes: dict[str, Any] | None = None, ports: Sequence[int] = (), restart: str = "Always"
            ) -> dict[str, Any]:
        """A pod template: the image running ``sh -c command`` in the shared directory, with the key files
        ``keys`` (secret key -> path under /keys) and the job's config."""
        claim = self.k8s.volume_claim or f"{self.job}-shared"
        container: dict[str, Any] = {
            "name": role, "image": self.k8s.image, "imagePullPolicy": self.k8s.pull_policy,
            "command": ["/bin/sh", "-c", command], "workingDir": self.mount,
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    *({"name": k, "value": v} for k, v in (env or {}).items())],
            "volumeMounts": [{"name": "shared", "mountPath": self.mount},
                             {"name": "config", "mountPath": CONFIG, "readOnly": True}],
            **(probes or {})}
        volumes: list[dict[str, Any]] = [{"name": "shared", "persistentVolumeClaim": {"claimName": claim}},
                                         {"name": "config", "configMap": {"name": f"{self.job}-config"}}]
        if keys:  # only the files this role needs (no items would mean every key)
            container["volumeMounts"].append({"name": "keys", "mountPath": KEYS, "readOnly": True})
            volumes.append({"name": "keys", "secret": {"secretName": f"{self.job}-keys", "defaultMode": 0o400,
                                                       "items": [{"key": k, "path": p} for k, p in keys.items()]}})
        if ports:
            container["ports"] = [{"containerPort": p} for p in ports]
        limits = self.k8s.resources.get(role.replace("-", "_"))
        if limits:
            container["resources"] = {"limits": {k: str(v) for k, v in limits.items()}}
        return {"metadata": {"labels": self.labels(role)},
                "spec": {"restartPolicy": restart, "containers": [container], "volumes": volumes}}

    def _common(self) -> dict[str, object]:
        return {"job_dir": self.mount, "orchestrator": PYTHON, "model": self.cfg.model.name}

    # ------------------------------------------------------------------------------------ the roles

    def servers(self) -> Manifest:
        s, port = self.launch.servers, self.launch.servers.port
        index = "${HOSTNAME##*-}"  # the StatefulSet pod's ordinal
        seed = f"--seed $(({self.cfg.sim.seed} + {index}))"
        sim = shlex.join(self.cfg.sim.arguments(self.cfg.model.name, self.cfg.inference.backend,
                                                 self.cfg.inference.transfer_backend))
        values = {"port": port, "index": index, "local_index": 0, "node": "$NODE_NAME", "host": "$POD_IP",
                  "sim_args": f"{sim} {seed}", **self._common()}
        http = {"httpGet": {"path": s.health_path, "port": port}, "periodSeconds": 10}
        probes = {"startupProbe": {**http, "failureThreshold": max(1, int(self.launch.ready_timeout_s // 10))},
                  "readinessProbe": {**http, "failureThreshold": 1}, "livenessProbe": {**http, "failureThreshold": 3}}
        tpl = self.pod("servers", fill(s.command or "", values), {}, env={k: fill(v, values) for k, v in s.env.items()},
                       probes=probes, ports=[port])
        return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": self.meta(f"{self.job}-servers", "servers"),
                "spec": {"serviceName": f"{self.job}-servers", "replicas": s.own_nodes() * s.per_node,
                         "podManagementPolicy": "Parallel", "selector": {"matchLabels": self.selector("servers")},
                         "template": tpl}}

    def orchestrator_service(self) -> Manifest:
        o = self.launch.orchestrator
        ports = [("workers", o.worker_port), ("batches", o.trainer_port), ("acks", o.trainer_port + 1)]
        meta = self.meta(f"{self.job}-orchestrator", "orchestrator")
        return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
                "spec": {"selector": self.selector("orchestrator"),
                         "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports]}}

    def orchestrator(self) -> Manifest:
        o, cfg = self.launch.orchestrator, self.cfg
        sets = [f'scheduler.worker_address="tcp://0.0.0.0:{o.worker_port}"',
                f'transport.address="tcp://0.0.0.0:{o.trainer_port}"',
                f'security.server_key="{KEYS}/orchestrator.key_secret"',
                f'security.authorized_keys="{KEYS}/authorized"']
        if self.launch.servers.own_nodes():
            sets += ["inference.servers=[]", f'inference.discover="http://{self.fqdn("servers")}:'
                     f'{self.launch.servers.port}/v1"', f"inference.discover_interval_s={self.k8s.discover_interval_s}"]
        workers = self.launch.env_workers.own_nodes() * self.launch.env_workers.per_node
        if workers:
            sets += [f"scheduler.remote_workers={workers}", *(f"env[{i}].workers=0" for i in range(len(cfg.env)))]
        state = f"{cfg.run.output_dir}/orchestrator-state.msgpack"
        run = f"{PYTHON} run {CONFIG}/job.toml " + " ".join(f"--set '{s}'" for s in sets)
        command = f'if [ -e "{state}" ]; then set -- --resume; fi; exec {run} "$@"'
        tcp = {"tcpSocket": {"port": o.worker_port}, "periodSeconds": 10}
        probes = {"startupProbe": {**tcp, "failureThreshold": max(1, int(self.launch.ready_timeout_s // 10))},
                  "readinessProbe": {**tcp, "failureThreshold": 1}, "livenessProbe": {**tcp, "failureThreshold": 3}}
        keys = {"orchestrator.key_secret": "orchestrator.key_secret", "worker.key": "authorized/worker.key",
                "trainer.key": "authorized/trainer.key"}
        tpl = self.pod("orchestrator", command, keys, probes=probes, restart="OnFailure",
                       ports=[o.worker_port, o.trainer_port, o.trainer_port + 1])
        meta = self.meta(f"{self.job}-orchestrator", "orchestrator")
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
                "spec": {"backoffLimit": 6, "template": tpl}}

    def workers(self) -> Manifest:
        w, o = self.launch.env_workers, self.launch.orchestrator
        command = (f"exec {PYTHON} env-worker --connect tcp://{self.fqdn('orchestrator')}:{o.worker_port} "
                   f"--server-key {KEYS}/orchestrator.key --client-key {KEYS}/worker.key_secret"
                   + (f" --nice {w.nice}" if w.nice else ""))
        keys = {"orchestrator.key": "orchestrator.key", "worker.key_secret": "worker.key_secret"}
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.meta(f"{self.job}-env-workers",
                                                                                      "env-workers"),
                "spec": {"replicas": w.own_nodes() * w.per_node,
                         "selector": {"matchLabels": self.selector("env-workers")},
                         "template": self.pod("env-workers", command, keys)}}

    def trainer(self) -> Manifest:
        t, o = self.launch.trainer, self.launch.orchestrator
        nodes = max(1, t.own_nodes())
        values = {"address": f"tcp://{self.fqdn('orchestrator')}:{o.trainer_port}",
                  "server_key": f"{KEYS}/orchestrator.key", "client_key": f"{KEYS}/trainer.key_secret",
                  "master_addr": f"{self.job}-trainer-0.{self.fqdn('trainer')}", "master_port": t.master_port,
                  "nodes": nodes, **self._common()}
        keys = {"orchestrator.key": "orchestrator.key", "trainer.key_secret": "trainer.key_secret"}
        tpl = self.pod("trainer", fill(t.command or "", values), keys,
                       env={k: fill(v, values) for k, v in t.env.items()}, ports=[t.master_port], restart="OnFailure")
        tpl["spec"]["subdomain"] = f"{self.job}-trainer"  # pod i is {job}-trainer-i.{job}-trainer: {master_addr}
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": self.meta(f"{self.job}-trainer", "trainer"),
                "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes, "backoffLimit": 6,
                         "template": tpl}}


def write_manifests(manifests: list[tuple[str, Manifest]], out: Path) -> list[Path]:
    """One file per object in ``out`` (made with mode 0700), ``NN-name.yaml`` in the order to apply them; the
    Secret's file is mode 0600."""
    from orchestrator.launch.yaml import dump

    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = []
    for i, (name, manifest) in enumerate(manifests):
        path = out / f"{i:02d}-{name}.yaml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if manifest["kind"] == "Secret" else 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(dump(manifest))
        paths.append(path)
    return paths
