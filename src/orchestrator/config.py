"""The job's configuration: TOML in, a frozen typed tree out.

One TOML file per job. Each section is a frozen dataclass below; every field has a documented default or
is required. ``[[env]]`` tables (one per environment) may live in the job file or in per-env files named by
a top-level ``include = ["envs/a.toml", ...]`` (paths relative to the including file).

Validation only checks: a config that loads is exactly what the user wrote plus the defaults documented
here. Every problem names the file (or ``--set``) and the full key path, and all problems are reported at
once. The only conversion is TOML's integer to a float field (``1`` for ``1.0``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orchestrator.configbase import opt
from orchestrator.errors import ConfigError, KeyFileError
from orchestrator.rollouts.curriculum import CurriculumConfig
from orchestrator.scoring.gates import DEFAULT_GATES, GateConfig

if typing.TYPE_CHECKING:
    from orchestrator.security import ServerKeys


@dataclass(frozen=True)
class RunConfig:
    name: str = opt("run", doc="run id, stamped on every batch sent to the trainer")
    output_dir: str = opt("outputs/run", doc="rollouts.jsonl, metrics.jsonl, dumps and state go here")
    seed: int = opt(0, ge=0, doc="seeds task order and the simulated servers")
    max_steps: int = opt(100, ge=1, doc="steps to run before a clean exit")
    gil_switch_ms: float = opt(0.5, gt=0, le=100, doc="sys.setswitchinterval of the orchestrator process: how long "
                               "the event loop can wait for the GIL while a step thread runs Python (Python's "
                               "default, 5 ms, is the worst loop stall it allows; bench_data_plane.py measured "
                               "max lag 3-8 ms with it, 2.6-3.3 ms with 0.5)")


@dataclass(frozen=True)
class ModelConfig:
    name: str = opt("sim-model", doc="model name sent to the inference servers")
    tokenizer: str | None = opt(None, doc="the model's tokenizer directory (needed with real servers; unset: "
                                "the small built-in tokenizer of the simulated servers)")


@dataclass(frozen=True)
class InferenceConfig:
    servers: tuple[str, ...] = opt(doc="base URLs of the inference engines, e.g. http://10.0.0.5:8000/v1 (each "
                                   "engine itself, not a router in front of several: the pool is the router)")
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


@dataclass(frozen=True)
class SimConfig:
    """The built-in simulated inference server (demo, tests, benchmarks); flags of `sim-inference` match."""

    profile: Literal["vllm-0.26", "vllm-0.31", "vllm-0.32", "vllm-0.33", "prime-rl"] | None = opt(
        None, doc="server the simulator plays; unset: the one inference.backend names (vllm: vllm-0.31)")
    dev_mode: bool = opt(True, doc="vLLM profiles: serve the admin routes, as VLLM_SERVER_DEV_MODE=1 does")
    scale_out: bool = opt(True, doc="vLLM 0.31+ profiles: serve POST /inference/v1/generate, as vLLM started with "
                          "--enable-scale-out does (false: 0.31 answers 404, 0.32+ 403)")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = opt(
        "raw_logprobs", doc="which logprobs the servers report, as vLLM's --logprobs-mode: raw_logprobs (vLLM's "
        "default: the log-softmax of the unscaled logits) or processed_logprobs (of the distribution sampled from)")
    servers: int = opt(2, ge=1, doc="simulated servers the demo starts")
    seed: int = opt(0, ge=0, doc="seeds sampled tokens and injected faults")
    latency_ms: float = opt(0.0, ge=0, doc="added latency per request (lower bound of the range)")
    latency_max_ms: float | None = opt(None, ge=0, doc="upper bound of a random latency range")
    error_rate: float = opt(0.0, ge=0, le=1, doc="fraction of requests answered with HTTP 500")
    hang_rate: float = opt(0.0, ge=0, le=1, doc="fraction of requests never answered")
    malformed_rate: float = opt(0.0, ge=0, le=1, doc="fraction of malformed replies")
    drop_rate: float = opt(0.0, ge=0, le=1, doc="fraction of connections dropped without a reply")
    layers: int = opt(0, ge=0, doc="MoE layers for routed experts (0: no routed experts)")
    top_k: int = opt(0, ge=0, doc="experts per token for routed experts")
    num_experts: int = opt(64, ge=1, le=65535, doc="experts per layer (above 256 expert ids travel as uint16)")


@dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int | None = opt(None, ge=1, doc="rollouts per step (set this or token_budget)")
    token_budget: int | None = opt(None, ge=1, doc="tokens per step (set this or batch_size)")
    max_inflight: int = opt(64, ge=1, doc="rollouts running at once")
    max_async_level: int = opt(1, ge=0, doc="a batch for step s takes rollouts sampled at step >= s - this")
    max_off_policy_steps: int = opt(4, ge=0, doc="in-flight rollouts this many steps old are cancelled")
    group_timeout_s: float = opt(600.0, gt=0, doc="a group still running after this long is failed")
    worker_address: str | None = opt(None, doc="ZMQ address env workers connect to; unset: ipc:// in output_dir")
    remote_workers: int = opt(0, ge=0, doc="env workers on other hosts (orchestrator env-worker --connect "
                              "worker_address) that must be ready before the first group")
    max_buffered_rollouts: int = opt(1024, ge=1, doc="finished rollouts not in a step yet; full: no new work")
    worker_nice: int = opt(5, ge=0, le=19, doc="niceness added to local env workers, so the loop gets a busy CPU first")
    worker_silence_s: float = opt(10.0, ge=2, doc="an env worker that sends nothing (not even its heartbeat, every "
                                  "second) this long is lost: its rollouts fail; a local one is killed and restarted, "
                                  "a remote one re-admitted when it speaks again")
    # 50 (groups of 4, steps of 8): with a quarter of groups passing the gates a step stops by chance with
    # probability ~1e-11; with 2% passing, 40% of steps stop, after 50 steps' worth of inference
    max_rejected_batches: int = opt(50, ge=0, doc="a step that has seen this many batches' worth of rollouts "
                                    "rejected by gates without filling stops the run (0: never)")


@dataclass(frozen=True)
class TransportConfig:
    kind: Literal["zmq", "shm", "filesystem", "prime-rl"] = opt(
        "zmq", doc="how batches reach the trainer; prime-rl: per-rank micro-batches to prime-rl's own trainer")
    address: str | None = opt(None, doc="ZMQ address to bind; unset means ipc:// in output_dir (kind = prime-rl: "
                              "tcp://HOST:PORT, READY on PORT + 1)")
    send_hwm: int = opt(2, ge=1, doc="steps sent and not yet acknowledged before sends wait (back-pressure); "
                        "kind = prime-rl: steps ahead of the trainer's newest weights + 1 (2 is prime-rl's rule)")
    checkpoint_source: Literal["zmq", "marker"] = opt("zmq", doc="how the trainer announces checkpoints")
    marker_dir: str | None = opt(None, doc="checkpoint marker files' directory (checkpoint_source = marker)")
    directory: str | None = opt(None, doc="batch directory (kind = filesystem)")
    shm_pool_mb: int = opt(4096, ge=1, doc="shared-memory pool size (kind = shm); a bigger step goes as frames")
    trainer_dir: str | None = opt(None, doc="kind = prime-rl: the trainer's output_dir; weights are read from its "
                                  "broadcasts/step_N/STABLE (prime_rl_layout = filesystem: batches go to rollouts/)")
    prime_rl_layout: Literal["zmq", "filesystem"] = opt(
        "zmq", doc="kind = prime-rl: its rollout_transport.type: zmq (PUB on address) or filesystem (files)")
    data_ranks: int = opt(1, ge=1, doc="kind = prime-rl: the trainer's data-parallel ranks (its num_train_workers)")
    seq_len: int = opt(2048, ge=1, doc="kind = prime-rl: micro-batch length; longer samples are truncated to it")
    pad_to_multiple_of: int = opt(1, ge=1, doc="kind = prime-rl: micro-batches are padded to a multiple of this "
                                  "(the trainer's context parallelism)")
    keep_acked: int = opt(0, ge=0, doc="kind = zmq: acknowledged steps kept in memory to resend to a trainer that "
                          "restarts behind them (it acknowledges before it checkpoints); 0: such a trainer is "
                          "refused, naming the steps it lacks")
    data_plane: Literal["through", "direct"] = opt(
        "through", doc="how rollout columns reach the trainer: through this process (as frames), or direct: "
        "written once into each env worker's column pool, the trainer reading them from there (docs/data-plane.md; "
        "needs kind = zmq and keep_acked = 0)")
    worker_pool_mb: int = opt(1024, ge=1, le=1 << 20, doc="data_plane = direct: each env worker's column pool; "
                              "holds its rollouts until they are dropped or their step is acknowledged")
    span_address: str | None = opt(None, doc="data_plane = direct: tcp://HOST:0, where the local env workers serve "
                                   "their column pools to trainers on other hosts (a port each; CURVE with "
                                   "[security] keys, which a non-loopback HOST needs); unset: trainers on this "
                                   "host map the pools, and no other host can read them")


@dataclass(frozen=True)
class SecurityConfig:
    """CURVE keys for the tcp:// sockets the orchestrator binds (README "Security"). Paths, like every path
    in this file except ``include``, are relative to the working directory unless absolute."""

    server_key: str | None = opt(None, doc="the orchestrator's secret key file NAME.key_secret (made by "
                                           "`orchestrator keys`); unset: no CURVE, tcp:// only on loopback")
    authorized_keys: str | None = opt(None, doc="directory of the public NAME.key files of the env workers and "
                                                "trainers allowed to connect (read at start)")
    allow_unauthenticated_trainer: bool = opt(False, doc="kind = 'prime-rl' only: allow a non-loopback trainer "
                                                         "address, though prime-rl's link has no authentication")

    def server_keys(self, address: str) -> ServerKeys | None:
        """The CURVE keys for a socket bound at ``address``: None for ipc:// (file permissions guard it) or
        when no keys are set. KeyFileError if a key file changed for the worse since the config loaded."""
        if self.server_key is None or self.authorized_keys is None or not address.startswith("tcp://"):
            return None
        from orchestrator.security import load_server_keys

        return load_server_keys(self.server_key, self.authorized_keys)


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases (``pip install 'rollout-orchestrator[wandb]'``); its API key comes from W&B's own
    login or ``WANDB_API_KEY``, never from this file."""

    project: str = opt(doc="W&B project")
    entity: str | None = opt(None, doc="W&B entity (team or user); unset: your default entity")
    name: str | None = opt(None, doc="run name; unset: run.name")
    mode: Literal["online", "offline", "disabled"] = opt(
        "online", doc="offline: write the run under output_dir/wandb, upload later with `wandb sync`")
    tags: tuple[str, ...] = opt((), doc="run tags")
    samples_every: int = opt(10, ge=0, doc="a table of sample rollouts (text, reward, advantage) every N steps; "
                             "0: none")
    samples: int = opt(8, ge=1, doc="rollouts in each samples table (the first rollout of the step's first groups)")


