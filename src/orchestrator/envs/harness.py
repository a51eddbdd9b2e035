"""An in-process chat harness for the built-in environments: no subprocess, no sandbox.

verifiers runs a harness's ``launch()`` per rollout; every model call must go through the rollout's
interception ``endpoint`` so the trace records token ids, logprobs and routed experts. This harness makes
those calls with one ``AsyncOpenAI`` client per endpoint and process, and sends the rollout's ``secret`` (its
bearer token) with each call. The endpoint is the interception server's, shared by every rollout it
multiplexes; only the secret is per rollout. A client per rollout (or per secret) costs ~53 ms of TLS setup
(VERIFIERS.md) and ~0.8 MB of native memory (its SSL context: OpenSSL's copy of the CA bundle, invisible to
tracemalloc) that a cache keeps for the life of the process: 0.8-0.9 MB of worker RSS per rollout, measured
with scripts/perf/soak_workers.py.

The client has no timeout of its own: its calls go to the interception server on this host, whose call to
the inference server is the one bounded (``inference.request_timeout_s``, verifiers' client read timeout), so a
hung server fails the rollout as a timeout of the provider, not of this harness.

A subclass overrides ``follow_up(data, reply, turn)`` to continue the conversation (multi-turn): it returns the
next user message, or None to end the episode.
"""

from __future__ import annotations

from typing import Any

import openai.resources.chat.completions  # noqa: F401 - the SDK imports it on first use: on the first rollout's loop
import verifiers.v1 as vf
from openai import AsyncOpenAI

_clients: dict[str, AsyncOpenAI] = {}  # by endpoint: one per interception server, a handful per process


def assistant_texts(trace: vf.Trace) -> list[str]:
    """The model's replies, in order, along the trace's last branch."""
    if not trace.branches:
        return []
    return [str(m.content or "") for m in trace.branches[-1].messages if m.role == "assistant"]


def _client(endpoint: str) -> AsyncOpenAI:
    """The process's client for ``endpoint``; each call carries its rollout's secret (``_auth``)."""
    client = _clients.get(endpoint)
    if client is None:  # the SDK insists on a key; every call overrides it with the rollout's
        client = _clients[endpoint] = AsyncOpenAI(base_url=endpoint, api_key="per-rollout", max_retries=0,
                                                  timeout=None)
    return client


def _auth(secret: str) -> dict[str, str]:
    """The header verifiers' interception server finds a rollout by (``Dialect.secret``)."""
    return {"Authorization": f"Bearer {secret}"}


class ChatHarnessConfig(vf.HarnessConfig):
    max_turns: int = 6


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, **_: Any) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        messages += prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt or ""}]
        client, auth = _client(endpoint), _auth(secret)
        for turn in range(self.config.max_turns):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages,  # type: ignore[arg-type]
                                                         extra_headers=auth)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            follow_up = self.follow_up(data, text, turn)
            if follow_up is None:
                break
            messages.append({"role": "user", "content": follow_up})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    def follow_up(self, data: vf.TaskData, reply: str, turn: int) -> str | None:
        """The next user message after the model's ``reply`` on ``turn`` (0-based); None ends the episode."""
        return None
