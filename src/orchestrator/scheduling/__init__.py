"""Rollout scheduling, split by job: what is sampled next (``sampler``, ``curriculum``), which groups are in
flight and when they complete (``groups``), which groups count toward a step (``gates``), evaluation rounds
(``evaluation``), and the asyncio scheduler that ties them to the env workers and the inference pool
(``scheduler``)."""
