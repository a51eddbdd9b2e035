"""The data plane: rollout columns go from env workers to the trainer without crossing the orchestrator.

See docs/data-plane.md. ``layout``: where a rollout's columns lie in its span; ``alloc``: spans of a pool;
``store``: an env worker's column pool; ``manifest``: the step manifest the orchestrator sends the trainer
(headers only); ``reader``: the trainer library's side, views of the workers' pools. Importable without
verifiers.
"""

