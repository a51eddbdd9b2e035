"""The trainer's side: the public library (``receiver``, ``packing``, with ``reader`` and ``fetch`` for the direct
data plane's pools; re-exported as ``orchestrator.transport``) and the trainers built on it: the reference trainer
(``reference``, with ``learner``) and the PyTorch learner for real models (``torch_learner``, the ``[torch]``
extra)."""
