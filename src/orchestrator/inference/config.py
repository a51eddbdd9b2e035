"""The inference stage's config sections: ``[model]`` (what the servers serve), ``[inference]`` (the servers) and
``[inference.broadcast]`` (weights over the wire) and ``[teacher]`` (the frozen model that scores samples for on-policy
distillation)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from orchestrator.configbase import Source, opt


@dataclass(frozen=True)
class ModelConfig:
    name: str = opt("sim-model", doc="model name sent to the inference servers")
    tokenizer: str | None = opt(None, doc="the model's tokenizer directory (needed with real servers; unset: "
                                "the small built-in tokenizer of the simulated servers)")


@dataclass(frozen=True)
class BroadcastConfig:
    """How weights go over the wire (``weight_transfer = "broadcast"``): docs/inference-servers.md."""

    backend: Literal["gloo", "nccl"] = opt(
        "gloo", doc="'gloo': torch.distributed's gloo over TCP, CPUs (vLLM started with --weight-transfer-config "
        "'{\"backend\": \"gloo\"}' and this package installed in its venv); 'nccl': vLLM's own, GPUs (not tested "
        "here: no GPU)")
    master_address: str = opt("127.0.0.1", doc="the trainer's address as the servers' workers reach it: the trainer "
                              "serves the rendezvous there (rank 0)")
    master_port: int = opt(0, ge=0, le=65535, doc="its port; 0: the trainer picks a free one and says which")
    timeout_s: float = opt(60.0, gt=0, doc="bound of a group's rendezvous and of each chunk of a broadcast on "
                           "every rank: a peer that died (named at once) or went silent fails the transfer after it")
    trainer_timeout_s: float = opt(600.0, gt=0, doc="how long the orchestrator waits for the trainer to answer a "
                                   "request to join or to send (it answers between training steps); no server is "
                                   "paused meanwhile")
    buffer_mb: int = opt(256, ge=1, doc="chunk size (MB) of a broadcast: each chunk is one collective")
    retry_s: float = opt(5.0, gt=0, doc="after a failed broadcast, and while servers that joined late or came back "
                         "wait for the current weights (not on disk), a broadcast of them is tried this often")


@dataclass(frozen=True)
class InferenceConfig:
    servers: tuple[str, ...] = opt((), doc="base URLs of the inference engines, e.g. http://10.0.0.5:8000/v1 (each "
                                   "engine itself, not a router in front of several: the pool is the router); "
                                   "required unless discover is set or [launch.servers] starts them")
    discover: str | None = opt(None, doc="a base URL whose host is a DNS name with one address per engine (a "
                               "Kubernetes headless service), e.g. http://rl-servers.ns.svc:8000/v1: every address "
                               "it resolves to is a server, resolved again every discover_interval_s; a new one "
                               "joins rotation after preflight and a weight sync, one that vanishes leaves it")
    discover_interval_s: float = opt(5.0, gt=0, doc="how often inference.discover is resolved again")
    backend: Literal["vllm", "prime-rl"] = opt(
        "vllm", doc="server protocol: 'vllm' (VLLM_SERVER_DEV_MODE=1: pause, collective_rpc reload_weights, "
        "resume) or 'prime-rl' (prime-rl's inference server: pause, update_weights {weight_dir}, resume)")
    weights_path: str | None = opt(None, doc="where the weights of checkpoint step N are, '{step}' standing for N, "
                                   "e.g. /ckpt/step_{step}; a path the trainer announces wins")
    check_checkpoints: bool = opt(True, doc="before a weight sync, check here that the checkpoint's directory exists "
                                  "and holds weight files that are not corrupt (*.safetensors, *.bin, *.pt, or the "
                                  "simulator's tiny_policy.npz); one that fails is refused and no server is asked to "
                                  "load it (a real vLLM's engine dies on such a load). false: for hosts that do not "
                                  "see the servers' files at the same paths")
    unloadable_checkpoint_s: float = opt(600.0, gt=0, doc="after a checkpoint is refused (check_checkpoints), the "
                                         "run stops with exit status 1 if no checkpoint has loaded this long "
                                         "after; a newer or mended one that loads cancels it")
    api_key_env: str | None = opt(None, doc="environment variable holding the servers' API key (vLLM --api-key)")
    logprobs_mode: Literal["auto", "raw", "processed"] = opt(
        "auto", doc="which logprobs the servers report, as vLLM's --logprobs-mode: 'raw' (raw_logprobs, vLLM's "
        "default: log-softmax of the unscaled logits) or 'processed' (processed_logprobs: of the distribution "
        "sampled from); 'auto': what each server's GET /server_info says (vLLM in dev mode), raw where none can "
        "say. Preflight refuses servers that disagree, and raw logprobs with a sampling temperature other than 1 "
        "unless this says 'raw'; every batch tells the trainer the mode")
    preflight: bool = opt(True, doc="check every server before the run (reachable, model, admin routes, "
                          "tokenizer, one generate round trip) and stop with what to fix")
    request_timeout_s: float = opt(600.0, gt=0, doc="timeout of one request, env workers' generate calls included "
                                   "(a call waits through a weight sync's pause)")
    failures_to_evict: int = opt(3, ge=1, doc="consecutive failures that take a server out of rotation")
    probe_interval_s: float = opt(1.0, gt=0, doc="how often servers out of rotation are probed")
    weight_sync_timeout_s: float = opt(600.0, gt=0, doc="timeout of each pause/load/resume call (loading a "
                                       "large model's weights takes minutes)")
    no_server_warn_interval_s: float = opt(10.0, gt=0, doc="warning interval while no server is in rotation")
    weight_transfer: Literal["filesystem", "broadcast"] = opt(
        "filesystem", doc="how new weights reach the servers: 'filesystem' (each server loads the checkpoint's "
        "directory) or 'broadcast' (the trainer sends them to every server at once over the wire, "
        "[inference.broadcast]; a server that joins late loads the newest checkpoint directory the trainer wrote, "
        "else waits for the next broadcast)")
    broadcast: BroadcastConfig = opt(BroadcastConfig(), doc="[inference.broadcast]: weights over the wire")

    @property
    def transfer_backend(self) -> str | None:
        """The weight transfer engine every server must have (None: weights load from disk)."""
        return self.broadcast.backend if self.weight_transfer == "broadcast" else None

    def problems(self, key: str, source: Source) -> Iterable[str]:
        # none at all is the loader's check: [launch.servers] may start them (config.py)
        for i, url in enumerate(self.servers):
            if not url.startswith(("http://", "https://")):
                yield (f"{source(f'{key}.servers[{i}]')}: {key}.servers[{i}]: expected an http:// or "
                       f"https:// URL, got {url!r}")
        if self.weight_transfer == "broadcast" and self.backend != "vllm":
            yield (f"{source(f'{key}.weight_transfer')}: {key}.weight_transfer: 'broadcast' needs vLLM's weight "
                   f"transfer routes ({key}.backend = 'vllm'); {self.backend!r} servers load checkpoints from disk")
        if self.discover is not None:
            host = urlsplit(self.discover).hostname if self.discover.startswith(("http://", "https://")) else None
            if not host or urlsplit(self.discover).port is None:
                yield (f"{source(f'{key}.discover')}: {key}.discover: expected http://NAME:PORT/v1 (a DNS name and "
                       f"the port every server listens on), got {self.discover!r}")


@dataclass(frozen=True)
class TeacherConfig:
    """The frozen teacher of on-policy distillation (``[[env]] algorithm = "opd"`` or ``"reward+opd"``): env workers
    score every trainable sample of those envs under it, one prompt-logprobs request per sample (workers/teacher.py),
    and ship the teacher's logprob of each token in the ``ref_logprobs`` column. It must use the policy's tokenizer
    (preflight compares them)."""

    servers: tuple[str, ...] = opt(doc="base URLs of the teacher's inference engines (vLLM-compatible, serving "
                                   "POST /inference/v1/generate: --enable-scale-out on vLLM >= 0.30), e.g. "
                                   "http://10.0.0.7:8000/v1")
    model: str = opt(doc="the teacher's served model name")
    max_inflight: int = opt(32, ge=1, doc="teacher requests in flight across the job, split evenly over the env "
                            "workers (each gets at least 1)")
    max_inflight_per_worker: int = opt(8, ge=1, doc="teacher requests in flight per env worker, at most")
    request_timeout_s: float = opt(120.0, gt=0, doc="timeout of one scoring request (a prefill of the whole sample)")
    retries: int = opt(3, ge=0, doc="attempts after a scoring request's first, each on the next server after "
                       "retry_backoff_s (doubling); then the rollout fails as teacher_error, teacher_timeout or "
                       "teacher_malformed")
    retry_backoff_s: float = opt(1.0, ge=0, doc="wait before the first retry; doubles with each")
    api_key_env: str | None = opt(None, doc="environment variable holding the teacher servers' API key")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        if not self.servers:
            yield f"{source(f'{key}.servers')}: {key}.servers: at least one teacher server URL is required"
        for i, url in enumerate(self.servers):
            if not url.startswith(("http://", "https://")):
                yield (f"{source(f'{key}.servers[{i}]')}: {key}.servers[{i}]: expected an http:// or "
                       f"https:// URL, got {url!r}")

    def worker_share(self, workers: int) -> int:
        """Each of ``workers`` env workers' bound on teacher requests in flight: ``max_inflight`` split evenly
        (at least 1 each), at most ``max_inflight_per_worker``."""
        return max(1, min(self.max_inflight_per_worker, self.max_inflight // max(workers, 1)))
