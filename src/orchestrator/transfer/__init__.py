"""Weight transfer engines: weights from a trainer to inference servers over the wire, without the disk.

``gloo``: the gloo backend (torch.distributed's gloo over TCP, for CPUs): the rendezvous, the packing of tensors
into chunks and the broadcast both halves share; ``vllm_engine``: its worker half inside a vLLM server (vLLM's
``WeightTransferEngine``); ``vllm_plugin``: registers it with vLLM through the ``vllm.general_plugins`` entry point
this package ships. The trainer half is the trainer library's (``orchestrator.trainer.broadcast``), the
simulator's its own (``orchestrator.sim.transfer``). These modules import only torch, vLLM and the standard
library: a vLLM server's venv has our package without its dependencies (``realstack/install.py``).
"""
