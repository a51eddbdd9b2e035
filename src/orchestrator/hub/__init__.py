"""The orchestrator's side of the env workers: one ZMQ ROUTER (``hub``, ``router``), who is connected and ready
(``roster``, ``intake``), what is assigned where (``dispatch``), silence and restarts (``supervision``), the local
worker processes it starts (``local``) and, on the direct data plane, the workers' pools and the spans it holds in
them (``pools``, ``spans``)."""
