"""Transport to trainers: the columnar wire format, the ZMQ link, and the trainer-side receiver.

This subpackage imports neither verifiers nor the orchestrator's scheduling code, so a trainer can use
it on its own: ``BatchReceiver(address)``, ``await receiver.recv()`` -> ``Batch``, ``await
receiver.announce(step, path)``; ``BatchReceiver(address, keys=load_client_keys(server_key, client_key))`` for an
orchestrator that binds tcp:// with CURVE keys.
"""

from orchestrator.security import ClientKeys, load_client_keys
from orchestrator.transport.checkpoints import Checkpoint, write_marker
from orchestrator.transport.filesystem import CorruptBatchFile, FileBatchReceiver, FileBatchSender
from orchestrator.transport.packing import MicroBatch, Packing, RankBatches, pack
from orchestrator.transport.primerl import PrimeRLBatch, decode_primerl, encode_primerl
from orchestrator.transport.wire import Batch, decode, encode
from orchestrator.transport.zmq_link import BatchReceiver, BatchSender, SyncBatchReceiver

__all__ = ["Batch", "BatchReceiver", "BatchSender", "Checkpoint", "SyncBatchReceiver", "decode", "encode",
           "write_marker"]
__all__ += ["CorruptBatchFile", "FileBatchReceiver", "FileBatchSender"]
__all__ += ["MicroBatch", "Packing", "RankBatches", "pack"]
__all__ += ["PrimeRLBatch", "decode_primerl", "encode_primerl"]
__all__ += ["ClientKeys", "load_client_keys"]
