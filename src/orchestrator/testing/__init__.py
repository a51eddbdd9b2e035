"""Fakes and fixtures for testing with the orchestrator: for this project's tests and for users' own.

Fakes implement the same Protocols as the real parts (inference servers, environment runners, trainer
links) so a test exercises real code paths over real loopback sockets, without GPUs. ``clock`` runs the timing rules
(time-outs, probes, back-offs, warnings) on a virtual clock, at full speed.
"""
