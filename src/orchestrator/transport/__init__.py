"""Transport to trainers: the columnar wire format, the senders, and the trainer-side library.

This subpackage imports neither verifiers nor the orchestrator's scheduling code, so a trainer can use
it on its own: ``BatchReceiver(address)``, ``await receiver.recv()`` -> ``Batch``, ``await
receiver.announce(step, path)``; ``BatchReceiver(address, last_step=N, checkpoint=Checkpoint(K, path))`` for a
trainer resuming from its checkpoint (it gets the steps after N; the orchestrator learns weights K at once);
``BatchReceiver(address, keys=load_client_keys(server_key, client_key))`` for an orchestrator that binds tcp://
with CURVE keys; ``pack()`` (per-rank micro-batches of at most ``seq_len``) or
``pack_ranks()`` (prime-rl's packing: split, padded, balanced) to lay a batch out for data-parallel ranks.
An orchestrator on the direct data plane sends step manifests instead of batches: ``recv()`` still returns a
``Batch`` (gathered from the env workers' pools on this node), ``recv_view()`` a zero-copy ``StepView``.
``version_bounds``, ``sampled_by``, ``clean_context`` and ``cut_by_sync`` read which weights sampled each token
(the ``versions`` column, trainer/versions.py).

Orchestrator side, every sender (``BatchSender``: zmq and shm; ``FileBatchSender``; ``PrimeRLSender``) is a
``Sender`` over one ``DeliveryWindow`` (order, bound, acknowledgement, skip on resume, resend); the zmq and shm
link feeds one trainer at a time (``TrainerSeat``): a second one on the same address is refused.
"""

from orchestrator.contracts.checkpoints import Checkpoint, CheckpointFeed, latest_broadcast, write_marker
from orchestrator.contracts.wire import Batch, decode, encode
from orchestrator.delivery.balance import PackedMicroBatch, balanced_partition, pack_ranks
from orchestrator.delivery.filesystem import CorruptBatchFile, FileBatchReceiver, FileBatchSender
from orchestrator.delivery.primerl import PrimeRLSender
from orchestrator.delivery.primerl_wire import MICRO_BATCH_FIELDS, EncodedStep, encode_step
from orchestrator.delivery.seat import TrainerSeat
from orchestrator.delivery.sender import Sender
from orchestrator.delivery.window import DeliveryWindow
from orchestrator.delivery.zmq_link import BatchSender
from orchestrator.errors import TrainerRefused
from orchestrator.security import ClientKeys, load_client_keys
from orchestrator.trainer.packing import MicroBatch, Packing, RankBatches, pack
from orchestrator.trainer.receiver import BatchReceiver, SyncBatchReceiver
from orchestrator.trainer.versions import clean_context, cut_by_sync, sampled_by, version_bounds

__all__ = ["Batch", "BatchReceiver", "BatchSender", "Checkpoint", "CheckpointFeed", "DeliveryWindow", "Sender",
           "SyncBatchReceiver", "decode", "encode", "latest_broadcast", "write_marker"]
__all__ += ["CorruptBatchFile", "FileBatchReceiver", "FileBatchSender"]
__all__ += ["MicroBatch", "PackedMicroBatch", "Packing", "RankBatches", "balanced_partition", "pack", "pack_ranks"]
__all__ += ["MICRO_BATCH_FIELDS", "EncodedStep", "PrimeRLSender", "encode_step"]
__all__ += ["ClientKeys", "TrainerRefused", "TrainerSeat", "load_client_keys"]
__all__ += ["clean_context", "cut_by_sync", "sampled_by", "version_bounds"]
