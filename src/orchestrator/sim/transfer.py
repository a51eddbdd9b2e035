"""The simulator's weight transfer engine: vLLM's weight-transfer routes, over real gloo broadcasts.

A sim server started with ``weight_transfer="gloo"`` (``orchestrator sim-inference --weight-transfer gloo``) is a
worker of the trainer's groups as a vLLM server with our gloo engine is (``orchestrator.transfer.gloo``; torch is
imported then), and takes what it receives as its tiny policy's parameters (by name, ``orchestrator.policy``).
The routes, their replies and errors are those observed on vLLM 0.31 and 0.32 with that engine
(``orchestrator.inference.transfer`` lists them): ``GET /get_world_size`` ``{"world_size": 1}``;
``/init_weight_transfer_engine`` (joins the group: the reply waits for the rendezvous); ``/start_weight_update``;
``/update_weights`` (receives every chunk); ``/finish_weight_update`` (installs, sets the version given); 0.32+:
``/shutdown_weight_transfer_engine``. Worker errors are 500s worded as vLLM's ``collective_rpc`` wraps them
(``engine.load_error_message``). Without the engine every route but ``/get_world_size`` answers 500 "Weight
transfer not configured. Please set weight_transfer_config to enable weight transfer." (observed).

As in a real worker, received tensors go into the model as they arrive (vLLM's layerwise reload), so an update
that fails part way leaves the engine's weights neither the old ones nor the new: the simulator then samples
from what arrived over the old parameters and reports its weights as ``PARTLY`` (``weights_path`` in its log),
until a later load or update replaces them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from orchestrator.policy import Policy
from orchestrator.sim.engine import load_error_message, sanitize
from orchestrator.sim.responses import Refusal, engine_error

if TYPE_CHECKING:
    from orchestrator.transfer.gloo import GlooGroup

log = logging.getLogger(__name__)

NOT_CONFIGURED = "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
PARTLY = "(partly updated by a failed weight transfer)"
BROADCAST = "(broadcast)"  # weights_path after an update that finished


class SimTransfer:
    """One sim server's engine (``backend``: "gloo", or None: not configured)."""

    def __init__(self, backend: str | None, model: Any, *, sanitized: bool) -> None:
        self.backend = backend
        self.server = model  # the SimServer: its policy, version and counters
        self.sanitized = sanitized
        self.group: GlooGroup | None = None
        self.buffer_bytes = 0
        self.active = False
        self.received: dict[str, np.ndarray] = {}
        self.updates = 0  # finished
        self.failed = 0  # updates that failed part way

    def _error(self, message: str) -> Refusal:
        wrapped = load_error_message(message)
        return engine_error(500, sanitize(wrapped) if self.sanitized else wrapped)

    def _configured(self) -> None:
        if self.backend is None:
            raise self._error(NOT_CONFIGURED)

    async def init(self, init_info: Any) -> None:
        self._configured()
        from orchestrator.transfer.gloo import GlooGroup, GlooInitInfo, TransferFailed

        try:
            if not isinstance(init_info, dict):
                raise TypeError(f"argument after ** must be a mapping, not {type(init_info).__name__}")
            info = GlooInitInfo(**init_info)
        except (TypeError, ValueError) as e:
            raise self._error(f"Invalid init_info for GlooWeightTransferEngine: {e}") from None
        self.close()
        try:
            self.group = await asyncio.to_thread(GlooGroup.connect, info, info.rank_offset)
        except TransferFailed as e:
            raise self._error(str(e)) from None
        self.buffer_bytes = info.packed_buffer_size_bytes

    def start(self) -> None:
        self._configured()
        if self.active:
            raise self._error("start_weight_update called while a weight update is already active. Call "
                              "finish_weight_update first.")
        self.active, self.received = True, {}

    async def update(self, update_info: Any) -> None:
        self._configured()
        from orchestrator.transfer.gloo import GlooUpdateInfo, TransferFailed, plan

        if not self.active:
            raise self._error("start_weight_update must be called before update_weights.")
        try:
            if not isinstance(update_info, dict):
                raise TypeError(f"argument after ** must be a mapping, not {type(update_info).__name__}")
            info = GlooUpdateInfo(**update_info)
        except (TypeError, ValueError) as e:
            self.active = False
            raise self._error(f"Invalid update_info for GlooWeightTransferEngine: {e}") from None
        group = self.group
        if group is None:
            self.active = False
            raise self._error("gloo weight transfer not initialized: call /init_weight_transfer_engine first")

        def receive() -> None:
            if self.server.faults.transfer_stall:  # a worker that never enters the broadcast: gloo fails it later
                time.sleep(group.timeout_s)
                raise TransferFailed(f"rank {group.rank}: stalled (sim fault transfer_stall) for {group.timeout_s:g} s")
            for pairs in group.receive(plan(info, self.buffer_bytes)):
                self.received.update((name, t.numpy().copy()) for name, t in pairs)

        try:
            await asyncio.to_thread(receive)
        except TransferFailed as e:
            self.active = False
            self.failed += 1
            self._install(PARTLY)  # what arrived is in the model already, as in a real worker
            log.warning("sim server %s: weight transfer failed part way (%s); its weights are partly updated",
                        self.server.url, e)
            raise self._error(str(e)) from None

    def finish(self, version: str | None) -> None:
        self._configured()
        if not self.active:
            raise self._error("finish_weight_update called without a matching start_weight_update.")
        self.active = False
        if self.received:
            self._install(BROADCAST)
        self.updates += 1
        if version is not None:
            self.server.weight_version = version

    def shutdown(self) -> None:
        self._configured()
        if self.active:
            raise self._error("Cannot release a trainer connection during a weight update")
        self.close()

    def _install(self, label: str) -> None:
        policy = self.server.policy
        weights = {**policy.model.weights, **self.received}
        try:
            model = Policy(weights, policy.model.vocab)
        except Exception as e:  # CheckpointError: names or shapes that are not the tiny policy's
            raise self._error(f"the received tensors are not the simulator's policy: {e}") from None
        policy.install(label, model)
        self.received = {}

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
