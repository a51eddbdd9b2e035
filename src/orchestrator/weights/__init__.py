"""Weights: where the trainer says new weights are (``checkpoints``), whether they can load
(``checkpoint_files``), and the loop that puts each new checkpoint on every inference server and makes it the
policy (``sync_loop``; each server's own protocol for it is ``inference/weights.py``)."""
