"""An in-process chat harness for the built-in environments: no subprocess, no sandbox.

verifiers runs a harness's ``launch()`` per rollout; every model call must go through the rollout's
interception ``endpoint`` so the trace records token ids, logprobs and routed experts. This harness makes
those calls with one ``AsyncOpenAI`` client per (endpoint, process), sending each rollout's secret (verifiers
makes one per rollout) as that request's bearer token: building a client per rollout costs ~53 ms of TLS
setup (measured in VERIFIERS.md), and clients kept per secret would grow without bound. A subclass overrides
``follow_up(data, reply, turn)`` to continue the conversation (multi-turn): it returns the next user message,
or None to end the episode.
"""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI

_clients: dict[str, AsyncOpenAI] = {}  # by endpoint


def assistant_texts(trace: vf.Trace) -> list[str]:
    """The model's replies, in order, along the trace's last branch."""
    if not trace.branches:
        return []
    return [str(m.content or "") for m in trace.branches[-1].messages if m.role == "assistant"]


def _client(endpoint: str) -> AsyncOpenAI:
    client = _clients.get(endpoint)
    if client is None:  # the key is replaced per request (each rollout's secret)
        client = _clients[endpoint] = AsyncOpenAI(base_url=endpoint, api_key="per-request", max_retries=0)
    return client


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
        client = _client(endpoint)
        auth = {"Authorization": f"Bearer {secret}"}
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
