"""The data plane: how a step's columns reach the trainer. See docs/data-plane.md.

``samples``: a trace's columns, built in the env worker. Direct mode keeps them there: ``layout`` (where a
rollout's columns lie in its span), ``alloc`` (spans of a pool), ``memfd`` (sealed shared pools), ``store`` (an env
worker's column pool), ``spans`` and ``pools`` (which spans the orchestrator holds), ``manifest`` (the step as the
orchestrator sends it: headers only), ``unacked`` (sent steps until acknowledged), ``readback`` (the two opt-in
reads of column bytes), ``reader`` and ``fetch`` (the trainer library's side). Importable without verifiers.
"""