@dataclass(frozen=True)
class MonitorConfig:
    lag_interval_s: float = opt(0.1, gt=0, le=10, doc="event-loop-lag sampling interval")
    lag_window: int = opt(4096, ge=16, doc="lag samples kept per step (oldest dropped first)")
    lag_warn_ms: float = opt(50.0, gt=0, doc="a stall longer than this is logged as a warning")
    lag_error_ms: float = opt(500.0, gt=0, doc="a stall longer than this is logged as an error")
    stall_warn_s: float = opt(30.0, gt=0, doc="liveness bound: a step that makes no progress for this long gets a "
                              "line saying what it waits for (a checkpoint, the trainer, workers, servers), again "
                              "every as long")
    wandb: WandbConfig | None = opt(None, doc="[monitor.wandb]: also log to Weights & Biases; unset: metrics.jsonl "
                                    "only")


@dataclass(frozen=True, kw_only=True)
class FilterConfig:
    name: str = opt(doc="'zero_advantage', 'gibberish', 'repetition', or module:function(rollout, **args) -> bool")
    enforce: bool = opt(doc="true: matched rollouts are not trained on; false: only counted (monitor)")
    args: dict[str, Any] = opt({}, doc="keyword arguments of the filter")


OWNED_SAMPLING_KEYS = {"cache_salt", "logprobs", "stop_token_ids", "routed_experts_prompt_start"}

