"""What both ends of the ZMQ trainer link agree on: its two addresses, how a control message is marked, and how
often an idle receiver reports. The orchestrator's side is zmq_link.py, the trainer's trainer/receiver.py."""

from __future__ import annotations

STATUS_S = 1.0  # an idle receiver reports the step it holds this often
CONTROL = b"ctl"  # frame 0 of a control message (a batch's frame 0 is a msgpack map, never these bytes)


def ckpt_address(address: str) -> str:
    """The trainer-to-orchestrator channel next to a batch address."""
    if address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        return f"tcp://{host}:{int(port) + 1}"
    return address + ".ckpt"
