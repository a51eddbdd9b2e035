"""``orchestrator launch k8s``: the manifests of the shipped launch configs are valid Kubernetes objects (checked
against the Kubernetes API's own JSON schemas, strict: no unknown field, by the ``kubernetes-validate`` package; no
cluster runs here), read back from the YAML we write, and what each role runs holds together: the orchestrator's
command line loads with its ConfigMap and the keys its Secret gives it, the servers are behind a headless service
the orchestrator follows, probes are on what each role serves."""

from __future__ import annotations

import base64
import shlex
import stat
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.launch.k8s import KEYS, render_manifests
from orchestrator.launch.yaml import dump, dump_all
from orchestrator.security import load_authorized_keys, load_key_pair, load_public_key

REPO = Path(__file__).resolve().parent.parent
CONFIGS = [REPO / "configs" / "launch_demo.toml", REPO / "configs" / "launch_vllm.toml"]
K8S_VERSION = "1.30"


def manifests(path: Path) -> dict[str, dict[str, Any]]:
    return dict(render_manifests(load_config(path), path, []))


def container(m: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = m["spec"]["template"]["spec"]["containers"][0]
    return found


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_object_is_valid_against_the_kubernetes_schema(path: Path) -> None:
    objects = manifests(path)
    assert {m["kind"] for m in objects.values()} >= {"Secret", "ConfigMap", "Service", "StatefulSet", "Job"}
    for m in objects.values():
        kubernetes_validate.validate(m, K8S_VERSION, strict=True)  # raises naming the field


def test_the_validator_refuses_what_kubernetes_would() -> None:
    """The check above can fail: a misspelt field and a wrong type are refused."""
    servers = manifests(CONFIGS[0])["servers"]
    container(servers)["readinesProbe"] = container(servers).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(servers, K8S_VERSION, strict=True)
    job = manifests(CONFIGS[0])["trainer"]
    job["spec"]["completions"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_yaml_reads_back_as_the_objects(path: Path) -> None:
    objects = list(manifests(path).values())
    assert list(yaml.safe_load_all(dump_all(objects))) == objects
    text = dump(objects[1])
    assert yaml.safe_load(text)["data"]["job.toml"] == objects[1]["data"]["job.toml"]
    assert "job.toml: |" in text  # a literal block, as written
    assert "\n[run]\n" in objects[1]["data"]["job.toml"]


def test_the_orchestrator_runs_with_its_config_and_keys(tmp_path: Path) -> None:
    """Its pod's command line, with the ConfigMap and the Secret's files where the pod mounts them, loads."""
    objects = manifests(CONFIGS[0])
    secret = {k: base64.b64decode(v) for k, v in objects["secret-keys"]["data"].items()}
    keys = tmp_path / "keys"
    volumes = {v["name"]: v for v in objects["orchestrator"]["spec"]["template"]["spec"]["volumes"]}
    for item in volumes["keys"]["secret"]["items"]:
        (keys / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (keys / item["path"]).write_bytes(secret[item["key"]])
    assert sorted(str(p.relative_to(keys)) for p in keys.rglob("*.key*")) == [
        "authorized/trainer.key", "authorized/worker.key", "orchestrator.key_secret"]  # no other role's secret
    (tmp_path / "job.toml").write_text(objects["configmap"]["data"]["job.toml"])
    command = container(objects["orchestrator"])["command"][2].replace(KEYS, str(keys))
    argv = shlex.split(command[command.index("exec ") + 5:])
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = load_config(tmp_path / "job.toml", sets)  # the keys are checked as it loads
    assert cfg.inference.discover == "http://launch-demo-servers.rl.svc.cluster.local:8000/v1"
    assert (cfg.scheduler.remote_workers, [e.workers for e in cfg.env]) == (2, [0, 0])
    assert load_authorized_keys(keys / "authorized") == {load_public_key(keys / "authorized/worker.key"),
                                                          load_public_key(keys / "authorized/trainer.key")}
    assert 'then set -- --resume; fi' in command  # a restarted pod resumes from its state


def test_probes_are_on_what_each_role_serves() -> None:
    objects = manifests(CONFIGS[0])
    servers, orch = container(objects["servers"]), container(objects["orchestrator"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert servers[probe]["httpGet"] == {"path": "/health", "port": 8000}
        assert orch[probe]["tcpSocket"] == {"port": 5600}
    assert not {"readinessProbe", "livenessProbe"} & (set(container(objects["env-workers"])) |
                                                       set(container(objects["trainer"])))
    assert objects["servers-service"]["spec"]["clusterIP"] == "None"  # headless: a DNS record per ready server
    assert objects["servers"]["spec"]["replicas"] == 2
    trainer = objects["trainer"]
    assert (trainer["spec"]["completionMode"], trainer["spec"]["template"]["spec"]["subdomain"]) == (
        "Indexed", "launch-demo-trainer")
    assert "--client-key /keys/trainer.key_secret" in container(trainer)["command"][2]


def test_gpu_resources_and_per_server_gpus() -> None:
    objects = manifests(CONFIGS[1])
    assert container(objects["servers"])["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert container(objects["trainer"])["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert objects["servers"]["spec"]["replicas"] == 16
    assert objects["pvc"]["spec"]["storageClassName"] == "nfs-client"


def test_out_writes_a_file_per_object_and_keeps_the_secret_private(tmp_path: Path) -> None:
    assert main(["launch", "k8s", str(CONFIGS[0]), "--out", str(tmp_path / "k8s")]) == 0
    files = sorted((tmp_path / "k8s").iterdir())
    assert files[0].name == "00-secret-keys.yaml"
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert [yaml.safe_load(f.read_text())["kind"] for f in files] == [
        m["kind"] for m in manifests(CONFIGS[0]).values()]
    secret = yaml.safe_load(files[0].read_text())["data"]
    keys = tmp_path / "one.key_secret"
    keys.write_bytes(base64.b64decode(secret["orchestrator.key_secret"]))
    assert load_key_pair(keys).public  # a real key pair


def test_k8s_needs_an_image(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = CONFIGS[0].read_text().replace('image = "registry.example.com/rollout-orchestrator:0.1.0"', "")
    (tmp_path / "job.toml").write_text(text)
    assert main(["launch", "k8s", str(tmp_path / "job.toml")]) == 2
    assert "launch.k8s.image: required" in capsys.readouterr().err
