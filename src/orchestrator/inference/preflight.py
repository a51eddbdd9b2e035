"""Preflight: check every inference server before a run, and say in one line per problem what to fix.

For each server, concurrently (``orchestrator run`` at start, and ``orchestrator check --servers``):

1. ``GET /health`` answers 200 (any body: vLLM's is empty; 503 means its engine is dead);
2. ``GET /v1/models`` lists ``model.name`` with a ``max_model_len``;
3. the admin routes the backend needs exist (weights.py: ``/is_paused`` answers only under vLLM's
   ``VLLM_SERVER_DEV_MODE=1``; ``/liveness`` only on prime-rl's server), and neither kind is mistaken for
   the other (prime-rl's server started with dev mode has its weight routes shadowed by vLLM's);
4. ``POST /tokenize`` encodes a probe text as ``model.tokenizer`` does (a wrong or missing tokenizer);
5. one tiny ``POST /inference/v1/generate`` round trip parses the way env workers read it: through the same
   adaptation their shim applies (vLLM 0.32+'s logprobs entries, upstream vLLM's ``.npy`` routed experts), then by
   verifiers' rules (replies.py); a vLLM >= 0.30 started without ``--enable-scale-out`` answers it 404 (0.31) or
   403 (0.32, 0.33): one line naming that flag. Whether the reply says which weights sampled its tokens (vLLM
   0.32+ ``weight_versions``) is logged: it decides whether each token's ``versions`` entry is exact or bounded.

6. ``GET /server_info?config_format=json`` says which logprobs it reports; with what the job states and its
   sampling temperatures, that settles the logprobs mode every batch carries (logprobs.py: servers that
   disagree, or raw logprobs at a temperature other than 1, are problems).
7. With weights over the wire (``transfer``: the backend ``[inference.broadcast]`` names), the server has that
   weight transfer engine (transfer.py ``configured_backend``: an init it must refuse, which changes nothing).

A run first resumes each server (``resume=True``): a run killed during a weight sync leaves its servers
paused, and a paused server holds every request.

``preflight_teacher`` checks the ``[teacher]`` servers the same way, as far as a frozen model needs: reachable,
serving ``teacher.model`` with a ``max_model_len`` above the policy's (a sample of N tokens needs N + 1 there), the
policy's tokenizer (its ``/tokenize`` must encode the probe as ``model.tokenizer`` does: the teacher scores the
policy's token ids), and one scoring request whose reply env workers can read (workers/teacher.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from orchestrator.contracts.wire import LogprobsMode
from orchestrator.errors import InferenceError, MalformedReply, OrchestratorError
from orchestrator.inference.config import TeacherConfig
from orchestrator.inference.logprobs import LogprobsCheck, Settled, resolve, server_mode
from orchestrator.inference.replies import parse_generate_reply
from orchestrator.inference.server import HttpInferenceServer, HttpStatusError, InferenceServer, api_key
from orchestrator.inference.transfer import configured_backend
from orchestrator.inference.weights import PrimeRLWeights, VLLMWeights, weight_sync
from orchestrator.workers.teacher import TeacherError, parse_prompt_logprobs, score_body

log = logging.getLogger(__name__)

PROBE_TEXT = "Preflight: 12 + 30 = 42?"
CALL_TIMEOUT_S = 30.0


class PreflightError(OrchestratorError):
    """Inference servers that cannot serve this job; one line per problem, each naming the server and the fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{len(problems)} problem(s) with the inference servers:\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class ServerReport:
    url: str
    max_model_len: int | None
    problems: tuple[str, ...]
    logprobs_mode: str | None = None  # vLLM's --logprobs-mode, as its /server_info says (None: it cannot say)
    weight_versions: bool = False  # its generate replies say which weights sampled each token (vLLM 0.32+)


@dataclass(frozen=True)
class Preflight:
    """A pool that can serve the job: each server's report, and the logprobs mode every batch will carry."""

    servers: list[ServerReport]
    logprobs: Settled

    @property
    def logprobs_mode(self) -> LogprobsMode:
        return self.logprobs.mode


