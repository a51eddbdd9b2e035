"""vLLM's ``vllm.general_plugins`` entry point of this package: registers the ``gloo`` weight transfer backend.

vLLM runs every general plugin once per process (API server, engine core, each worker: ``vllm/plugins/
__init__.py``, 0.31 and 0.32; ``VLLM_PLUGINS`` may name the ones allowed, unset: all). ``register`` adds
``"gloo"`` to ``WeightTransferEngineFactory`` by module path, so the engine (and torch.distributed's gloo) is
imported only by a worker that creates it, and does nothing where it is registered already (the factory raises on
a second registration of a name). Imports only vLLM and the standard library.
"""

from __future__ import annotations

BACKEND = "gloo"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "orchestrator.transfer.vllm_engine",
                                                    "GlooWeightTransferEngine")
