"""The step boundary: one step's rollout rows and batch (``boundary``), the phases in order (``phases``), and what
each step leaves behind (``outputs``, ``dump``; a rollout's row is ``contracts/rows.py``). Run off the event loop."""
