"""``POST /inference/v1/generate`` replies in each profile's shape (sources in ``profiles.py``).

- logprobs (only when ``sampling_params.logprobs`` is set): 0.26 and prime-rl
  ``{"token": "token_id:N", "logprob", "bytes": null, "top_logprobs": [{"token", "logprob", "bytes"}]}``;
  0.32+ ``{"token_id": N, "logprob", "rank", "top_logprobs": [{"token_id", "logprob", "rank"}]}``. The
  candidates are the sampled token first, then the k most likely others; 0.33 lists them all, the others the
  first ``max(logprobs, 1)``.
- routed experts ``[prompt + completion - 1 - start, layers, top_k]``: vLLM a base64 ``.npy`` string, uint8
  when num_experts <= 256 else uint16; prime-rl ``{"data", "shape", "start", "dtype"}`` (raw bytes, dtype by
  the largest id), in that key order, so its compact JSON holds ``"routed_experts":{"data":"``.
- 0.32+: ``choices[i].weight_versions`` spans over the output tokens, one per run of tokens a version label sampled
  (two when a keep pause cut the request: segments.py; empty without output tokens) and
  ``stop_reason``; 0.31 neither, but ``choices[i].sampling_mask`` and ``usage.completion_tokens_details`` (null),
  in the key order observed on a real 0.31.0 (OBSERVED.md); prime-rl: ``model`` and ``created`` null.

``malform`` breaks a finished reply in one of ``MALFORMED_KINDS``, in the profile's own shape.
"""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np
import orjson
import pybase64

from orchestrator.sim.policy import Sample
from orchestrator.sim.profiles import Profile

MALFORMED_KINDS = ("bad_token", "nan_logprob", "sentinel_logprob", "short_logprobs", "bad_routed_shape",
                   "truncated_json")


def routed_experts(profile: Profile, experts: np.ndarray, start: int, num_experts: int) -> str | dict[str, Any]:
    """Encode expert ids ``[rows, layers, top_k]`` as the profile's server does."""
    if profile.npy_routed_experts:
        buf = io.BytesIO()
        np.save(buf, experts.astype(np.uint8 if num_experts <= 256 else np.uint16), allow_pickle=False)
        return str(pybase64.b64encode(buf.getvalue()).decode("ascii"))
    dtype = np.uint8 if experts.size == 0 or int(experts.max()) <= 255 else np.uint16
    compact = np.ascontiguousarray(experts.astype(dtype))
    return {"data": str(pybase64.b64encode(compact.tobytes()).decode("ascii")), "shape": list(compact.shape),
            "start": start, "dtype": np.dtype(dtype).name}


def _logprob_entry(profile: Profile, token: int, logprob: float, rank: int) -> dict[str, Any]:
    if profile.token_id_logprobs:
        return {"token_id": token, "logprob": logprob, "rank": rank}
    return {"token": f"token_id:{token}", "logprob": logprob, "bytes": None}


def logprobs_content(profile: Profile, sample: Sample, asked: int) -> list[dict[str, Any]]:
    keep = None if profile.all_top_logprobs or asked < 0 else max(asked, 1)
    content = []
    for token, lp, rank, top_ids, top_lps in zip(sample.token_ids.tolist(), sample.logprobs.tolist(),
                                                 sample.ranks.tolist(), sample.top_ids.tolist(),
                                                 sample.top_logprobs.tolist(), strict=True):
        top = [(t, tlp, r + 1) for r, (t, tlp) in enumerate(zip(top_ids, top_lps, strict=True))]
        candidates = [(token, lp, rank), *(c for c in top if c[0] != token)][:keep]
        entry = _logprob_entry(profile, token, lp, rank)
        entry["top_logprobs"] = [_logprob_entry(profile, *c) for c in candidates]
        content.append(entry)
    return content


