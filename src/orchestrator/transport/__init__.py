"""Transport to trainers: the columnar wire format, the ZMQ link, and the trainer-side receiver.

This subpackage imports neither verifiers nor the orchestrator's scheduling code, so a trainer can use
it on its own: ``BatchReceiver(address)``, ``await receiver.recv()`` -> ``Batch``, ``await
receiver.announce(step)``.
"""

from orchestrator.transport.wire import Batch, decode, encode
from orchestrator.transport.zmq_link import BatchReceiver, BatchSender, write_marker

__all__ = ["Batch", "BatchReceiver", "BatchSender", "decode", "encode", "write_marker"]
