"""Teacher scoring in the env worker: every trainable sample's tokens under the frozen teacher (``[teacher]``).

On-policy distillation needs, for every token a sample holds, the teacher's logprob of that token given the tokens
before it. The env worker asks for it right after it built a rollout's samples and before it sends the rollout's
record, so the bytes never cross the orchestrator's loop and scoring scales with the workers: one request per
sample, its whole token sequence as the prompt, the logprobs of the prompt's tokens in the reply.

The request (vLLM 0.31-0.33 and prime-rl's server on 0.26; VLLM-032.md section 5; observed on vLLM 0.31.0)::

    POST {server without /v1}/inference/v1/generate
    {"model": M, "token_ids": [the sample's T tokens],
     "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": false}}

and the part of the reply read: ``"prompt_logprobs": [null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``,
one entry per prompt token, each holding the token's own logprob (``prompt_logprobs: 0``: nothing else). These are
the raw log-softmax of the teacher's logits whatever its ``--logprobs-mode`` or the request's temperature (observed:
equal to a float32 transformers recomputation to 5e-7 on a server in processed mode at temperature 0.7). vLLM
floors -inf at -9999.0, which is kept. ``max_tokens`` must be at least 1 (0 is a 400), so a sample of T tokens needs
the teacher's ``max_model_len`` >= T + 1 (observed: a 400 naming both lengths otherwise); one token is generated
and ignored.

The column a sample gets (``ref_logprobs``, float32 [T]): entry i for every token i >= 1, 0 for token 0 (no context).

Bounds and failures: at most ``TeacherSpec.max_inflight`` requests of this worker in flight (its share of
``teacher.max_inflight``); each has ``timeout_s``; a request that fails is tried again up to ``retries`` times, on
the next server, after ``retry_backoff_s`` doubling each time (a server that failed is tried after the others for
``retry_backoff_s``). Not retried: a 4xx other than 408 and 429 (the request itself is wrong: a sample longer than
the teacher's context, an unknown model), which no other attempt would change. When the attempts are spent,
``TeacherError`` names the cause as a ``Failure`` (``teacher_error``, ``teacher_timeout``, ``teacher_malformed``)
and the rollout fails with it, counted per kind: a sample of an env that distils is never sent without its column.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import time
from collections.abc import AsyncIterator, Sequence

import aiohttp
import numpy as np
import orjson

from orchestrator.columns.samples import Sample
from orchestrator.contracts.protocol import TeacherSpec
from orchestrator.errors import Failure

RETRIED_4XX = (408, 429)


class TeacherError(Exception):
    """The teacher could not score a sample: ``kind`` is the rollout's failure, the message its cause."""

    def __init__(self, kind: Failure, message: str, *, retry: bool = True) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry = retry  # another attempt could succeed


