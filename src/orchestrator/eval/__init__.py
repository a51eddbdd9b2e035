"""Evaluation: online rounds during training (``online``) and one round without a trainer (``once``)."""