DEFAULT_FILTERS = (
    FilterConfig(name="zero_advantage", enforce=True),
    FilterConfig(name="gibberish", enforce=False),
    FilterConfig(name="repetition", enforce=False),
)


@dataclass(frozen=True)
class PipelineConfig:
    advantage: str = opt("default", doc="'default' or module:function(group, **kwargs) -> list[float]")
    advantage_kwargs: dict[str, Any] = opt({}, doc="keyword arguments of the advantage function")
    std_normalize: bool = opt(False, doc="default advantage: divide by the group's reward std")
    filters: tuple[FilterConfig, ...] = opt(DEFAULT_FILTERS, doc="[[pipeline.filters]] tables, in order")
    gates: tuple[GateConfig, ...] = opt(DEFAULT_GATES, doc="[[pipeline.gates]] tables: which completed groups count "
                                        "toward a step (the step refills past rejected ones)")
    dump_steps: int | tuple[int, ...] = opt(0, ge=0, doc="step dumps in output_dir/dumps for offline replay: N dumps "
                                            "steps 0, N, 2N...; a list dumps those steps; 0 or [] dumps none")


@dataclass(frozen=True)
class SamplingConfig:
    """Sent to the server as written; an unset key is not sent, so the server's default applies."""

    max_tokens: int = opt(256, ge=1, doc="tokens sampled per turn")
    temperature: float = opt(1.0, ge=0, doc="sampling temperature (also sent to the trainer with each sample)")
    top_p: float | None = opt(None, gt=0, le=1, doc="nucleus sampling")
    top_k: int | None = opt(None, ge=-1, doc="sample from the k most likely tokens (-1: all)")
    min_p: float | None = opt(None, ge=0, le=1, doc="minimum probability relative to the most likely token")
    repetition_penalty: float | None = opt(None, gt=0, doc="vLLM's repetition penalty (1: none)")
    presence_penalty: float | None = opt(None, ge=-2, le=2, doc="OpenAI-style presence penalty")
    frequency_penalty: float | None = opt(None, ge=-2, le=2, doc="OpenAI-style frequency penalty")
    stop: tuple[str, ...] | None = opt(None, doc="strings that end a turn")
    seed: int | None = opt(None, doc="per-request seed (with group_size > 1 every rollout of a group would be "
                           "the same: only for group_size = 1)")
    extra_body: dict[str, Any] = opt({}, doc="more sampling parameters for the server, passed through as they are")

    def params(self) -> dict[str, Any]:
        """What is sent: every key that is set, and ``extra_body``'s keys."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "extra_body"}
        if self.stop is not None:
            out["stop"] = list(self.stop)
        return {**out, **self.extra_body}


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    name: str | None = opt(None, doc="name in logs and metrics; unset means the taskset id")
    taskset: str = opt(doc="verifiers taskset id: an installed package exporting a Taskset (orchestrator-arithmetic "
                       "is module orchestrator_arithmetic) or one of verifiers' own (textarena)")
    args: dict[str, Any] = opt({}, doc="arguments of the taskset")
    group_size: int = opt(8, ge=1, doc="rollouts per task (one group)")
    weight: float = opt(1.0, gt=0, doc="mixing weight among environments")
    workers: int = opt(1, ge=0, doc="env worker processes; 0 runs in-process (debugging only)")
    max_concurrent: int | None = opt(None, ge=1, doc="rollouts of this env running at once")
    group_scoring: bool = opt(False, doc="the env scores whole groups: any failure drops the group")
    sampling: SamplingConfig = opt(SamplingConfig(), doc="sampling parameters")
    curriculum: CurriculumConfig | None = opt(None, doc="[env.curriculum]: draw tasks from pools by their recent "
                                              "pass rate; unset: every task in turn, in a seeded order")
    verifiers: dict[str, Any] = opt({}, doc="verifiers' [env] table without taskset, passed through: each seat "
                                    "(agent, player...) with harness, runtime (unset: subprocess), max_turns, token "
                                    "limits, timeout, retries; the env's timeout, retries... (checked by verifiers "
                                    "in `orchestrator check` and the env workers)")
    select: dict[str, Any] = opt({}, doc="which tasks, as verifiers' SelectConfig: limit, skip, include, exclude... "
                                 "(an endless taskset needs limit)")

    @property
    def label(self) -> str:
        return self.name or self.taskset


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Online evaluation: every ``interval`` steps, the first ``num_examples`` tasks of each ``[[eval.env]]``,
    ``group_size`` rollouts each, under one policy version, beside training."""

    interval: int = opt(10, ge=1, doc="evaluate at steps 0 (see at_start), interval, 2*interval...")
    num_examples: int = opt(32, ge=1, doc="tasks per environment: the first ones of its taskset, every time")
    group_size: int = opt(4, ge=1, doc="rollouts per task (k): pass@k and pass^k for k = 1, 2, 4... up to it")
    at_start: bool = opt(True, doc="evaluate the starting policy at step 0 too")
    pass_threshold: float = opt(0.5, doc="a rollout passes when its reward is above this")
    max_inflight: int | None = opt(None, ge=1, doc="evaluation rollouts at once, within scheduler.max_inflight "
                                   "(default: half of it), so evaluation never starves training")
    hold_weights: bool = opt(True, doc="a round keeps the policy it started with: a weight sync waits for it "
                             "(training goes on meanwhile); false: record the versions that sampled it")
    env: tuple[EnvConfig, ...] = opt(doc="[[eval.env]] tables, as [[env]] (group_size, weight, curriculum unused)")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    run: RunConfig = opt(RunConfig(), doc="run identity and output")
    model: ModelConfig = opt(ModelConfig(), doc="model and tokenizer")
    inference: InferenceConfig = opt(doc="inference servers")
    scheduler: SchedulerConfig = opt(SchedulerConfig(), doc="rollout scheduling")
    transport: TransportConfig = opt(TransportConfig(), doc="batches to the trainer")
    security: SecurityConfig = opt(SecurityConfig(), doc="CURVE authentication of the tcp:// sockets we bind")
    monitor: MonitorConfig = opt(MonitorConfig(), doc="event-loop-lag monitor")
    pipeline: PipelineConfig = opt(PipelineConfig(), doc="advantages, filters and gates")
    eval: EvalConfig | None = opt(None, doc="[eval]: online evaluation; unset: none")
    sim: SimConfig = opt(SimConfig(), doc="simulated inference servers (demo and tests)")
    env: tuple[EnvConfig, ...] = opt(doc="one [[env]] table per environment")


