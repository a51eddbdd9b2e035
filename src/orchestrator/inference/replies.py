"""Strict parsing of ``/inference/v1/generate`` replies into arrays.

A reply that does not match the protocol raises MalformedReply naming what is wrong: not JSON, no
choices, token strings that are not ``token_id:<id>`` of the sampled id, non-finite logprobs, routed
experts whose shape does not match their bytes or the token count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pybase64

from orchestrator.errors import MalformedReply


@dataclass(frozen=True)
class Generation:
    token_ids: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    finish_reason: str
    weight_version: int | None
    routed_experts: np.ndarray | None  # uint8 [rows, layers, top_k]
    routed_start: int


def parse_generate_reply(raw: bytes, prompt_len: int) -> Generation:
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
    logprobs_obj = choice.get("logprobs")
    content = logprobs_obj.get("content") if isinstance(logprobs_obj, dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        raise MalformedReply(f"generate reply: {len(ids)} tokens but logprobs.content has "
                             f"{len(content) if isinstance(content, list) else 'no'} entries")
    logprobs = np.empty(len(ids), dtype=np.float32)
    for i, (tok, entry) in enumerate(zip(ids, content, strict=True)):
        if not isinstance(entry, dict) or entry.get("token") != f"token_id:{tok}":
            got = entry.get("token") if isinstance(entry, dict) else entry
            raise MalformedReply(f"generate reply: logprobs.content[{i}].token is {got!r}, expected 'token_id:{tok}'")
        lp = entry.get("logprob")
        if not isinstance(lp, int | float) or not math.isfinite(lp):
            raise MalformedReply(f"generate reply: logprobs.content[{i}].logprob is {lp!r}, not a finite number")
        logprobs[i] = lp
    finish = choice.get("finish_reason")
    if not isinstance(finish, str):
        raise MalformedReply("generate reply: choices[0].finish_reason is missing")
    routed, start = _routed_experts(choice.get("routed_experts"), prompt_len + len(ids))
    version = data.get("weight_version")
    return Generation(np.asarray(ids, dtype=np.int32), logprobs, finish,
                      version if isinstance(version, int) else None, routed, start)


def _routed_experts(obj: Any, total_tokens: int) -> tuple[np.ndarray | None, int]:
    if obj is None:
        return None, 0
    if not isinstance(obj, dict):
        raise MalformedReply("generate reply: routed_experts is not an object")
    shape, start = obj.get("shape"), obj.get("start", 0)
    if (not isinstance(shape, list) or len(shape) != 3 or not all(isinstance(x, int) and x >= 0 for x in shape)
            or not isinstance(start, int)):
        raise MalformedReply(f"generate reply: routed_experts shape {shape!r} / start {start!r} is not "
                             "[rows, layers, top_k] / int")
    try:
        data = pybase64.b64decode(obj.get("data", ""), validate=True)
    except (ValueError, TypeError) as e:
        raise MalformedReply(f"generate reply: routed_experts.data is not base64: {e}") from None
    rows, layers, top_k = shape
    if len(data) != rows * layers * top_k:
        raise MalformedReply(f"generate reply: routed_experts has {len(data)} bytes, shape {shape} needs "
                             f"{rows * layers * top_k}")
    if rows != total_tokens - start:
        raise MalformedReply(f"generate reply: routed_experts has {rows} rows for {total_tokens - start} tokens "
                             f"(start {start})")
    return np.frombuffer(data, dtype=np.uint8).reshape(rows, layers, top_k), start
