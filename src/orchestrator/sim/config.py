"""``[sim]``: the built-in simulated inference servers the demo starts (``orchestrator sim-inference`` takes the
same settings as flags)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from orchestrator.configbase import Source, opt


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
    teacher_seed: int = opt(1, ge=0, doc="with a [teacher]: the demo's simulated teacher servers score with the tiny "
                            "policy drawn from this seed (another model than the one the policy servers start from)")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        if (self.layers == 0) != (self.top_k == 0):
            yield f"{source(f'{key}.top_k')}: {key}.layers / {key}.top_k: set both (routed experts) or neither"
        if self.latency_max_ms is not None and self.latency_max_ms < self.latency_ms:
            yield f"{source(f'{key}.latency_max_ms')}: {key}.latency_max_ms: must be >= {key}.latency_ms"

    def server_profile(self, backend: str) -> str:
        """The server the simulator plays: ``profile``, else the one ``inference.backend`` names."""
        if self.profile is not None:
            return self.profile
        from orchestrator.sim.profiles import DEFAULT_PROFILE

        return "prime-rl" if backend == "prime-rl" else DEFAULT_PROFILE

    def arguments(self, model: str, backend: str, transfer: str | None = None) -> list[str]:
        """``orchestrator sim-inference`` flags for every key of this table, serving ``model`` as the server
        ``inference.backend`` names, taking weights over the wire with ``transfer`` (``inference.transfer_backend``;
        the simulator plays gloo only) (``--seed`` left to the caller: one per server)."""
        args = ["--profile", self.server_profile(backend), "--model", model, "--layers", str(self.layers),
                "--logprobs-mode", self.logprobs_mode, "--top-k", str(self.top_k),
                "--num-experts", str(self.num_experts), "--latency-ms", str(self.latency_ms),
                "--error-rate", str(self.error_rate), "--hang-rate", str(self.hang_rate),
                "--malformed-rate", str(self.malformed_rate), "--drop-rate", str(self.drop_rate)]
        if self.latency_max_ms is not None:
            args += ["--latency-max-ms", str(self.latency_max_ms)]
        if not self.dev_mode:
            args.append("--no-dev-mode")
        if not self.scale_out:
            args.append("--no-scale-out")
        if transfer == "gloo":  # weights over the wire: the servers take them
            args += ["--weight-transfer", "gloo"]
        return args
