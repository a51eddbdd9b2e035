"""A trainer's weights to the inference servers over NCCL (GPUs): vLLM's own nccl backend, driven by the
orchestrator as the gloo one is. **Not tested here** (no GPU on these machines); written from vLLM 0.31/0.32's
``vllm/distributed/weight_transfer/nccl_engine.py`` and ``nccl_common.py``.

``NcclBroadcaster(weights)`` is a ``WeightBroadcaster`` (trainer/broadcast.py): rank 0 of the group, its
rendezvous a ``StatelessProcessGroup`` (a TCPStore) on ``master_address:master_port`` and a
``PyNcclCommunicator`` on the current CUDA device, as vLLM's ``trainer_init``; each send is vLLM's
``packed_nccl_broadcast_producer`` in chunks of ``buffer_bytes`` (the servers' ``packed_buffer_size_bytes``: the
orchestrator gives both the same), two buffers, as the servers' consumer expects. The servers are started with
``--weight-transfer-config '{"backend": "nccl"}'``. vLLM bounds no NCCL collective: a rank that died leaves the
others in the broadcast until the orchestrator's HTTP timeout (``weight_sync_timeout_s``), and the server then
needs a restart. Needs vLLM and torch with CUDA in the trainer's environment.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from typing import Any

from orchestrator.contracts.transfer import JoinGroup, Params, SendWeights

NUM_BUFFERS = 2  # vLLM's DEFAULT_PACKED_NUM_BUFFERS: what the servers' consumer uses


class NcclBroadcaster:
    backends: tuple[str, ...] = ("nccl",)

    def __init__(self, weights: Callable[[], Mapping[str, Any]]) -> None:
        self.weights = weights
        self.port = 0
        self.comm: Any = None

    def listen(self, request: JoinGroup) -> int:
        if request.backend != "nccl":
            raise ValueError(f"this trainer sends with nccl, the orchestrator asks for {request.backend}")
        self.close()
        self.port = request.master_port or _free_port(request.master_address)
        return self.port

    def join(self, request: JoinGroup) -> Params:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.comm = trainer_init({"master_address": request.master_address, "master_port": self.port,
                                  "world_size": request.world_size})
        from orchestrator.transfer.gloo import dtype_name

        ts = self.weights()
        return Params(list(ts), [dtype_name(t.dtype) for t in ts.values()], [list(t.shape) for t in ts.values()])

    def send(self, request: SendWeights) -> None:
        if self.comm is None:
            raise RuntimeError("not in a group: the orchestrator sends a join first")
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        weights = self.weights()
        packed_nccl_broadcast_producer(iterator=((n, weights[n].detach()) for n in request.params.names),
                                       group=self.comm, src=0, post_iter_func=lambda item: item[1],
                                       buffer_size_bytes=request.buffer_bytes, num_buffers=NUM_BUFFERS)

    def close(self) -> None:
        self.comm = None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
