"""``POST /inference/v1/generate`` requests, checked as vLLM checks them.

Read in ``vN:entrypoints/scale_out/token_in_token_out/protocol.py`` (``GenerateRequest``) and
``vN:sampling_params.py``: ``token_ids`` a non-empty list of non-negative ints and ``sampling_params`` an
object (both required; 400 otherwise); ``model`` a served name or absent (404 ``NotFoundError``, param
``model``); on 0.31+ ``cache_salt`` a non-empty str of at most 128 characters without ``@ / \\`` or NUL
(``vN:entrypoints/generate/base/protocol.py`` ``validate_cache_salt``). A missing ``max_tokens`` becomes
max_model_len minus the prompt length (``ServingTokens.serve_tokens``). Sampling keys the simulator does not
use are accepted and ignored, as vLLM drops keys outside ``SamplingParams``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.sim.profiles import Profile
from orchestrator.sim.responses import Refusal, engine_error, missing, model_not_found, validation_error

CACHE_SALT_MAX = 128
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters the simulated model uses (vLLM's names and defaults)."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    n: int = 1
    logprobs: int | None = None  # None: no logprobs in the reply; -1: every id; else the top-k per token
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0  # no stop token (EOS or stop_token_ids) is sampled before this many
    routed_experts_prompt_start: int = 0
    prompt_logprobs: int | None = None  # None: no prompt logprobs in the reply; k: each prompt token's and the top k
    detokenize: bool = True  # False: prompt logprob entries carry no decoded_token (null)


@dataclass(frozen=True)
class GenerateRequest:
    token_ids: list[int]
    sampling: SamplingParams
    model: str | None
    cache_salt: str | None
    request_id: str | None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# vLLM's messages (v031/v032:entrypoints/generate/base/protocol.py ``validate_cache_salt``, a VLLMValidationError:
# 400 BadRequestError with the parameter named; bodies observed on real 0.31 and 0.32 servers)
CACHE_SALT_EMPTY = "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
CACHE_SALT_CHARS = ("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', "
                    "or NUL. (parameter=cache_salt)")


def check_cache_salt(salt: Any, profile: Profile) -> str | None:
    if salt is None:
        return None
    if profile.strict_cache_salt:
        if not isinstance(salt, str) or not salt:
            raise engine_error(400, CACHE_SALT_EMPTY, param="cache_salt")
        if len(salt) > CACHE_SALT_MAX or any(c in salt for c in CACHE_SALT_FORBIDDEN):
            raise engine_error(400, CACHE_SALT_CHARS, param="cache_salt")
    elif not isinstance(salt, str):
        raise validation_error(("body", "cache_salt"), "string_type", "Input should be a valid string", salt)
    return salt


def _token_ids(body: Mapping[str, Any]) -> list[int]:
    ids = body.get("token_ids")
    if ids is None:
        raise missing(("body", "token_ids"), dict(body))
    if not isinstance(ids, list):
        raise validation_error(("body", "token_ids"), "list_type", "Input should be a valid list", ids)
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise validation_error(("body", "token_ids", i), "int_type", "Input should be a valid integer", t)
    if not ids:
        raise validation_error(("body", "token_ids"), "too_short",
                               "List should have at least 1 item after validation, not 0", ids)
    if any(t < 0 for t in ids):
        raise validation_error(("body", "token_ids"), "value_error",
                               "Value error, token_ids must not contain negative values", ids)
    return ids


def _sampling(raw: Any, prompt_len: int, max_model_len: int, vocab_size: int) -> SamplingParams:
    loc = ("body", "sampling_params")
    if raw is None:
        raise missing(loc, raw)
    if not isinstance(raw, dict):
        raise validation_error(loc, "dict_type", "Input should be a valid dictionary", raw)

    def bad(msg: str) -> Refusal:
        return validation_error(loc, "value_error", f"Value error, {msg}", raw)

    max_tokens = raw.get("max_tokens")
    if max_tokens is None:  # vLLM fills it in server-side
        max_tokens = max_model_len - prompt_len
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise bad(f"max_tokens must be at least 1, got {max_tokens}.")
    temperature = raw.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
        raise bad(f"temperature must be non-negative, got {temperature}.")
    top_p = raw.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0.0 < top_p <= 1.0:
        raise bad(f"top_p must be in (0, 1], got {top_p}.")
    top_k = raw.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < -1:
        raise bad(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    n = raw.get("n", 1)
    if not _is_int(n) or n < 1:
        raise bad(f"n must be at least 1, got {n}.")
    logprobs = raw.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or logprobs < -1):
        raise bad(f"logprobs must be non-negative or -1, got {logprobs}.")
    stops = raw.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(_is_int(t) for t in stops):
        raise validation_error((*loc, "stop_token_ids"), "list_type", "Input should be a valid list of integers",
                               stops)
    min_tokens = raw.get("min_tokens", 0)
    if min_tokens is None:
        min_tokens = 0
    if not _is_int(min_tokens) or min_tokens < 0:
        raise bad(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise bad(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    prompt_logprobs = raw.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if not _is_int(prompt_logprobs):
            raise validation_error((*loc, "prompt_logprobs"), "int_type", "Input should be a valid integer",
                                   prompt_logprobs)
        asked = vocab_size if prompt_logprobs == -1 else prompt_logprobs
        if asked > MAX_LOGPROBS:  # observed on 0.31.0, for -1 too (the whole vocabulary)
            raise engine_error(400, f"Requested prompt logprobs of {asked}, which is greater than max allowed: "
                               f"{MAX_LOGPROBS} (parameter=prompt_logprobs, value={asked})", param="prompt_logprobs")
        if asked < 0:
            raise bad(f"prompt_logprobs must be non-negative or -1, got {prompt_logprobs}.")
    start = raw.get("routed_experts_prompt_start", 0)
    if start is None:
        start = 0
    if not _is_int(start):
        raise validation_error((*loc, "routed_experts_prompt_start"), "int_type", "Input should be a valid integer",
                               start)
    return SamplingParams(max_tokens=min(max_tokens, max_model_len - prompt_len), temperature=float(temperature),
                          top_k=top_k, top_p=float(top_p), n=n, logprobs=logprobs, stop_token_ids=frozenset(stops),
                          ignore_eos=bool(raw.get("ignore_eos", False)), min_tokens=min_tokens,
                          routed_experts_prompt_start=start, prompt_logprobs=prompt_logprobs,
                          detokenize=bool(raw.get("detokenize", True)))


def parse_generate(body: Any, profile: Profile, *, model: str, vocab_size: int, max_model_len: int) -> GenerateRequest:
    """The checked request; ``Refusal`` (400 or 404, in vLLM's shapes) when vLLM would refuse it."""
    if not isinstance(body, dict):
        raise validation_error(("body",), "model_attributes_type",
                               "Input should be a valid dictionary or object to extract fields from", body)
    if profile.strict_cache_salt:  # 0.31+: a "before" model validator, so it runs ahead of the fields
        check_cache_salt(body.get("cache_salt"), profile)
    token_ids = _token_ids(body)
    sampling = _sampling(body.get("sampling_params"), len(token_ids), max_model_len, vocab_size)
    salt = check_cache_salt(body.get("cache_salt"), profile)
    asked = body.get("model")
    if asked is not None and asked != model:
        raise model_not_found(str(asked))
    if max(token_ids) >= vocab_size:
        raise engine_error(400, f"Token id {max(token_ids)} is out of vocabulary")
    if len(token_ids) > max_model_len:  # the messages observed on vLLM 0.31.0 (v031:v1/engine/input_processor.py)
        raise engine_error(400, f"The decoder prompt (length {len(token_ids)}) is longer than the maximum model "
                                f"length of {max_model_len}. Make sure that `max_model_len` is no smaller than the "
                                "number of text tokens.")
    if len(token_ids) == max_model_len:
        raise engine_error(400, f"The decoder prompt (length {len(token_ids)}) plus the number of requested output "
                                f"tokens (at least 1) is longer than the maximum model length of {max_model_len}. "
                                "Make sure that `max_model_len` is no smaller than the number of text tokens (prompt "
                                "+ requested output tokens).")
    start = sampling.routed_experts_prompt_start
    last = len(token_ids) if profile.start_may_equal_prompt_len else len(token_ids) - 1
    if not 0 <= start <= last:
        raise engine_error(400, f"routed_experts_prompt_start ({start}) must be within [0, {last}] for a prompt of "
                                f"{len(token_ids)} tokens")
    request_id = body.get("request_id")
    return GenerateRequest(token_ids, sampling, asked, salt, request_id if isinstance(request_id, str) else None)
