"""Env workers: processes hosting verifiers environments (``process``, ``envconfig``, ``host``), the messages
between them and the orchestrator (``protocol``), and the orchestrator's side that drives them (``hub``,
``local``, ``intake``, ``events``)."""