def score_body(model: str, token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The request that scores ``token_ids`` (see the module docstring)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    return orjson.dumps({"model": model, "token_ids": ids,
                         "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}},
                        option=orjson.OPT_SERIALIZE_NUMPY)


def parse_prompt_logprobs(raw: bytes, token_ids: np.ndarray) -> np.ndarray:
    """The column of a sample whose tokens are ``token_ids`` from the teacher's reply: float32 [T], 0 for the first
    token. TeacherError (``teacher_malformed``) for a reply that is not JSON, or lacks an entry with a finite logprob
    for some token."""
    try:
        reply = orjson.loads(raw)
        entries = reply["prompt_logprobs"]
    except (orjson.JSONDecodeError, TypeError, KeyError) as e:
        raise TeacherError(Failure.TEACHER_MALFORMED, f"the teacher's reply has no prompt_logprobs: "
                           f"{type(e).__name__}: {e}") from None
    n = int(token_ids.size)
    if not isinstance(entries, list) or len(entries) != n:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise TeacherError(Failure.TEACHER_MALFORMED, f"the teacher's prompt_logprobs has {got} entries for {n} tokens")
    out = np.zeros(n, np.float32)
    for i, token in enumerate(token_ids.tolist()[1:], start=1):
        entry = entries[i]
        found = entry.get(str(token)) if isinstance(entry, dict) else None
        value = found.get("logprob") if isinstance(found, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise TeacherError(Failure.TEACHER_MALFORMED, f"the teacher's prompt_logprobs[{i}] has no finite logprob "
                               f"of token {token}: {str(entry)[:120]}")
        out[i] = value
    return out


@dataclasses.dataclass
class _Server:
    root: str  # the base URL without /v1
    inflight: int = 0
    failed_until: float = 0.0  # tried after the others until then


class Teacher:
    """Scores samples under the teacher ``spec`` names (see the module docstring). ``open`` it; ``score`` one
    sequence, ``scored`` a rollout's samples."""

    def __init__(self, spec: TeacherSpec, session: aiohttp.ClientSession) -> None:
        self.spec = spec
        self._session = session
        self._servers = [_Server(url.rstrip("/").removesuffix("/v1")) for url in spec.servers]
        self._slots = asyncio.Semaphore(spec.max_inflight)  # this worker's share of teacher.max_inflight
        self.inflight = 0  # requests sent and not answered
        self.waiting = 0  # requests waiting for one of the slots
        self._turn = 0
        self._headers = {"Content-Type": "application/json"}
        key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        if key:
            self._headers["Authorization"] = f"Bearer {key}"

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, spec: TeacherSpec) -> AsyncIterator[Teacher]:
        timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            yield cls(spec, session)

    async def scored(self, samples: Sequence[Sample]) -> list[Sample]:
        """``samples`` with their ``ref_logprobs`` (scored concurrently, within the worker's bound); TeacherError
        when one cannot be (the others are cancelled)."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.score(s.token_ids)) for s in samples]
        except* TeacherError as group:
            raise group.exceptions[0] from None
        return [dataclasses.replace(s, ref_logprobs=t.result()) for s, t in zip(samples, tasks, strict=True)]

    async def score(self, token_ids: np.ndarray) -> np.ndarray:
        """The teacher's logprob of every token of ``token_ids`` (see ``parse_prompt_logprobs``), trying up to
        ``1 + retries`` times; TeacherError with the last attempt's cause."""
        if token_ids.size < 2:  # nothing has context: no request
            return np.zeros(token_ids.size, np.float32)
        body = score_body(self.spec.model, token_ids)
        error: TeacherError | None = None
        for attempt in range(self.spec.retries + 1):
            if attempt:
                await asyncio.sleep(self.spec.retry_backoff_s * 2 ** (attempt - 1))
            server = self._pick()
            try:
                return parse_prompt_logprobs(await self._request(server, body), token_ids)
            except TeacherError as e:
                error = e
                server.failed_until = time.monotonic() + self.spec.retry_backoff_s
                if not e.retry:
                    break
        assert error is not None
        tries = f" (after {attempt + 1} attempts)" if attempt else ""
        raise TeacherError(error.kind, f"teacher: {error}{tries}", retry=error.retry)

    def _pick(self) -> _Server:
        """The server to try: one that has not failed lately, with the fewest requests of ours in flight, taking
        turns among equals."""
        now = time.monotonic()
        self._turn += 1
        n = len(self._servers)
        order = [self._servers[(self._turn + i) % n] for i in range(n)]
        return min(order, key=lambda s: (s.failed_until > now, s.inflight))

    async def _request(self, server: _Server, body: bytes) -> bytes:
        """``body`` to ``server`` once one of the worker's slots is free (counted in ``waiting``, then ``inflight``)."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.inflight += 1
        server.inflight += 1
        try:
            return await self._post(server, body)
        finally:
            self.inflight -= 1
            server.inflight -= 1
            self._slots.release()

    async def _post(self, server: _Server, body: bytes) -> bytes:
        url = f"{server.root}/inference/v1/generate"
        try:
            async with self._session.post(url, data=body, headers=self._headers) as reply:
                raw = await reply.read()
                if reply.status != 200:
                    retry = reply.status >= 500 or reply.status in RETRIED_4XX
                    raise TeacherError(Failure.TEACHER_ERROR, f"{url} answered HTTP {reply.status}: "
                                       f"{raw[:200].decode(errors='replace')}", retry=retry)
                return raw
        except TimeoutError:
            raise TeacherError(Failure.TEACHER_TIMEOUT, f"{url} did not answer within {self.spec.timeout_s:g} s "
                               "(teacher.request_timeout_s)") from None
        except aiohttp.ClientError as e:
            raise TeacherError(Failure.TEACHER_ERROR, f"{url}: {type(e).__name__}: {e}") from None


def unscored(samples: Sequence[Sample]) -> list[Sample]:
    """``samples`` with a ``ref_logprobs`` column of zeros: an env that does not distil, in a job whose others do
    (a step carries the column only when every rollout has it; ``opd_weight`` 0 says it is not a teacher's)."""
    return [dataclasses.replace(s, ref_logprobs=np.zeros(s.num_tokens, np.float32)) for s in samples]