# ---------------------------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read ``path`` (and its includes), apply ``--set key=value`` overrides, and validate.

    Raises ConfigError listing every problem found, each naming its file (or ``--set``) and key path.
    """
    path = Path(path)
    raw, env_files = _read_with_includes(path)
    set_keys: set[str] = set()
    for item in overrides:
        key = _apply_override(raw, item)
        set_keys.add(key)

    def source(key: str) -> str:
        for k in set_keys:
            if key == k or key.startswith((k + ".", k + "[")) or k.startswith((key + ".", key + "[")):
                return f"--set {k}"
        if key.startswith("env[") and "]" in key:
            i = int(key[4 : key.index("]")])
            if i < len(env_files):
                f, j = env_files[i]
                return f"{f}: env[{j}]" if f != str(path) else str(path)
        return str(path)

    problems: list[str] = []
    cfg = _build(JobConfig, raw, "", problems, source)
    if not problems:
        problems.extend(_cross_checks(typing.cast(JobConfig, cfg), source))
        problems.extend(_section_problems(cfg, "", source))
    if not problems:
        problems.extend(_hook_problems(typing.cast(JobConfig, cfg), source))
    if problems:
        raise ConfigError(problems)
    return typing.cast(JobConfig, cfg)


def _hook_problems(cfg: JobConfig, source: Any) -> list[str]:
    """Build the advantage function and the filters once, so a hook that cannot be imported or arguments a
    filter does not take are config errors here, before anything starts (not a failure minutes later)."""
    from orchestrator.scoring.advantage import AdvantageFn  # the pipeline imports this module
    from orchestrator.scoring.filters import FilterSet

    problems: list[str] = []
    for build in (lambda: AdvantageFn(cfg.pipeline), lambda: FilterSet(cfg.pipeline.filters, vocab_size=2**17)):
        try:
            build()
        except ConfigError as e:
            problems += [f"{source(p.split(':', 1)[0].split('.args')[0])}: {p}" for p in e.problems]
    return problems


def _eval_checks(cfg: JobConfig, source: Any) -> Iterable[str]:
    ev, s = cfg.eval, cfg.scheduler
    assert ev is not None
    if not ev.env:
        yield f"{source('eval.env')}: eval.env: [eval] needs at least one [[eval.env]] table"
    cap = ev.max_inflight or max(s.max_inflight // 2, 1)
    if ev.group_size > cap:
        yield (f"{source('eval.group_size')}: eval.group_size: {ev.group_size} rollouts of a task must fit in "
               f"eval.max_inflight ({cap}{'' if ev.max_inflight else ': half of scheduler.max_inflight'})")
    if ev.max_inflight is not None and ev.max_inflight >= s.max_inflight:
        yield (f"{source('eval.max_inflight')}: eval.max_inflight: must be below scheduler.max_inflight "
               f"({ev.max_inflight} >= {s.max_inflight}), or evaluation could take every slot from training")
    labels = [e.label for e in ev.env]
    for i, label in enumerate(labels):
        if label in labels[:i]:
            yield (f"{source(f'eval.env[{i}].name')}: eval.env[{i}].name: {label!r} is already used by another "
                   "[[eval.env]]; give each a distinct name")


def _section_problems(obj: Any, key: str, source: Any) -> Iterable[str]:
    """What each section that checks itself (``problems(key)``, see configbase) says, depth first."""
    if not dataclasses.is_dataclass(obj):
        return
    check = getattr(obj, "problems", None)
    if check is not None:
        yield from (f"{source(key)}: {p}" for p in check(key))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        sub = _join(key, f.name)
        if isinstance(value, tuple):
            for i, item in enumerate(value):
                yield from _section_problems(item, f"{sub}[{i}]", source)
        else:
            yield from _section_problems(value, sub, source)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError([f"{path}: file not found"]) from None
    except IsADirectoryError:
        raise ConfigError([f"{path}: a directory, not a TOML file"]) from None
    except OSError as e:
        raise ConfigError([f"{path}: cannot read it ({e.strerror})"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: not a text file (byte {e.start} is not UTF-8); expected TOML"]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{path}: not valid TOML: {e}"]) from None


def _read_with_includes(path: Path) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """The job file's tables with every included file's ``[[env]]`` tables appended.

    Also returns, for each env entry, the file it came from and its index there (for error messages).
    """
    raw = _read_toml(path)
    envs = raw.get("env", [])
    if not isinstance(envs, list):
        raise ConfigError([f"{path}: env: expected [[env]] tables, got {_type_name(envs)}"])
    origins = [(str(path), i) for i in range(len(envs))]
    includes = raw.pop("include", [])
    if not isinstance(includes, list) or not all(isinstance(x, str) for x in includes):
        raise ConfigError([f"{path}: include: expected a list of file paths, got {includes!r}"])
    for n, inc in enumerate(includes):
        inc_path = path.parent / inc
        try:
            inc_raw = _read_toml(inc_path)
        except ConfigError as e:  # say which file names it, and where
            raise ConfigError([f"{path}: include[{n}]: {p}" for p in e.problems]) from None
        extra = sorted(set(inc_raw) - {"env"})
        if extra:
            raise ConfigError([f"{inc_path}: {k}: unknown key (an included file holds only [[env]] tables)"
                               for k in extra])
        inc_envs = inc_raw.get("env", [])
        if not isinstance(inc_envs, list):
            raise ConfigError([f"{inc_path}: env: expected [[env]] tables, got {_type_name(inc_envs)}"])
        origins += [(str(inc_path), i) for i in range(len(inc_envs))]
        envs = envs + inc_envs
    if envs or "env" in raw:
        raw["env"] = envs
    return raw, origins


def _apply_override(raw: dict[str, Any], item: str) -> str:
    """Apply one ``a.b.c=value`` override (value parsed as TOML, else taken as a string); return the key."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError([f"--set {item}: expected KEY=VALUE, e.g. --set scheduler.max_inflight=32"])
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    parts = key.replace("[", ".").replace("]", "").split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError([f"--set {key}: index {part} out of range ({len(node)} entries)"])
            node = node[int(part)]
        else:
            node = node.setdefault(part, [] if nxt.isdigit() else {})
        if not isinstance(node, dict | list):
            raise ConfigError([f"--set {key}: {'.'.join(parts[: i + 1])} is not a table"])
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError([f"--set {key}: index {last} out of range ({len(node)} entries)"])
        node[int(last)] = value
    else:
        node[last] = value
    return ".".join(f"[{p}]" if p.isdigit() else p for p in parts).replace(".[", "[")


