"""The data plane: how a step's columns reach the trainer (docs/data-plane.md). ``plane``: the one interface and
``ThroughPlane``; ``direct``: ``DirectPlane`` (columns stay in the env workers' pools), with ``manifests`` (a step
built from headers), ``unacked`` (sent steps until acknowledged, and rebuilt when lost) and ``readback`` (the two
opt-in reads of column bytes)."""
