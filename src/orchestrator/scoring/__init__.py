"""Scoring a completed group: advantages (``advantage``), which groups count toward a step (``gates``), which
rollouts are trained on (``filters``), and the user hooks named in the config (``hooks``). Pure: no I/O, no job
config import."""