async def preflight(servers: list[InferenceServer], *, backend: str, model: str, tokenizer: Path,
                    resume: bool, logprobs: LogprobsCheck | None = None, transfer: str | None = None) -> Preflight:
    """Check every server and settle the logprobs mode (logprobs.py); PreflightError listing every problem
    found (nothing is raised for a good pool). ``transfer``: the weight transfer backend each must have."""
    encoded = encode_probe(tokenizer)
    reports = await asyncio.gather(*(_check(s, backend, model, encoded, resume, transfer) for s in servers))
    settled = resolve(logprobs or LogprobsCheck(), {r.url: r.logprobs_mode for r in reports})
    for warning in settled.warnings:
        log.warning("preflight: %s", warning)
    problems = [p for r in reports for p in r.problems] + list(settled.problems)
    if problems:
        raise PreflightError(problems)
    log.info("preflight: logprobs mode %s (%s)", settled.mode, settled.how)
    bounded = [r.url for r in reports if not r.weight_versions]
    if bounded:
        log.info("preflight: %d of %d servers do not say which weights sampled each token (vLLM < 0.32, prime-rl's "
                 "server): the versions column bounds their tokens by the policy a rollout started under (%s)",
                 len(bounded), len(reports), ", ".join(bounded))
    else:
        log.info("preflight: every server says which weights sampled each token: the versions column is exact")
    return Preflight(list(reports), settled)


def encode_probe(tokenizer: Path) -> list[int] | None:
    """PROBE_TEXT in ``tokenizer``'s ids, without special tokens (None when it cannot be read here)."""
    try:
        from tokenizers import Tokenizer

        return list(Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode(PROBE_TEXT,
                                                                                add_special_tokens=False).ids)
    except Exception as e:  # no tokenizers package, no tokenizer.json (a hub name): preflight checks the rest
        log.warning("preflight cannot read the tokenizer in %s (%s): tokenizers are not compared", tokenizer, e)
        return None


async def _check(server: InferenceServer, backend: str, model: str, encoded: list[int] | None,
                 resume: bool, transfer: str | None) -> ServerReport:
    problems: list[str] = []
    max_len: int | None = None

    def problem(text: str) -> ServerReport:
        problems.append(f"{server.url}: {text}")
        return ServerReport(server.url, max_len, tuple(problems))

    try:
        await _call(server, "GET", "/health")
    except HttpStatusError as e:
        return problem(f"/health answers HTTP {e.status} (503: its engine is dead); restart the server")
    except InferenceError as e:
        return problem(f"not reachable ({e}); is it running, and is inference.servers right?")
    try:
        max_len = _served(await _call(server, "GET", "/v1/models"), model)
    except ValueError as e:
        return problem(str(e))
    except InferenceError as e:
        return problem(f"GET /v1/models failed ({e}); it does not look like a vLLM-compatible server")
    problems += [f"{server.url}: {p}" for p in await _admin_problems(server, backend)]
    if transfer is not None and not problems and (wrong := await _transfer_problem(server, transfer)):
        problems.append(f"{server.url}: {wrong}")
    if problems:
        return ServerReport(server.url, max_len, tuple(problems))
    if resume:  # a run killed during a weight sync leaves the server paused: every request would wait
        await _call(server, "POST", "/resume")
    if encoded is not None and (mismatch := await _tokenizer_mismatch(server, model, encoded)):
        problems.append(f"{server.url}: {mismatch}: set model.tokenizer to the served model's tokenizer directory "
                        "(the built-in one is only for the simulated servers)")
    versions = False
    try:
        prompt = encoded or [1, 2, 3]
        body = {"model": model, "token_ids": prompt, "cache_salt": "preflight",
                "sampling_params": {"max_tokens": 2, "logprobs": 1, "temperature": 1.0}}
        reply = parse_generate_reply(await _call(server, "POST", "/inference/v1/generate", body), len(prompt))
        versions = reply.weight_versions is not None
    except MalformedReply as e:
        problems.append(f"{server.url}: env workers could not read its generate replies: {e}")
    except InferenceError as e:
        problems.append(f"{server.url}: {_generate_problem(e, 'a 2-token generate request')}")
    return ServerReport(server.url, max_len, tuple(problems), await server_mode(server), versions)


