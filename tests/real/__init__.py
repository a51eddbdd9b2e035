"""The real-stack tests (collected only with ``--real-stack DIR``: tests/conftest.py). A package, so that its
``conftest`` and the suite's are two modules to the type checker."""