def _type_name(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a float"}.get(type(value), type(value).__name__)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is bool:
        return "true or false"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"an array of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a table"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp):
        return "a table"
    return str(tp)


def _build(tp: Any, value: Any, key: str, problems: list[str], source: Any) -> Any:
    """Check ``value`` against type ``tp``; return the typed value (or None after recording a problem)."""

    def bad(msg: str) -> None:
        problems.append(f"{source(key)}: {key or '(top level)'}: {msg}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _build(args[0], value, key, problems, source)
        for arg in args:  # e.g. int | tuple[int, ...]: the first member that fits
            scratch: list[str] = []
            built = _build(arg, value, key, scratch, source)
            if not scratch:
                return built
        arrays = [a for a in args if typing.get_origin(a) is tuple]
        if isinstance(value, list) and arrays:  # an array with a bad item: name the item
            return _build(arrays[0], value, key, problems, source)
        bad(f"expected {_describe(tp)}, got {_type_name(value)} {value!r}")
        return None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            bad(f"expected a table, got {_type_name(value)}")
            return None
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        for k in value:
            if k not in fields:
                close = [n for n in fields if n.startswith(k[:3])]
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"{source(_join(key, k))}: {_join(key, k)}: unknown key{hint}; "
                                f"valid keys: {', '.join(fields)}")
        kwargs: dict[str, Any] = {}
        for name, f in fields.items():
            sub = _join(key, name)
            if name not in value:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    problems.append(f"{source(sub)}: {sub}: missing required key; "
                                    f"expected {_describe(hints[name])} ({f.metadata.get('doc', '')})")
                continue
            v = value[name]
            if dataclasses.is_dataclass(hints[name]) and v is None:
                bad(f"{name}: expected a table")
                continue
            built = _build(hints[name], v, sub, problems, source)
            if built is not None:
                _check_bounds(built, f.metadata, sub, problems, source)
                kwargs[name] = built
        try:
            return typing.cast(Any, tp)(**kwargs)
        except TypeError:
            return None  # a required field was missing: already reported
    if origin is tuple:
        if not isinstance(value, list):
            bad(f"expected {_describe(tp)}, got {_type_name(value)}")
            return None
        (item_tp, _) = typing.get_args(tp)
        items = [_build(item_tp, v, f"{key}[{i}]", problems, source) for i, v in enumerate(value)]
        return tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            bad(f"expected a table, got {_type_name(value)}")
            return None
        return dict(value)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            bad(f"expected {_describe(tp)}, got {value!r}")
            return None
        return value
    if tp is bool:
        if not isinstance(value, bool):
            bad(f"expected true or false, got {_type_name(value)} {value!r}")
            return None
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            bad(f"expected an integer, got {_type_name(value)} {value!r}")
            return None
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            bad(f"expected a number, got {_type_name(value)} {value!r}")
            return None
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            bad(f"expected a string, got {_type_name(value)} {value!r}")
            return None
        return value
    if tp is Any:
        return value
    raise TypeError(f"config schema uses an unsupported type {tp!r} at {key}")  # a bug in this module


