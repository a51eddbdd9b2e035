"""Column formats and pools: a trace's columns, built once in the env worker (``samples``); where a rollout's
columns lie in its span (``layout``), spans of a pool (``alloc``), sealed shared pools (``memfd``) and an env
worker's column pool (``store``). Importable without verifiers. The data plane that moves them is ``dataplane/``;
the trainer's readers are ``trainer/reader.py`` and ``trainer/fetch.py``."""
