"""An in-process chat harness for the built-in environments: no subprocess, no sandbox.

verifiers runs a harness's ``launch()`` per rollout; every model call must go through the rollout's
interception ``endpoint`` so the trace records token ids, logprobs and routed experts. This harness makes
those calls with one ``AsyncOpenAI`` client per (endpoint, process), and per rollout a copy of it holding that
rollout's ``secret`` (which differs per rollout) over the same connection pool: building a client per rollout
costs ~53 ms of TLS setup on the worker's loop (measured in VERIFIERS.md), and keeping one per secret grew
without bound. A subclass overrides ``follow_up(data, reply, turn)`` to continue the conversation
(multi-turn): it returns the next user message, or None to end the episode.
"""

from __future__ import annotations

from typing import Any

import openai.resources  # noqa: F401 - see below
import verifiers.v1 as vf
from openai import AsyncOpenAI

# ``AsyncOpenAI.chat`` imports ``openai.resources`` on first use: over a second of CPU (many times that in wall
# time on a busy host) that would block an env worker's loop, and its heartbeats, during its first rollouts, long
# enough for the orchestrator to count a niced worker as dead (and its restart to do the same). Imported here it
# is part of loading the environment, which has its own, longer bound.

_clients: dict[str, AsyncOpenAI] = {}  # by endpoint: one per interception server of this process


def assistant_texts(trace: vf.Trace) -> list[str]:
    """The model's replies, in order, along the trace's last branch."""
    if not trace.branches:
        return []
    return [str(m.content or "") for m in trace.branches[-1].messages if m.role == "assistant"]


def _client(endpoint: str, secret: str) -> AsyncOpenAI:
    client = _clients.get(endpoint)
    if client is None:
        client = _clients[endpoint] = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
    return client.with_options(api_key=secret)  # shares the client's connections: no new TLS setup


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
        client = _client(endpoint, secret)
        for turn in range(self.config.max_turns):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)  # type: ignore[arg-type]
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
