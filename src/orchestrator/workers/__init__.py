"""The env worker process: hosts verifiers environments (``process``, with ``envconfig`` and ``host``), runs the
groups it is assigned and sends back compact records (the messages are in ``contracts/protocol.py``; the
orchestrator's side is ``hub/``)."""
