"""Rollouts, the first stage: what is sampled next (``sampler``, ``curriculum``), which groups are in flight and
when they complete (``groups``), and the asyncio scheduler that admits groups to the env workers within the
off-policy bounds and hands completed groups to scoring (``scheduler``; ``faultlog`` for how failures show)."""
