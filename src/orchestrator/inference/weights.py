"""Weight sync, one component per server protocol (``[inference] backend``): pause, load, resume, version.

Every sync pauses the engine in ``keep`` mode without clearing its cache, loads the checkpoint's weights from
a directory the engine can read, and resumes (also after a failed load). A keep pause freezes in-flight
requests; they go on under the new weights after the resume, and new requests wait meanwhile: nothing is
aborted. The prefix cache is not cleared because every generate request carries ``cache_salt`` = the policy
version it was scheduled under, so KV computed under old weights is never reused by a newer policy.

``prime-rl`` — prime-rl's inference server (``src/prime_rl/inference/vllm/server.py``, prime-rl 559b447, on
vLLM 0.26.0): ``POST /pause`` (it ignores the query and always pauses with keep, cache kept), ``POST
/update_weights {"weight_dir": DIR}`` -> ``{"status": "ok"}``, ``POST /resume``. Run it without
``VLLM_SERVER_DEV_MODE``: vLLM's own /pause and /update_weights would shadow prime-rl's.

``vllm`` — upstream vLLM with ``VLLM_SERVER_DEV_MODE=1`` (0.26 and 0.31:
``vllm/entrypoints/serve/dev/rlhf/api_router.py`` and ``serve/dev/rpc/api_router.py``; 0.32/0.33:
``vllm/entrypoints/rl/online/api_router.py``): ``POST /pause?mode=keep&clear_cache=false`` (the defaults are
mode=abort, clear_cache=true: aborted requests and a dropped cache), ``POST /collective_rpc {"method":
"reload_weights", "kwargs": {"weights_path": DIR}}``, on 0.31+ ``POST /update_weight_version {"new_version":
"<step>"}`` (the engine's version label, set between pause and resume as vLLM assumes, ``v032:v1/engine/core.py``
``_attach_weight_version``; 0.32+ replies' ``weight_versions`` name it for every output token, which is what makes
each token's ``versions`` entry exact; 0.26 has no such route and answers 404, which is fine), ``POST /resume``.
``label`` sets the same label without a load: at the start of a run (the engine says ``"default"`` until set) and
when a server rejoins without needing weights (it may have restarted). A load that fails kills a real engine at its
next request (observed on vLLM 0.31.0: ``orchestrator.sim.engine``), so a trainer must announce directories with
weights.
Without dev mode these routes do not exist (404) and full weights cannot be changed over HTTP at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.errors import CheckpointError, InferenceError
from orchestrator.inference.server import HttpStatusError, InferenceServer

log = logging.getLogger(__name__)

PAUSE_QUERY = {"mode": "keep", "clear_cache": "false"}
T = TypeVar("T")


async def resume(server: InferenceServer, timed: Timed, *, after_failure: bool = False) -> None:
    """``POST /resume`` on ``server`` within ``timed``, seen to its end even if this task is cancelled meanwhile
    (then the cancel): a run that ends during a weight sync cancels it, and a resume cut short there left the
    server paused, every request it gets from then on frozen (seen under load at the end of a test's run)."""
    what = f"resume on {server.url}" + (" after a failed sync" if after_failure else "")
    await _uncut(timed(server.request("POST", "/resume"), what, after_failure=after_failure))


async def _uncut(call: Awaitable[T]) -> T:
    """``call`` to its end (its own timeout bounds it) even if this task is cancelled meanwhile, then the cancel."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # read: cancelled, this task reports no failure of it
        raise


def weights_dir(ckpt: Checkpoint, template: str | None) -> str:
    """The directory of ``ckpt``'s weights: its own path, else ``template`` with ``{step}`` filled in."""
    if ckpt.path is not None:
        return ckpt.path
    if template is None:
        raise CheckpointError(f"checkpoint {ckpt.step} came without a path and inference.weights_path is not set: "
                              "set it (e.g. weights_path = \"/ckpt/step_{step}\") or announce checkpoints with "
                              "their path")
    return template.replace("{step}", str(ckpt.step))


class Timed(Protocol):
    """The pool's per-call timeout (``weight_sync_timeout_s``), logging a call that is slow to answer;
    ``after_failure``: a shorter bound, for the resume that follows a failed call."""

    def __call__(self, call: Awaitable[bytes], what: str, *, after_failure: bool = False) -> Awaitable[bytes]: ...


class WeightSync:
    """Pause, load, resume on one server; subclasses name the load call of their protocol."""

    backend = ""
    admin_probe = ""  # a side-effect-free GET that answers 200 only where the backend's admin routes exist
    admin_fix = ""  # what to do when it does not

    async def sync(self, server: InferenceServer, ckpt: Checkpoint, path: str, timed: Timed,
                   phases: dict[str, float] | None = None) -> None:
        """Pause, load ``path`` as the weights of step ``ckpt.step``, resume (also after a failed load, then
        best effort: the error raised is the one that failed the sync). ``phases``: each phase's wall time."""
        took = {} if phases is None else phases
        t = time.monotonic()
        try:  # pause inside: a pause cut short (cancelled at shutdown) may still have paused the server
            await timed(server.request("POST", "/pause", query=PAUSE_QUERY), f"pause on {server.url}")
            took["pause"], t = time.monotonic() - t, time.monotonic()
            await self.load(server, ckpt.step, path, timed)
            took["load"], t = time.monotonic() - t, time.monotonic()
        except BaseException:
            # a hung server would hold the sync for a second full timeout here; one that failed leaves
            # rotation and is synced again (resumed included) before it rejoins
            try:
                await resume(server, timed, after_failure=True)
            except InferenceError as e:
                log.warning("%s (it may still be paused: it is resumed before it rejoins rotation)", e)
            raise
        await resume(server, timed)
        took["resume"] = time.monotonic() - t

    async def load(self, server: InferenceServer, step: int, path: str, timed: Timed) -> None:
        raise NotImplementedError

    async def label(self, server: InferenceServer, step: int, timed: Timed) -> None:
        """Label the weights ``server`` serves as step ``step`` (where the backend has labels)."""


class PrimeRLWeights(WeightSync):
    backend = "prime-rl"
    admin_probe = "/liveness"
    admin_fix = "start prime-rl's inference server (uv run inference ...), or set inference.backend = 'vllm'"

    async def load(self, server: InferenceServer, step: int, path: str, timed: Timed) -> None:
        await timed(server.request("POST", "/update_weights", body={"weight_dir": path}),
                    f"update_weights on {server.url}")


class VLLMWeights(WeightSync):
    backend = "vllm"
    admin_probe = "/is_paused"
    admin_fix = ("start vLLM with VLLM_SERVER_DEV_MODE=1 (its pause, resume and collective_rpc routes exist only "
                 "then), or set inference.backend = 'prime-rl' for prime-rl's server")

    async def load(self, server: InferenceServer, step: int, path: str, timed: Timed) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await timed(server.request("POST", "/collective_rpc", body=body), f"reload_weights on {server.url}")
        await self.label(server, step, timed)

    async def label(self, server: InferenceServer, step: int, timed: Timed) -> None:
        try:
            await timed(server.request("POST", "/update_weight_version", body={"new_version": str(step)}),
                        f"update_weight_version on {server.url}")
        except HttpStatusError as e:
            if e.status != 404:  # 0.26 has no weight versions
                raise


def weight_sync(backend: str) -> WeightSync:
    return {"prime-rl": PrimeRLWeights, "vllm": VLLMWeights}[backend]()
