"""A trainer's weights to the inference servers over gloo: the trainer half of ``orchestrator.transfer.gloo``.

``GlooBroadcaster(weights)`` is a ``WeightBroadcaster`` (trainer/broadcast.py): ``weights()`` returns the
trainer's current tensors by name (``model.named_parameters()`` of a Hugging Face model: the names its checkpoints
use, which vLLM's ``load_weights`` reads), torch tensors or numpy arrays; tensors on a GPU are copied to the CPU
chunk by chunk (gloo sends from host memory: on GPUs use the nccl backend). It is rank 0 of each group the
orchestrator forms, serving the rendezvous. Needs torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from orchestrator.contracts.transfer import JoinGroup, Params, SendWeights
from orchestrator.transfer.gloo import GlooGroup, GlooUpdateInfo, dtype_name, plan

log = logging.getLogger(__name__)

Weights = Callable[[], Mapping[str, Any]]  # name -> torch.Tensor or numpy array


def as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))


class GlooBroadcaster:
    backends: tuple[str, ...] = ("gloo",)

    def __init__(self, weights: Weights) -> None:
        self.weights = weights
        self.group: GlooGroup | None = None

    def listen(self, request: JoinGroup) -> int:
        if request.backend != "gloo":
            raise ValueError(f"this trainer sends with gloo, the orchestrator asks for {request.backend}")
        self.close()
        self.group = GlooGroup.listen(request.master_address, request.master_port, request.world_size,
                                      request.timeout_s)
        return self.group.port

    def join(self, request: JoinGroup) -> Params:
        assert self.group is not None, "listen first"
        self.group.join(request.group, request.master_address)
        return self.params()

    def params(self) -> Params:
        """The tensors it sends: every weight, in the order ``weights()`` gives them."""
        ts = {name: as_tensor(v) for name, v in self.weights().items()}
        return Params(list(ts), [dtype_name(t.dtype) for t in ts.values()], [list(t.shape) for t in ts.values()])

    def send(self, request: SendWeights) -> None:
        if self.group is None:
            raise RuntimeError("not in a group: the orchestrator sends a join first")
        p = request.params
        weights = self.weights()
        missing = [n for n in p.names if n not in weights]
        if missing:
            raise KeyError(f"the orchestrator asks for tensors this trainer does not have: {missing[:5]}")
        info = GlooUpdateInfo(p.names, p.dtype_names, p.shapes)
        self.group.send((as_tensor(weights[n]) for n in p.names), plan(info, request.buffer_bytes),
                        request.buffer_bytes)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