def _generate_problem(e: InferenceError, what: str) -> str:
    """One line for a generate request (``what``) that failed with ``e``. A vLLM >= 0.30 started without
    ``--enable-scale-out`` is named with its fix: 0.31 has no such route (404 ``{"detail": "Not Found"}``, observed
    on vLLM 0.31.0), 0.32 refuses it (403 PermissionDeniedError "Scale-out endpoints are disabled...", observed on
    vLLM 0.32.0)."""
    status, body = (e.status, e.body) if isinstance(e, HttpStatusError) else (0, b"")
    if status == 404 and b'"Not Found"' in body:
        why = "is not served (HTTP 404: no such route)"
    elif status == 403 and b"--enable-scale-out" in body:
        why = "is refused (HTTP 403: scale-out endpoints are disabled)"
    else:
        return f"{what} failed ({e})"
    return (f"POST /inference/v1/generate {why}: restart vllm serve with --enable-scale-out (vLLM >= 0.30 "
            "serves it only with that flag)")


async def _call(server: InferenceServer, method: str, path: str, body: Any = None) -> bytes:
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            return await server.request(method, path, body=body)
    except TimeoutError:
        raise InferenceError(f"{method} {path} had no answer within {CALL_TIMEOUT_S:.0f} s (a paused "
                             "server holds requests until POST /resume)") from None


def _served(raw: bytes, model: str, key: str = "model.name") -> int:
    """``max_model_len`` of ``model``'s card; ValueError naming what is missing (``key``: the config key naming it)."""
    try:
        cards = orjson.loads(raw).get("data")
        ids = [c.get("id") for c in cards]
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        raise ValueError(f"/v1/models answered {raw[:100]!r}, not a model list") from None
    card = next((c for c in cards if c.get("id") == model), None)
    if card is None:
        raise ValueError(f"serves {ids}, not {key} = {model!r}: set {key} to the served name")
    max_len = card.get("max_model_len")
    if not isinstance(max_len, int) or max_len <= 0:
        raise ValueError(f"its /v1/models card for {model!r} has no max_model_len")
    return max_len


async def _admin_problems(server: InferenceServer, backend: str) -> list[str]:
    """The backend's admin routes must exist, and the server must not be the other kind."""
    sync = weight_sync(backend)
    found = {}
    for probe in (VLLMWeights.admin_probe, PrimeRLWeights.admin_probe):
        try:
            await _call(server, "GET", probe)
            found[probe] = True
        except HttpStatusError as e:
            found[probe] = e.status != 404
        except InferenceError:
            found[probe] = False
    vllm_dev, prime_rl = found[VLLMWeights.admin_probe], found[PrimeRLWeights.admin_probe]
    if backend == "prime-rl" and prime_rl and vllm_dev:
        return ["prime-rl's server runs with VLLM_SERVER_DEV_MODE=1, so vLLM's /pause and /update_weights "
                "shadow prime-rl's: restart it without that variable"]
    if backend == "prime-rl" and vllm_dev:
        return ["this is upstream vLLM, not prime-rl's inference server (no /liveness route): set "
                "inference.backend = 'vllm', or start prime-rl's server (uv run inference ...)"]
    if backend == "vllm" and prime_rl:
        return ["this is prime-rl's inference server (it has /liveness): set inference.backend = 'prime-rl'"]
    if not found[sync.admin_probe]:
        return [f"no {sync.admin_probe} route, so no weight sync for backend {backend!r}: {sync.admin_fix}"]
    return []


async def _transfer_problem(server: InferenceServer, backend: str) -> str | None:
    """Whether the server has the weight transfer engine ``backend`` (None: it has)."""
    flag = f"--weight-transfer-config '{{\"backend\": \"{backend}\"}}'"
    try:
        found = await configured_backend(server, lambda call, what, **_: _timed(call, what))
    except HttpStatusError as e:
        if e.status == 404:
            return ("no /init_weight_transfer_engine route (vLLM >= 0.31 in dev mode has it), so no weights over "
                    "the wire: upgrade vLLM, or set inference.weight_transfer = 'filesystem'")
        return f"cannot tell its weight transfer engine ({e})"
    except InferenceError as e:
        return f"cannot tell its weight transfer engine ({e})"
    if found is None:
        return (f"started without a weight transfer engine: restart vllm serve with {flag} (gloo: with this "
                "package installed in the server's venv: docs/inference-servers.md), or set "
                "inference.weight_transfer = 'filesystem'")
    if found != backend:
        return (f"its weight transfer engine is {found!r}, inference.broadcast.backend is {backend!r}: restart it "
                f"with {flag}, or set the backend it has")
    return None