def choice(profile: Profile, index: int, sample: Sample | None, *, logprobs: int | None,
           experts: str | dict[str, Any] | None, weight_versions: list[tuple[str, int, int]]) -> dict[str, Any]:
    """One ``choices[i]``; ``sample`` None: a request an abort pause ended before any token. ``weight_versions``:
    ``(label, start, end)`` spans over its tokens (segments.py)."""
    ids = [] if sample is None else sample.token_ids.tolist()
    finish = "abort" if sample is None else sample.finish_reason
    content = None if logprobs is None else {
        "content": [] if sample is None else logprobs_content(profile, sample, logprobs)}
    if profile.reply_form == "0.31":  # observed key order (OBSERVED.md)
        return {"index": index, "logprobs": content, "finish_reason": finish, "token_ids": ids,
                "routed_experts": experts, "sampling_mask": None}
    if profile.reply_form == "0.32":  # observed key order (vLLM 0.32.0 on CPU, 2026-11-28; v033 protocol.py: same)
        spans = [{"version": v, "start": a, "end": b} for v, a, b in weight_versions] if ids else []
        return {"index": index, "finish_reason": finish, "stop_reason": None if sample is None else sample.stop_reason,
                "token_ids": ids, "routed_experts": experts, "sampling_mask": None, "weight_versions": spans,
                "logprobs": content}
    return {"index": index, "finish_reason": finish, "token_ids": ids, "logprobs": content, "routed_experts": experts}


# the null keys after ``usage``, in each form's order (0.31's and 0.32's as observed)
_TAIL_KEYS: dict[str, tuple[str, ...]] = {
    "0.26": ("prompt_logprobs", "kv_transfer_params", "ec_transfer_params"),
    "0.31": ("prompt_logprobs", "prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders", "metrics",
             "kv_transfer_params", "ec_transfer_params"),
    "0.32": ("prompt_logprobs", "prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders", "metrics",
             "kv_transfer_params", "ec_transfer_params"),
}


def generate_reply(profile: Profile, request_id: str, model: str, prompt_len: int,
                   choices: list[dict[str, Any]]) -> dict[str, Any]:
    completion = sum(len(c["token_ids"]) for c in choices)
    usage: dict[str, Any] = {"prompt_tokens": prompt_len, "total_tokens": prompt_len + completion,
                             "completion_tokens": completion, "prompt_tokens_details": None}
    if profile.reply_form != "0.26":
        usage["completion_tokens_details"] = None
    head = {"request_id": f"generate-tokens-{request_id}", "model": None if profile.prime_rl else model,
            "created": None if profile.prime_rl else int(time.time())}
    if profile.reply_form == "0.32":  # choices last, after output_mode (observed on 0.32.0, 2026-11-28)
        return {**head, "usage": usage, **dict.fromkeys(_TAIL_KEYS["0.32"]), "output_mode": "tokens",
                "choices": choices}
    return {**head, "choices": choices, "usage": usage, **dict.fromkeys(_TAIL_KEYS[profile.reply_form])}


def malformed_kinds(reply: dict[str, Any]) -> list[str]:
    """The kinds that can break this reply (routed experts and logprobs only when it has them)."""
    first = reply["choices"][0]
    content = (first.get("logprobs") or {}).get("content") or []
    return [k for k in MALFORMED_KINDS
            if (k != "bad_routed_shape" or first.get("routed_experts") is not None)
            and (k.endswith(("json", "shape")) or content)]


def malform(profile: Profile, reply: dict[str, Any], kind: str) -> bytes:
    """The reply's bytes, broken as ``kind`` says."""
    first = reply["choices"][0]
    content = (first.get("logprobs") or {}).get("content") or []
    if kind == "bad_token":
        if profile.token_id_logprobs:
            content[0]["token_id"] = content[0]["token_id"] + 1
        else:
            content[0]["token"] = "tok:" + content[0]["token"]
    elif kind == "nan_logprob":
        content[0]["logprob"] = "__nan__"  # orjson writes no NaN: patched into the bytes below
    elif kind == "sentinel_logprob":
        content[0]["logprob"] = -9999.0  # vLLM's floor: renderers reads it as "no sampling evidence"
    elif kind == "short_logprobs":
        content.pop()
    elif kind == "bad_routed_shape":
        experts = first["routed_experts"]
        if isinstance(experts, dict):
            experts["shape"] = [experts["shape"][0] + 9999, *experts["shape"][1:]]
        else:  # a valid .npy whose row count is not tokens - 1 - start
            arr = np.load(io.BytesIO(pybase64.b64decode(experts)))
            first["routed_experts"] = routed_experts(profile, np.concatenate([arr, arr[:1], arr[:1]]), 0,
                                                     256 if arr.dtype == np.uint8 else 65536)
    body = orjson.dumps(reply).replace(b'"__nan__"', b"NaN")
    return body[: len(body) // 2] if kind == "truncated_json" else body
