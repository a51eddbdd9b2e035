"""Weights: the loop that puts each new checkpoint on every inference server and makes it the policy
(``sync_loop``). Checkpoint announcements are a contract (``contracts/checkpoints.py``); whether a checkpoint can
load, and each server's own protocol for loading it, are the inference pool's (``inference/checkpoint_files.py``,
``inference/weights.py``)."""
