"""Trainers that consume the orchestrator's batches with the public trainer library (``orchestrator.transport``):
``torch_learner`` trains a real Hugging Face model with PyTorch (the ``[torch]`` extra)."""