async def _timed(call: Any, what: str) -> bytes:
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            result: bytes = await call
            return result
    except TimeoutError:
        raise InferenceError(f"{what} had no answer within {CALL_TIMEOUT_S:.0f} s") from None


async def _tokenizer_mismatch(server: InferenceServer, model: str, encoded: list[int]) -> str | None:
    try:
        raw = await _call(server, "POST", "/tokenize", {"model": model, "prompt": PROBE_TEXT,
                                                        "add_special_tokens": False})
        theirs = orjson.loads(raw).get("tokens")
    except (InferenceError, orjson.JSONDecodeError, AttributeError) as e:
        log.warning("%s: cannot compare tokenizers (/tokenize: %s)", server.url, e)
        return None
    if theirs != encoded:
        return f"its tokenizer encodes {PROBE_TEXT!r} as {theirs}, model.tokenizer as {encoded}"
    return None


async def preflight_teacher(teacher: TeacherConfig, *, encoded: list[int] | None,
                            policy_max_len: int | None) -> list[ServerReport]:
    """Check every teacher server (see the module docstring); PreflightError listing every problem found.
    ``encoded``: the probe in the policy's tokenizer (``encode_probe``); ``policy_max_len``: the largest
    ``max_model_len`` of the policy's servers (None: not known)."""
    import aiohttp

    key = api_key(teacher.api_key_env)
    async with aiohttp.ClientSession() as session:
        servers = [HttpInferenceServer(url, session, key) for url in teacher.servers]
        reports = await asyncio.gather(*(_check_teacher(s, teacher.model, encoded, policy_max_len) for s in servers))
    problems = [p for r in reports for p in r.problems]
    if problems:
        raise PreflightError(problems)
    log.info("preflight: %d teacher server(s) ready (max_model_len %s)", len(reports),
             sorted({r.max_model_len or 0 for r in reports}))
    return list(reports)


async def _check_teacher(server: InferenceServer, model: str, encoded: list[int] | None,
                         policy_max_len: int | None) -> ServerReport:
    where = f"teacher {server.url}"
    try:
        await _call(server, "GET", "/health")
        max_len = _served(await _call(server, "GET", "/v1/models"), model, "teacher.model")
    except HttpStatusError as e:
        return ServerReport(server.url, None, (f"{where}: answers HTTP {e.status} ({e}); restart it",))
    except InferenceError as e:
        return ServerReport(server.url, None, (f"{where}: not reachable ({e}); is it running, and is "
                                               "teacher.servers right?",))
    except ValueError as e:
        return ServerReport(server.url, None, (f"{where}: {e}",))
    problems = []
    if policy_max_len is not None and max_len < policy_max_len:
        problems.append(f"{where}: max_model_len {max_len} is below the policy servers' {policy_max_len}: samples "
                        f"longer than {max_len - 1} tokens could not be scored; serve the teacher with "
                        f"--max-model-len {policy_max_len + 1}")
    elif policy_max_len is not None and max_len == policy_max_len:
        log.warning("%s: max_model_len %d equals the policy's: a sample that fills the policy's whole context cannot "
                    "be scored (it needs %d) and its rollout fails as teacher_error", where, max_len, max_len + 1)
    if encoded is not None and (mismatch := await _tokenizer_mismatch(server, model, encoded)):
        problems.append(f"{where}: {mismatch}: the teacher scores the policy's token ids, so it must use the "
                        "policy's tokenizer (distil from a model of the same tokenizer)")
    prompt = np.asarray(encoded or [1, 2, 3], np.int64)
    try:
        parse_prompt_logprobs(await _call(server, "POST", "/inference/v1/generate",
                                          orjson.loads(score_body(model, prompt))), prompt)
    except TeacherError as e:
        problems.append(f"{where}: env workers could not read its scoring replies: {e}")
    except InferenceError as e:
        problems.append(f"{where}: {_generate_problem(e, 'a scoring request (prompt_logprobs)')}")
    return ServerReport(server.url, max_len, tuple(problems))
