"""vLLM's ``/inference/v1/generate`` replies as verifiers 0.4.0's client reads them, and the versions they report.

verifiers 0.4.0 (``renderers`` 0.1.12, ``renderers/client.py`` ``_parse_completion_logprobs``) reads logprobs as
``{"token": "token_id:<id>", "logprob"}`` and routed experts as ``{"data": <base64 of the raw array>, "shape",
"start", "dtype"}`` (``verifiers/v1/graph.py`` ``_attribute_routed_experts``). vLLM 0.26 and 0.31 send the logprobs
that way; 0.32 and 0.33 send ``{"token_id": <id>, "logprob", "rank", "top_logprobs": [...]}``
(``v032:entrypoints/scale_out/token_in_token_out/protocol.py`` ``GenerateLogProbsContent``), and 0.33 lists every
candidate in ``top_logprobs``, the sampled token first (``v033:.../serving.py`` ``_create_tokens_logprobs``). Every
upstream vLLM sends routed experts as a base64 ``.npy`` string (``v031:``/``v032:`` ``protocol.py``
``routed_experts``), which verifiers cannot read; prime-rl's server sends the object.

``adapt_reply`` rewrites what verifiers reads of a reply, per choice: each logprobs entry gets the ``"token":
"token_id:N"`` key it checks (beside vLLM's own keys, which it ignores: ``token_id``, ``rank``, ``top_logprobs``,
whether 0.33's every candidate or 0.32's first ``max(logprobs, 1)``; -9999 values kept: verifiers rejects them, as it
should), a ``.npy`` routed-experts string becomes the object (``start``: the request's
``routed_experts_prompt_start``; ``dtype`` the narrowest of uint8/uint16 that holds the ids, ``data`` first so
verifiers' fast path splices it out). Every other field stays (``weight_versions``, ``stop_reason``,
``output_mode``: verifiers ignores them). A reply that needs none of this keeps its bytes, without being parsed when
its bytes show it (no ``token_id`` key, no ``weight_versions``, no routed-experts string). An entry or string it
cannot convert is left as it was, so verifiers reports the reply malformed, as it would without us.

Cost (scripts/perf/bench_shim.py): a JSON parse and write of the reply and a dictionary key per output token, in
the env worker.

``Reply.spans``: the first choice's ``weight_versions`` (vLLM 0.32+: spans of output tokens and the version label
that sampled them, ``v032:outputs.py`` ``WeightVersionSpan``) as step numbers (-1 where unknown,
``columns.versions.call_spans``), or None for a server that does not report them.
"""

from __future__ import annotations

import binascii
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pybase64

from orchestrator.columns.versions import CallSpans, call_spans


@dataclass(frozen=True)
class Request:
    """What the adaptation needs of a generate request body."""

    prompt_tokens: int
    routed_start: int  # sampling_params.routed_experts_prompt_start

    @classmethod
    def of(cls, body: bytes) -> Request | None:
        """The request's fields, or None for a body that is not a generate request (passed on unread)."""
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        ids = data.get("token_ids") if isinstance(data, dict) else None
        if not isinstance(ids, list):
            return None
        sp = data.get("sampling_params")
        start = sp.get("routed_experts_prompt_start") if isinstance(sp, dict) else None
        return cls(len(ids), start if isinstance(start, int) and not isinstance(start, bool) else 0)


@dataclass(frozen=True)
class Reply:
    body: bytes  # the reply as verifiers reads it (the same object as the raw bytes when nothing changed)
    token_ids: list[int] | None  # the first choice's completion (None: a reply without one)
    spans: CallSpans | None  # the first choice's weight_versions as step numbers (None: the server sends none)
    changed: bool


_NEEDS = (b'"token_id"', b'"weight_versions"', b'"routed_experts"')
_NULL_EXPERTS = (b'"routed_experts":null', b'"routed_experts": null')


def adapt_reply(raw: bytes, request: Request) -> Reply:
    """``raw`` (a 200 generate reply) in the form verifiers 0.4.0 reads (see the module docstring)."""
    if not any(key in raw for key in _NEEDS[:2]) and (_NEEDS[2] not in raw or any(n in raw for n in _NULL_EXPERTS)):
        return Reply(raw, None, None, False)  # vLLM 0.26/0.31 or prime-rl without routed experts: nothing to do
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Reply(raw, None, None, False)
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        return Reply(raw, None, None, False)
    changed = False
    for choice in choices:
        if isinstance(choice, dict):
            changed |= _logprobs(choice)
            changed |= _routed_experts(choice, request.routed_start)
    first = choices[0] if isinstance(choices[0], dict) else {}
    ids = first.get("token_ids")
    ids = ids if isinstance(ids, list) and all(isinstance(t, int) for t in ids) else None
    spans = call_spans(first["weight_versions"], len(ids)) if ids is not None and "weight_versions" in first else None
    return Reply(orjson.dumps(data) if changed else raw, ids, spans, changed)


def _logprobs(choice: dict[str, Any]) -> bool:
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list):
        return False
    changed = False
    for entry in content:  # one key per token: this loop is the adaptation's cost
        if type(entry) is dict and "token" not in entry and type(token := entry.get("token_id")) is int:
            entry["token"] = f"token_id:{token}"
            changed = True
    return changed


def _routed_experts(choice: dict[str, Any], start: int) -> bool:
    encoded = choice.get("routed_experts")
    if not isinstance(encoded, str):
        return False
    try:
        arr = np.load(io.BytesIO(pybase64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (ValueError, OSError, EOFError, SyntaxError, binascii.Error):  # not a .npy: verifiers will say so
        return False
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        return False
    hi = int(arr.max()) if arr.size else 0
    if arr.size and (int(arr.min()) < 0 or hi > 0xFFFF):
        return False
    arr = np.ascontiguousarray(arr, dtype=np.uint8 if hi <= 0xFF else np.uint16)
    choice["routed_experts"] = {"data": pybase64.b64encode(arr.tobytes()).decode("ascii"), "shape": list(arr.shape),
                                "start": start, "dtype": arr.dtype.name}
    return True
