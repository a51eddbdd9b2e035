"""Weights: where the trainer says new weights are (``checkpoints``), whether they can load (``checkpoint_files``),
and putting them on every inference server (``backends``: one per server protocol; ``sync_loop``)."""