def _check_bounds(value: Any, meta: Mapping[str, Any], key: str, problems: list[str], source: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return
    if not math.isfinite(value):
        problems.append(f"{source(key)}: {key}: expected a finite number, got {value!r}")
        return
    for name, word in (("ge", ">="), ("gt", ">"), ("le", "<=")):
        bound = meta.get(name)
        if bound is None:
            continue
        ok = value >= bound if name == "ge" else value > bound if name == "gt" else value <= bound
        if not ok:
            problems.append(f"{source(key)}: {key}: expected a value {word} {bound}, got {value!r}")


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _cross_checks(cfg: JobConfig, source: Any) -> Iterable[str]:
    """Combinations that cannot work, each named by the key to change."""
    s = cfg.scheduler
    if (s.batch_size is None) == (s.token_budget is None):
        yield (f"{source('scheduler.batch_size')}: scheduler.batch_size / scheduler.token_budget: "
               "set exactly one of them (a step is batch_size rollouts or token_budget tokens)")
    if s.max_off_policy_steps < s.max_async_level:
        yield (f"{source('scheduler.max_off_policy_steps')}: scheduler.max_off_policy_steps: must be >= "
               f"scheduler.max_async_level ({s.max_off_policy_steps} < {s.max_async_level}), or rollouts "
               "still usable would be cancelled")
    if s.batch_size is not None and s.max_buffered_rollouts < s.batch_size:
        yield (f"{source('scheduler.max_buffered_rollouts')}: scheduler.max_buffered_rollouts: must be >= "
               f"scheduler.batch_size ({s.max_buffered_rollouts} < {s.batch_size}), or no step can fill")
    if not cfg.env:
        yield f"{source('env')}: env: at least one [[env]] table is required"
    labels: dict[str, int] = {}
    for i, env in enumerate(cfg.env):
        if env.group_size > s.max_inflight:
            yield (f"{source(f'env[{i}].group_size')}: env[{i}].group_size: {env.group_size} is larger than "
                   f"scheduler.max_inflight ({s.max_inflight}); a group must fit in flight at once")
        if env.max_concurrent is not None and env.group_size > env.max_concurrent:
            yield (f"{source(f'env[{i}].max_concurrent')}: env[{i}].max_concurrent: must be >= "
                   f"group_size ({env.max_concurrent} < {env.group_size})")
        if env.group_size == 1 and cfg.pipeline.advantage == "default":
            yield (f"{source(f'env[{i}].group_size')}: env[{i}].group_size: 1 with the default advantage (reward "
                   "minus the group's mean) gives every sample advantage 0: nothing would train. Use group_size "
                   ">= 2, or a pipeline.advantage with its own baseline")
        if env.label in labels:
            yield (f"{source(f'env[{i}].name')}: env[{i}].name: {env.label!r} is already used by "
                   f"env[{labels[env.label]}]; give each environment a distinct name")
        labels.setdefault(env.label, i)
    for i, env in enumerate(cfg.env):
        sp = env.sampling
        if sp.seed is not None and env.group_size > 1:
            yield (f"{source(f'env[{i}].sampling.seed')}: env[{i}].sampling.seed: with group_size = "
                   f"{env.group_size} every rollout of a group would sample the same tokens (no advantage to "
                   "learn from); leave it unset")
        for key in sorted(set(sp.extra_body) & OWNED_SAMPLING_KEYS):
            yield (f"{source(f'env[{i}].sampling.extra_body.{key}')}: env[{i}].sampling.extra_body.{key}: set by "
                   "the orchestrator (cache_salt: the policy version) or by verifiers' client; remove it")
        for key in sorted(set(sp.extra_body) & {f.name for f in dataclasses.fields(SamplingConfig)}):
            yield (f"{source(f'env[{i}].sampling.extra_body.{key}')}: env[{i}].sampling.extra_body.{key}: "
                   f"use env[{i}].sampling.{key}")
    if cfg.eval is not None:
        yield from _eval_checks(cfg, source)
    if not cfg.inference.servers:
        yield f"{source('inference.servers')}: inference.servers: at least one server URL is required"
    for i, url in enumerate(cfg.inference.servers):
        if not url.startswith(("http://", "https://")):
            yield (f"{source(f'inference.servers[{i}]')}: inference.servers[{i}]: expected an http:// or "
                   f"https:// URL, got {url!r}")
    t = cfg.transport
    for key, address in (("scheduler.worker_address", s.worker_address), ("transport.address", t.address)):
        if address is not None and not address.startswith(("tcp://", "ipc://")):
            yield f"{source(key)}: {key}: expected a tcp://HOST:PORT or ipc://PATH address, got {address!r}"
    if t.checkpoint_source == "marker" and t.marker_dir is None:
        yield (f"{source('transport.marker_dir')}: transport.marker_dir: required when "
               "checkpoint_source = 'marker'")
    if t.kind == "filesystem" and t.directory is None:
        yield f"{source('transport.directory')}: transport.directory: required when kind = 'filesystem'"
    if t.kind == "filesystem" and t.checkpoint_source != "marker":
        yield (f"{source('transport.checkpoint_source')}: transport.checkpoint_source: must be 'marker' when "
               "kind = 'filesystem' (there is no message channel back from the trainer)")
    yield from _prime_rl_checks(cfg, source)
    if t.keep_acked and t.kind != "zmq":
        yield (f"{source('transport.keep_acked')}: transport.keep_acked: applies only to kind = 'zmq' (kind = "
               f"{t.kind!r}: shm reuses an acknowledged step's memory; files and prime-rl's trainer report no "
               "steps to resend); remove it")
    if t.data_plane == "direct" and (t.kind != "zmq" or t.keep_acked):
        yield (f"{source('transport.data_plane')}: transport.data_plane: 'direct' needs kind = 'zmq' and keep_acked "
               f"= 0 (got kind {t.kind!r}, keep_acked {t.keep_acked}): the trainer maps the workers' pools and "
               "acknowledges each step over zmq, and an acknowledged step's columns are reused at once")
    host = re.fullmatch(r"tcp://([^\s:]+):0", t.span_address or "")
    if t.span_address is not None and (t.data_plane != "direct" or host is None or host[1] in ("*", "0.0.0.0")):
        yield (f"{source('transport.span_address')}: transport.span_address: expected tcp://HOST:0 with the host's "
               f"address or name, which workers announce to trainers (not a wildcard; each local env worker binds a "
               f"port of its own) and data_plane = 'direct', got {t.span_address!r} with data_plane = "
               f"{t.data_plane!r}")
    if t.kind == "shm" and t.address is not None and not t.address.startswith("ipc://"):
        yield (f"{source('transport.address')}: transport.address: kind = 'shm' is same-node only and needs an "
               f"ipc://PATH address (or none: ipc:// in output_dir), got {t.address!r}; use kind = 'zmq' for tcp")
    yield from _security_checks(cfg, source)
    sim = cfg.sim
    if (sim.layers == 0) != (sim.top_k == 0):
        yield f"{source('sim.top_k')}: sim.layers / sim.top_k: set both (routed experts) or neither"
    if sim.latency_max_ms is not None and sim.latency_max_ms < sim.latency_ms:
        yield f"{source('sim.latency_max_ms')}: sim.latency_max_ms: must be >= sim.latency_ms"
    if isinstance(cfg.pipeline.dump_steps, tuple):
        for i, n in enumerate(cfg.pipeline.dump_steps):
            if n < 0:
                yield (f"{source(f'pipeline.dump_steps[{i}]')}: pipeline.dump_steps[{i}]: expected a step "
                       f"number >= 0, got {n}")
    m = cfg.monitor
    if m.wandb is not None and importlib.util.find_spec("wandb") is None:
        yield (f"{source('monitor.wandb')}: monitor.wandb: needs the wandb package: "
               "pip install 'rollout-orchestrator[wandb]' (or remove [monitor.wandb])")
    if m.lag_error_ms < m.lag_warn_ms:
        yield (f"{source('monitor.lag_error_ms')}: monitor.lag_error_ms: must be >= monitor.lag_warn_ms "
               f"({m.lag_error_ms} < {m.lag_warn_ms})")


def _prime_rl_checks(cfg: JobConfig, source: Any) -> Iterable[str]:
    """kind = 'prime-rl': where the trainer is, and nothing set that it would not use."""
    t = cfg.transport
    if t.kind != "prime-rl":
        if t.trainer_dir is not None:
            yield (f"{source('transport.trainer_dir')}: transport.trainer_dir: applies only to kind = 'prime-rl' "
                   f"(kind = {t.kind!r}); remove it")
        return
    if t.trainer_dir is None:
        yield (f"{source('transport.trainer_dir')}: transport.trainer_dir: required when kind = 'prime-rl' (the "
               "trainer's output_dir, where it writes broadcasts/step_N)")
    if t.prime_rl_layout == "zmq":
        host, _, port = (t.address or "").removeprefix("tcp://").rpartition(":")
        if not (t.address or "").startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65535:
            yield (f"{source('transport.address')}: transport.address: kind = 'prime-rl' binds prime-rl's publisher "
                   f"at tcp://HOST:PORT (READY at PORT + 1), e.g. 'tcp://0.0.0.0:5555', got {t.address!r}")
    elif t.address is not None:
        yield (f"{source('transport.address')}: transport.address: unused with prime_rl_layout = 'filesystem' (the "
               "batches go to transport.trainer_dir/rollouts); remove it")
    for key in ("marker_dir", "directory"):
        if getattr(t, key) is not None:
            yield (f"{source(f'transport.{key}')}: transport.{key}: unused with kind = 'prime-rl' (its weights come "
                   "from transport.trainer_dir/broadcasts); remove it")
    if t.checkpoint_source == "marker":
        yield (f"{source('transport.checkpoint_source')}: transport.checkpoint_source: kind = 'prime-rl' reads "
               "checkpoints from transport.trainer_dir/broadcasts/step_N/STABLE; remove it")
    for i, env in enumerate(cfg.env):
        if env.label == "all":
            yield (f"{source(f'env[{i}].name')}: env[{i}].name: 'all' is reserved by prime-rl's trainer (its metrics "
                   "aggregate); name the environment otherwise")


def _security_checks(cfg: JobConfig, source: Any) -> Iterable[str]:
    """Keys set in pairs and readable; no address reachable from other hosts without authentication."""
    from orchestrator.security import is_loopback, load_authorized_keys, load_key_pair

    sec, t = cfg.security, cfg.transport
    for key, value, other in (("server_key", sec.server_key, "authorized_keys"),
                              ("authorized_keys", sec.authorized_keys, "server_key")):
        if value is None and getattr(sec, other) is not None:
            yield (f"{source(f'security.{key}')}: security.{key}: required when security.{other} is set "
                   "(CURVE needs the orchestrator's secret key and the directory of its clients' public keys)")
    for key, value, load in (("server_key", sec.server_key, load_key_pair),
                             ("authorized_keys", sec.authorized_keys, load_authorized_keys)):
        if value is not None:
            try:
                load(value)
            except KeyFileError as e:
                yield f"{source(f'security.{key}')}: security.{key}: {e}"
    binds = [("scheduler.worker_address", cfg.scheduler.worker_address, "connect as an env worker"),
             ("transport.span_address", t.span_address, "read every rollout's columns")]
    if t.kind in ("zmq", "shm"):  # the other kinds bind nothing
        binds.append(("transport.address", t.address, "read the batches and forge the trainer's acknowledgements"))
    for key, address, risk in binds:
        if address and address.startswith("tcp://") and not is_loopback(address) and sec.server_key is None:
            yield (f"{source(key)}: {key}: {address} can be reached from other hosts, and without CURVE keys "
                   f"anyone who reaches it can {risk}. Make keys (`orchestrator keys keys --name orchestrator`, "
                   "and a pair per client), then set security.server_key = \"keys/orchestrator.key_secret\" and "
                   "security.authorized_keys = the directory of the clients' public .key files (README: "
                   "Security); or bind 127.0.0.1")
    trainer, opted_in = t.address or "", sec.allow_unauthenticated_trainer
    binds_trainer = t.kind == "prime-rl" and t.prime_rl_layout == "zmq" and trainer.startswith("tcp://")
    if binds_trainer and not is_loopback(trainer) and not opted_in:
        yield (f"{source('transport.address')}: transport.address: kind = 'prime-rl' publishes batches at "
               f"{trainer} unauthenticated and unencrypted (prime-rl's trainer has no CURVE support), so anyone on "
               "that network can subscribe to them or send READY in a trainer's place. Use a loopback address "
               "(e.g. through an SSH tunnel), or set security.allow_unauthenticated_trainer = true if the network "
               "between the two hosts is trusted")
    if sec.allow_unauthenticated_trainer and t.kind != "prime-rl":
        yield (f"{source('security.allow_unauthenticated_trainer')}: security.allow_unauthenticated_trainer: "
               f"applies only to transport.kind = 'prime-rl' (kind = {t.kind!r}: ZMQ links authenticate with "
               "security.server_key and security.authorized_keys); remove it")


# ---------------------------------------------------------------------------------------------- printing


def to_toml(cfg: Any) -> str:
    """The resolved config as TOML (defaults filled in); loading the output gives the same config."""
    lines: list[str] = []
    _emit_table(cfg, "", lines)
    return "\n".join(lines).strip() + "\n"


def _emit_table(obj: Any, prefix: str, lines: list[str]) -> None:
    tables: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v is None:
            lines.append(f"# {f.name} = (unset)")
        elif dataclasses.is_dataclass(v) or (isinstance(v, tuple) and v and dataclasses.is_dataclass(v[0])):
            tables.append((f.name, v))
        else:
            lines.append(f"{f.name} = {_toml_value(v)}")
    for name, v in tables:
        full = _join(prefix, name)
        if isinstance(v, tuple):
            for item in v:
                lines += ["", f"[[{full}]]"]
                _emit_table(item, full, lines)
        else:
            lines += ["", f"[{full}]"]
            _emit_table(v, full, lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")
