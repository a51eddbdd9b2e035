"""The gloo backend's worker half inside a vLLM server: vLLM's ``WeightTransferEngine`` over ``gloo.GlooGroup``.

Registered as ``"gloo"`` by ``vllm_plugin``; a server started with ``--weight-transfer-config '{"backend":
"gloo"}'`` creates one per worker (``v1/worker/gpu_worker.py`` ``load_model``, which ``CPUWorker`` inherits; vLLM
0.31 and 0.32). It does what vLLM's nccl engine does (``distributed/weight_transfer/nccl_engine.py``), over gloo:

- ``init_transfer_engine``: join the group as ``rank_offset + data_parallel_index * (TP*PP) + rank``; called again,
  it leaves the old group first (a re-formed group: a server that crashed and came back, one that joined late);
- ``start_weight_update``: vLLM's layerwise reload begins (``initialize_layerwise_reload``: each layer's tensors go
  to the meta device until all of its weights have arrived);
- ``receive_weights``: each chunk of the broadcast, as it arrives, into ``model.load_weights``;
- ``finish_weight_update``: ``finalize_layerwise_reload``.

A receive that fails (the trainer died: gloo says so at once; or it went silent for ``timeout_s``) raises after
finishing the layerwise reload, so no layer is left on the meta device (a forward pass over one would crash the
engine): the layers that had arrived whole hold the new weights, the others the old ones, one cut short has
garbage. The server answers 500; its weights are no policy until it is synced again, and the orchestrator keeps
it paused and out of rotation until then. Imports only torch, vLLM and the standard library.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from orchestrator.transfer.gloo import GlooGroup, GlooInitInfo, GlooUpdateInfo, plan

log = logging.getLogger("vllm.orchestrator_gloo")  # under "vllm": the server's log shows it


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):  # type: ignore[misc]
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: GlooGroup | None = None
        self.buffer_bytes = 0
        self.info: GlooInitInfo | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        t0 = time.monotonic()
        self.group = GlooGroup.connect(init_info, rank)
        self.info, self.buffer_bytes = init_info, init_info.packed_buffer_size_bytes
        log.info("gloo weight transfer: rank %d of %d in group %s (master %s:%d) in %.2f s", rank,
                 init_info.world_size, init_info.group, init_info.master_address, init_info.master_port,
                 time.monotonic() - t0)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        chunks = plan(update_info, self.buffer_bytes)
        t0 = time.monotonic()
        try:
            for pairs in self.group.receive(chunks):
                self.model.load_weights(pairs)
        except BaseException:
            self.finish_weight_update()  # no layer left on the meta device; the caller re-syncs this server
            raise
        log.info("gloo weight transfer: %d tensors (%.1f MB) in %d chunk(s) received and loaded in %.2f s",
                 len(update_info.names), sum(c.nbytes for c in chunks) / 2**20, len(chunks), time.monotonic() - t0)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
