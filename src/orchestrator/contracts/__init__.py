"""The contracts every stage names, below all of them: the messages between env workers and the orchestrator
(``protocol``, and the hub's ``events``), the trainer wire format (``wire``) with the link's interface (``link``) and
what a trainer reports back (``reports``), a rollout's row in rollouts.jsonl (``rows``), the direct data plane's
step manifest (``manifest``) and checkpoint announcements (``checkpoints``). Importable without verifiers."""
