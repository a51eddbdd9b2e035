"""The data plane's one interface: how a step's columns reach the trainer (docs/data-plane.md).

``[transport] data_plane`` picks one of two implementations (``open_plane`` in engines.py), and outside this
package only the config and the env worker process know which runs:

- ``ThroughPlane`` (``"through"``): env workers send each rollout's columns to this process as frames; a step is
  a ``Batch`` (the step pipeline's own build) and nothing is held once it is sent.
- ``DirectPlane`` (``"direct"``, direct.py): columns stay in the env workers' pools; a step is a manifest of
  headers, its rollouts' spans are held until the trainer acknowledges it, and a step the trainer lost is built
  again.

The orchestrator asks a plane three things: the step's build (``build``), what follows its send (``after_send``),
and its background work for as long as the run lasts (``run``: none, or the pool announcements and the rebuilds
of lost steps). What the env workers are told of it comes from the config before they start (``worker_setup``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import msgspec

from orchestrator.assets import vocab_size
from orchestrator.contracts.protocol import Setup, TokenFilter, TokenFilterName
from orchestrator.scoring.config import FilterConfig
from orchestrator.scoring.filters import TOKEN_FILTERS, token_filter_args
from orchestrator.security import KeyPair, SecurityConfig, load_authorized_keys, load_key_pair

if TYPE_CHECKING:
    from orchestrator.delivery.config import TransportConfig
    from orchestrator.rollouts.groups import Group
    from orchestrator.rollouts.scheduler import Scheduler
    from orchestrator.steps.phases import Built, StepPipeline

OffLoop = Callable[..., Awaitable[Any]]


class DataPlane(Protocol):
    """See the module docstring."""

    async def build(self, pipeline: StepPipeline, step: int, groups: Sequence[Group], dropped: Sequence[Group],
                    phase_s: dict[str, float]) -> Built:
        """The step as it is sent (its phases timed in ``phase_s``), the groups its dump and samples table
        read, and the batch a dump writes."""

    def after_send(self, step: int, sent: bool) -> None:
        """``step`` was sent, or (``sent`` False) not: the trainer had it already."""

    async def run(self, sched: Scheduler) -> None:
        """The plane's background work for the run (a task of the orchestrator's TaskGroup)."""


class ThroughPlane:
    """Columns through this process: the step pipeline's build; nothing to hold, nothing in the background."""

    async def build(self, pipeline: StepPipeline, step: int, groups: Sequence[Group], dropped: Sequence[Group],
                    phase_s: dict[str, float]) -> Built:
        return await pipeline.build(step, groups, dropped, phase_s)

    def after_send(self, step: int, sent: bool) -> None:
        pass

    async def run(self, sched: Scheduler) -> None:
        pass


def worker_setup(setup: Setup, transport: TransportConfig, security: SecurityConfig,
                 filters: Sequence[FilterConfig], tokenizer: Path, out: Path) -> Setup:
    """``setup`` with what the env workers need to know of the data plane: in direct mode, their pools' size and
    directory, the token ``filters`` they run, and the keys their span servers accept."""
    t = transport
    if t.data_plane == "through":
        return setup
    return msgspec.structs.replace(setup, data_plane=t.data_plane, worker_pool_bytes=t.worker_pool_mb << 20,
                                   pool_dir=str(out / "pools"), token_filters=worker_token_filters(filters, tokenizer),
                                   span_clients=span_clients(security))


def span_clients(sec: SecurityConfig) -> list[str]:
    """Direct mode with ``[security]`` keys: the public keys the env workers' span servers accept (those of
    ``security.authorized_keys``: the job's trainers and workers; and ours, for step dumps and the samples
    table), so those servers are CURVE."""
    if sec.authorized_keys is None:
        return []
    ours = own_keys(sec)
    return sorted({k.decode() for k in load_authorized_keys(sec.authorized_keys)}
                  | ({ours.public.decode()} if ours else set()))


def own_keys(sec: SecurityConfig) -> KeyPair | None:
    """This orchestrator's key pair (a client of span servers for dumps and the samples table), or None without
    ``[security]`` keys."""
    return None if sec.server_key is None else load_key_pair(sec.server_key)


def worker_token_filters(filters: Sequence[FilterConfig], tokenizer: Path) -> list[TokenFilter]:
    """The token filters env workers run in direct mode (they have the tokens; the orchestrator does not), with
    the arguments the orchestrator would use (gibberish: the model's vocabulary size)."""
    vocab = vocab_size(tokenizer) or 2**17  # as the step builder assumes when it cannot read it
    return [TokenFilter(i, cast(TokenFilterName, f.name), token_filter_args(f, vocab))
            for i, f in enumerate(filters) if f.name in TOKEN_FILTERS]
