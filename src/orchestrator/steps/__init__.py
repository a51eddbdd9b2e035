"""The step boundary: one step's rollout rows and batch (``boundary``), the phases in order (``phases``), and what
each step leaves behind (``rows``, ``outputs``, ``dump``). Run off the event loop."""
