"""The weight transfer's messages on the trainer link: what the orchestrator asks of a trainer, what it answers.

In broadcast mode (``[inference] weight_transfer = "broadcast"``) the trainer sends its weights to the inference
servers itself, as rank 0 of a group the orchestrator forms; the orchestrator tells it when to join and when to
send, over the trainer link it already has (docs/inference-servers.md, "Weights over the wire"):

- ``JoinGroup`` (a control message ``{"ctl": "transfer", "op": "join", ...}``): serve the rendezvous of group
  ``group`` on ``master_address:master_port`` (0: any free port) for ``world_size`` ranks, ``timeout_s`` for it
  and for each chunk later. The trainer answers ``listening`` (with the port) at once, then ``joined`` (with the
  tensors it can send: ``params``) once every server's worker has joined, or ``failed``.
- ``SendWeights`` (``"op": "send"``): broadcast the weights of checkpoint ``step``: the tensors ``names`` in that
  order, with these dtypes and shapes, in chunks of ``buffer_bytes``. The trainer answers ``ready`` and starts at
  once, then ``sent`` (or ``failed``); ``stale`` (with the step it ``holds``) when the weights it holds are not
  those of ``step`` (it trained on since): nothing was sent, and the orchestrator asks for the newer ones.

A trainer says it can do this by listing the backends it can send with in every status message (``"broadcast":
["gloo"]``); each answer is one status message with a ``transfer`` field (``TransferEvent``). Both are decoded at
the edge, typed (msgspec): ``decode_request`` on the trainer's side, the trainer report's decoder
(``contracts/reports.py``) on the orchestrator's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from orchestrator.errors import WireError

TRANSFER = "transfer"  # the "ctl" of an orchestrator's transfer request
MAX_PARAMS = 1_000_000  # tensors in one model: far beyond any (a 1T-parameter MoE has ~10^5)
Backend = Literal["gloo", "nccl"]
Event = Literal["listening", "joined", "ready", "sent", "stale", "failed"]


class Params(msgspec.Struct, frozen=True):
    """Tensors by name, dtype name (``"bfloat16"``) and shape, in the order they travel."""

    names: Annotated[list[str], msgspec.Meta(max_length=MAX_PARAMS)]
    dtype_names: Annotated[list[str], msgspec.Meta(max_length=MAX_PARAMS)]
    shapes: Annotated[list[list[int]], msgspec.Meta(max_length=MAX_PARAMS)]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes differ in length")

    @property
    def nbytes(self) -> int:
        """The bytes of every tensor (for log lines; a dtype name it does not know counts 4 bytes per element)."""
        total = 0
        for dtype, shape in zip(self.dtype_names, self.shapes, strict=True):
            n = 1
            for d in shape:
                n *= d
            total += n * _ITEMSIZE.get(dtype, 4)
        return total


_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}


class JoinGroup(msgspec.Struct, frozen=True, kw_only=True, tag_field="op", tag="join"):
    group: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    backend: Backend
    master_address: Annotated[str, msgspec.Meta(min_length=1)]
    master_port: Annotated[int, msgspec.Meta(ge=0, lt=65536)]
    world_size: Annotated[int, msgspec.Meta(ge=2)]
    timeout_s: Annotated[float, msgspec.Meta(gt=0)]


class SendWeights(msgspec.Struct, frozen=True, kw_only=True, tag_field="op", tag="send"):
    group: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    step: int
    params: Params
    buffer_bytes: Annotated[int, msgspec.Meta(ge=64)]


TransferRequest = JoinGroup | SendWeights


class TransferEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A trainer's answer to a ``TransferRequest`` (the module docstring says which comes when)."""

    event: Event
    group: str
    step: int | None = None  # ready, sent, stale, failed (of a send)
    port: Annotated[int, msgspec.Meta(gt=0, lt=65536)] | None = None  # listening
    params: Params | None = None  # joined
    holds: int | None = None  # stale: the checkpoint whose weights it holds (None: none announced)
    why: Annotated[str, msgspec.Meta(max_length=2000)] | None = None  # failed
    seconds: float | None = None  # sent: its side of the broadcast, wall time


def request_message(request: TransferRequest) -> dict[str, Any]:
    """``request`` as the control message's map (``{"ctl": "transfer", "op": ..., ...}``)."""
    return {"ctl": TRANSFER, **msgspec.to_builtins(request)}


def decode_request(msg: dict[str, Any]) -> TransferRequest:
    """A control message's map (``"ctl": "transfer"``) as a typed request; WireError naming what is wrong."""
    try:
        request: TransferRequest = msgspec.convert({k: v for k, v in msg.items() if k != "ctl"},
                                                   TransferRequest)
        return request
    except msgspec.ValidationError as e:
        raise WireError(f"invalid weight transfer request from the orchestrator: {e}") from None


def event_message(event: TransferEvent) -> dict[str, Any]:
    return msgspec.to_builtins(event)  # type: ignore[no-any-return]
