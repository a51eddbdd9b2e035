"""Strict parsing of an ``/inference/v1/generate`` reply, the way env workers' client will parse it.

Env workers parse generate replies with verifiers 0.4.0's ``TrainClient`` (``renderers/client.py``
``parse_generate_response`` and ``_parse_completion_logprobs``, renderers 0.1.12; ``verifiers/v1/graph.py``
``_attribute_routed_experts``), after their shim adapted them (``workers/adapter.py``: vLLM 0.32+'s logprobs
entries, upstream vLLM's ``.npy`` routed experts). Preflight sends one tiny request to each server and parses the
reply here, through the same adaptation and with the same rules, so a server whose replies that client cannot read
is found before any rollout: one entry per token ``{"token": "token_id:<id>", "logprob": <finite, not -9999>}``,
and routed experts as an object ``{"data": <base64 of the raw array>, "shape": [rows, layers, top_k], "start",
"dtype"}`` with ``tokens - 1 - start`` rows. ``Generation.weight_versions`` says whether the server reports which
weights sampled each token (vLLM 0.32+).
"""

from __future__ import annotations

import binascii
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from orchestrator.columns.versions import CallSpans
from orchestrator.errors import MalformedReply
from orchestrator.workers.adapter import Request, adapt_reply

MISSING_LOGPROB = -9999.0  # vLLM's floor; verifiers' client reads it as "no sampling evidence"
ROUTED_DTYPES = ("uint8", "uint16")


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    routed_experts: np.ndarray | None  # [rows, layers, top_k], uint8 or uint16
    routed_start: int
    weight_versions: CallSpans | None = None  # which step sampled which output tokens (None: not reported)
    adapted: bool = False  # the worker's shim rewrites such replies for verifiers (vLLM 0.32+ logprobs, .npy experts)


def parse_generate_reply(raw: bytes, prompt_len: int, *, routed_start: int = 0) -> Generation:
    """The reply's first choice as an env worker reads it (adapted by its shim, then parsed by verifiers' rules);
    MalformedReply saying what is wrong, and how to fix it when we know. ``routed_start``: what the request asked
    (``sampling_params.routed_experts_prompt_start``)."""
    reply = adapt_reply(raw, Request(prompt_len, routed_start))
    raw = reply.body
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise MalformedReply(f"generate reply is not valid JSON ({e}; {len(raw)} bytes)") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedReply("generate reply has no choices[0]")
    choice = choices[0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < 2**31 for t in ids):
        raise MalformedReply("generate reply: choices[0].token_ids is not a list of token ids (ints in [0, 2**31))")
    lps = _logprobs(choice.get("logprobs"), ids)
    finish = choice.get("finish_reason")
    routed, start = _routed_experts(choice.get("routed_experts"), prompt_len + len(ids))
    return Generation(ids, lps, finish if isinstance(finish, str) else None, routed, start, reply.spans,
                      reply.changed)


def _logprobs(obj: Any, ids: list[int]) -> list[float]:
    content = obj.get("content") if isinstance(obj, dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        raise MalformedReply(f"generate reply: {len(ids)} tokens but logprobs.content has "
                             f"{len(content) if isinstance(content, list) else 'no'} entries")
    out = []
    for i, (tok, entry) in enumerate(zip(ids, content, strict=True)):
        if not isinstance(entry, dict) or entry.get("token") != f"token_id:{tok}":
            got = entry.get("token") if isinstance(entry, dict) else entry
            raise MalformedReply(f"generate reply: logprobs.content[{i}].token is {got!r}, expected 'token_id:{tok}'")
        lp = entry.get("logprob")
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp) or lp == MISSING_LOGPROB:
            raise MalformedReply(f"generate reply: logprobs.content[{i}].logprob is {lp!r}, not a finite number")
        out.append(float(lp))
    return out


def _routed_experts(obj: Any, total_tokens: int) -> tuple[np.ndarray | None, int]:
    if obj is None:
        return None, 0
    if isinstance(obj, str):
        raise MalformedReply("routed experts come as a base64 string that is not a .npy array of expert ids "
                             "[rows, layers, top_k] (what upstream vLLM sends, and env workers convert)")
    if not isinstance(obj, dict):
        raise MalformedReply("generate reply: routed_experts is not an object")
    shape, start, dtype = obj.get("shape"), obj.get("start", 0), obj.get("dtype", "uint8")
    if (not isinstance(shape, list) or len(shape) != 3 or not all(isinstance(x, int) and x >= 0 for x in shape)
            or not isinstance(start, int) or dtype not in ROUTED_DTYPES):
        raise MalformedReply(f"generate reply: routed_experts shape {shape!r} / start {start!r} / dtype {dtype!r} is "
                             f"not [rows, layers, top_k] / int / one of {ROUTED_DTYPES}")
    try:
        data = binascii.a2b_base64(obj.get("data", ""))
    except (binascii.Error, TypeError) as e:
        raise MalformedReply(f"generate reply: routed_experts.data is not base64: {e}") from None
    rows, layers, top_k = shape
    itemsize = np.dtype(dtype).itemsize
    if len(data) != rows * layers * top_k * itemsize:
        raise MalformedReply(f"generate reply: routed_experts has {len(data)} bytes, shape {shape} of {dtype} needs "
                             f"{rows * layers * top_k * itemsize}")
    if rows not in (total_tokens - 1 - start, total_tokens - start):  # the last sampled token has no routing yet
        raise MalformedReply(f"generate reply: routed_experts has {rows} rows for {total_tokens} tokens from "
                             f"{start} (expected {total_tokens - 1 - start})")
    return np.frombuffer(data, dtype=dtype).reshape(rows, layers, top_k), start
