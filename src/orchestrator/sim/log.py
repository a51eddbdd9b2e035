"""What a sim server saw, for tests: every admin call and every generate request.

``SimServer.log`` holds it in memory; ``GET /sim/log`` returns ``SimServer.log_json()`` so tests of subprocess
servers read the same. Each list keeps the last ``LOG_LIMIT`` entries (a server in a long benchmark must not
grow without bound); ``Counters`` keep the totals.

``GET /sim/log`` JSON::

    {"profile": "vllm-0.31", "dev_mode": true,
     "weights_path": str | null, "loads": int, "weight_version": str | null, "pause_mode": str | null,
     "counters": {"requests": int, "generated_tokens": int, "errors": int, "hangs": int, "malformed": int,
                  "drops": int, "down": int, "aborted": int, "refused_paused": int, "cache_resets": int},
     "kv": {"iterations": int, "modeled_s": float, "wall_s": float} | null,
     "admin": [{"method": "POST", "path": "/pause", "query": {"mode": "keep"}, "body": any | null,
                "status": 200}, ...],
     "generate": [{"status": 200, "cache_salt": str | null, "weights_path": str | null, "loads": int,
                   "pause_mode": str | null, "finish_reason": str | null, "fault": str | null,
                   "prompt_tokens": int, "completion_tokens": int}, ...]}

``weight_version`` is vLLM 0.31+'s engine version string (null on other profiles). ``kv`` (null without a KV
model): the engine iterations run so far, their modelled durations summed and the wall time they took, as of the
engine process's last answer (sim/kv_process.py: more wall than modelled, the machine did not keep the simulated
speed). In a generate entry,
``weights_path`` and ``loads`` are those the reply was sampled with (for a refused or failed request: those
when it was answered); ``pause_mode`` is the pause in force when the request arrived (null: running);
``fault`` names an injected fault (``error``, ``drop``, ``down``, ``malformed:<kind>``, ``hang``) or is null; a
hung request is logged when it starts hanging, with status 0 (never answered). A server
started with ``record_replies`` (``sim-inference --record-replies``) also keeps each reply's ``token_ids``
(prompt, then completion), its ``routed_experts`` as sent, and ``versions``: the ``[label, start, end]`` spans of
the engine's version label over its completion (segments.py), which profiles before 0.32 do not send; otherwise
all three are null.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

LOG_LIMIT = 10_000


@dataclass(frozen=True)
class AdminCall:
    method: str
    path: str
    query: dict[str, str]
    body: Any  # the parsed JSON body; its text when it is not JSON; None when empty
    status: int


@dataclass(frozen=True)
class GenerateCall:
    status: int
    cache_salt: str | None
    weights_path: str | None
    loads: int
    pause_mode: str | None
    finish_reason: str | None = None  # of the first choice
    fault: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] | None = None  # prompt then completion (``record_replies`` only)
    routed_experts: Any = None  # choices[0].routed_experts exactly as sent (``record_replies`` only)
    versions: list[tuple[str, int, int]] | None = None  # the label of each span of it (``record_replies`` only)


@dataclass
class Counters:
    requests: int = 0  # generate and chat requests sampled (aborted ones included)
    generated_tokens: int = 0
    errors: int = 0
    hangs: int = 0
    malformed: int = 0
    drops: int = 0
    down: int = 0  # generate/chat requests refused with 503 while ``faults.down`` (health probes are not counted)
    aborted: int = 0  # generate requests an abort pause ended
    refused_paused: int = 0  # generate requests refused with 503 during a pause (vLLM 0.33)
    cache_resets: int = 0  # prefix cache clears: a pause with clear_cache (vLLM's default), /reset_prefix_cache


@dataclass
class SimLog:
    admin: deque[AdminCall] = field(default_factory=lambda: deque(maxlen=LOG_LIMIT))
    generate: deque[GenerateCall] = field(default_factory=lambda: deque(maxlen=LOG_LIMIT))

    def to_json(self) -> dict[str, Any]:
        return {"admin": [asdict(c) for c in self.admin], "generate": [asdict(c) for c in self.generate]}
